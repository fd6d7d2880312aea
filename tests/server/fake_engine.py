"""A fake EngineClient (and a byte-level tokenizer) for fast server tests without a model.

The "model" writes a fixed script (greedy) or words drawn from random.Random(seed + choice) (temperature > 0),
or, when a test sets `FakeEngineClient.script`, exactly that text and then stops (finish_reason "stop"),
one UTF-8 byte per token, so multi-byte characters always span several tokens. Text deltas are released only at
UTF-8 character boundaries and stop strings are held back while they may still match, as the real engine's
detokenizer must. Blocks are accounted per request (ceil(tokens / block_size)) so /metrics shows leaks.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from ladle.config import EngineConfig, ModelConfig
from ladle.core.sampling_params import SamplingParams
from ladle.engine.client import (CompletionOutput, EngineClient, EngineError, EngineStats, RequestOutput,
                                 RequestRejected)
from ladle.engine.output_stream import RequestOutputStream

SPECIALS = ["<|im_start|>", "<|im_end|>"]
IM_START, IM_END = 256, 257
SCRIPT = "Hi 你好 😀! Ladle says hello, world. The quick brown fox jumps over the lazy dog. " * 8
WORDS = ["alpha", "beta", "gamma", "delta", "你好", "😀", "fox", "dog", "ladle", "soup"]


@dataclass
class _Encoding:
    input_ids: list[int]


class FakeTokenizer:
    """Bytes are tokens 0..255; 256/257 are <|im_start|>/<|im_end|> (EOS). No BOS."""

    eos_token_id = IM_END
    bos_token_id = None
    chat_template = "fake"

    def __len__(self) -> int:
        return 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for sid, special in enumerate(SPECIALS):
                if text.startswith(special, i):
                    ids.append(256 + sid)
                    i += len(special)
                    break
            else:
                ids.extend(text[i].encode())
                i += 1
        return ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        return _Encoding(self.encode(text, add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        out, buf = [], bytearray()
        for t in ids:
            if t >= 256:
                out.append(buf.decode(errors="replace"))
                buf = bytearray()
                if not skip_special_tokens:
                    out.append(SPECIALS[t - 256])
            else:
                buf.append(t)
        out.append(buf.decode(errors="replace"))
        return "".join(out)

    def convert_ids_to_tokens(self, i: int) -> str:
        return SPECIALS[i - 256] if i >= 256 else bytes([i]).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True,
                            **kwargs) -> str:
        self.last_template_kwargs = kwargs  # tests read what reached the template (tools, chat_template_kwargs)
        text = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _utf8_complete(data: bytes) -> int:
    """Length of the longest prefix of `data` that ends on a UTF-8 character boundary."""
    for back in range(1, min(4, len(data)) + 1):
        lead = data[len(data) - back]
        if lead & 0xC0 != 0x80:  # a lead byte (or ASCII): does its sequence fit in `back` bytes?
            need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
            return len(data) if need <= back else len(data) - back
    return len(data)


class _Choice:
    def __init__(self, index: int, params: SamplingParams, prompt_len: int, script: Optional[str] = None):
        self.index, self.params = index, params
        self.scripted = script is not None
        if script is not None:
            source = script.encode()
        elif params.temperature == 0:
            source = SCRIPT.encode()
        else:
            rng = random.Random(None if params.seed is None else params.seed + index)
            source = " ".join(rng.choice(WORDS) for _ in range(400)).encode()
        self.source = list(source)
        self.token_ids: list[int] = []
        self.sent = 0  # characters of text already released
        self.text = ""
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None
        self.logprobs: list = []

    def step(self) -> CompletionOutput:
        p = self.params
        tid = self.source[len(self.token_ids) % len(self.source)]
        self.token_ids.append(tid)
        k = p.logprobs or 0
        entry = [(tid, -0.5, 1)] + [((tid + j) % 256, -0.5 - j, j) for j in range(1, k + 1)]
        self.logprobs.append(entry)
        data = bytes(self.token_ids)
        text = data[:_utf8_complete(data)].decode()
        if self.scripted and len(self.token_ids) >= len(self.source):
            self.finish_reason = "stop"  # the scripted output ends as at an EOS token
        elif len(self.token_ids) >= (p.max_tokens or 1):
            self.finish_reason = "length"
            text = data.decode(errors="replace")
        hold = 0
        for s in p.stop:
            pos = text.find(s)
            if pos >= 0:
                text, self.finish_reason, self.stop_reason = text[:pos], "stop", s
                hold = 0
                break
            for n in range(min(len(s) - 1, len(text)), 0, -1):  # a suffix that may still grow into `s`
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        if self.finish_reason:
            hold = 0
        release = len(text) - hold
        delta = text[self.sent:release] if release > self.sent else ""
        self.sent = max(self.sent, release)
        self.text = text[:self.sent]
        return CompletionOutput(index=self.index, text=self.text, token_ids=list(self.token_ids), text_delta=delta,
                                token_ids_delta=[tid], logprobs=list(self.logprobs) if p.logprobs is not None
                                else None, logprobs_delta=[entry] if p.logprobs is not None else None,
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class FakeEngineClient(EngineClient):
    def __init__(self, max_model_len: int = 4096, num_blocks: int = 1000, block_size: int = 16,
                 step_delay: float = 0.002, model_name: str = "fake-model"):
        self.tokenizer = FakeTokenizer()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.engine_config = EngineConfig(model=ModelConfig(model="fake-model-path", max_model_len=max_model_len))
        self.block_size, self.num_blocks, self.step_delay = block_size, num_blocks, step_delay
        self.running: dict[str, int] = {}  # request id -> blocks held
        self.seen_ids: list[str] = []
        self.aborted: list[str] = []
        self.healthy = True
        self.fail_after: Optional[int] = None  # tokens after which a step "raises" (finish_reason error)
        self.reject_message: Optional[str] = None  # raise RequestRejected(message) at admission
        self.script: Optional[str] = None  # the exact output of every choice (then finish_reason "stop")
        self.last_params: Optional[SamplingParams] = None
        self.stats = EngineStats(num_total_blocks=num_blocks)

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: Optional[str] = None, stream_interval: int = 1) -> AsyncIterator[RequestOutput]:
        """Each step's output goes through a RequestOutputStream as the real clients' do (so --stream-interval paces
        it there); the stream is read right after each put, in this task: a consumer that always keeps up."""
        if not self.healthy:
            raise EngineError("engine loop is dead")
        p = sampling_params
        if self.reject_message:
            raise RequestRejected(self.reject_message)
        if len(prompt_token_ids) + (p.max_tokens or 0) > self.max_model_len:
            raise RequestRejected(f"fake: {len(prompt_token_ids)} + {p.max_tokens} > {self.max_model_len}")
        rid = request_id or "cmpl-fake"
        assert rid not in self.running, f"duplicate internal request id {rid}"
        self.seen_ids.append(rid)
        self.last_params = p
        choices = [_Choice(i, p, len(prompt_token_ids), self.script) for i in range(p.n)]
        self.stats.prompt_tokens_total += len(prompt_token_ids)
        prompt_lps = None
        if p.prompt_logprobs is not None:
            prompt_lps = [None] + [[(t, -1.0, 1)] for t in prompt_token_ids[1:]]
        stream = RequestOutputStream(stream_interval)
        try:
            first = True
            while True:
                held = sum(math.ceil((len(prompt_token_ids) + len(c.token_ids) + 1) / self.block_size)
                           for c in choices)
                self.running[rid] = held
                await asyncio.sleep(self.step_delay)
                outs = [c.step() for c in choices if c.finish_reason is None]
                self.stats.generation_tokens_total += len(outs)
                if self.fail_after is not None and len(choices[0].token_ids) >= self.fail_after:
                    for o in outs:
                        o.finish_reason, o.error = "error", "fake step failure"
                done = all(c.finish_reason is not None for c in choices) or any(o.finish_reason == "error"
                                                                               for o in outs)
                if done:
                    self.running.pop(rid, None)
                stream.put(RequestOutput(request_id=rid, prompt_token_ids=list(prompt_token_ids), outputs=outs,
                                         finished=done, num_cached_tokens=0, queue_time=0.001 if first else None,
                                         prompt_logprobs=prompt_lps if first else None))
                if stream.ready():
                    yield await stream.get()  # at once: ready
                first = False
                if done:
                    return
        finally:
            self.running.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.pop(request_id, None)

    def is_healthy(self) -> bool:
        return self.healthy

    def get_stats(self) -> EngineStats:
        s = self.stats
        used = sum(self.running.values())
        s.num_running = len(self.running)
        s.num_free_blocks = self.num_blocks - used
        s.kv_cache_usage = used / self.num_blocks
        return s

    async def shutdown(self) -> None:
        self.healthy = False
