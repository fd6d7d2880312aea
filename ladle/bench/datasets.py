"""Workloads for `ladle bench serve`: random, sharegpt-style conversations, custom JSONL.

Random (bench_methodology.md §1.5, vLLM `vllm/benchmarks/datasets/random.py`):
- lengths, with r = --random-range-ratio and s = tokenizer.num_special_tokens_to_add():
  mode "vllm" (default): input ~ U[floor((Lin-s)(1-r)), ceil((Lin-s)(1+r))], output ~ U[max(1, floor(Lout(1-r))),
  ceil(Lout(1+r))]; mode "inferencex" (InferenceX's/SGLang's old rule): input ~ U[int((Lin-s)r), Lin-s], output ~
  U[max(1, int(Lout r)), Lout]. Integer-uniform, both ends included.
- draws from numpy.default_rng(seed) in vLLM's order: input lengths, output lengths, offsets in [0, vocab), then the
  --random-prefix-len prefix ids (shared by every prompt); the body of request i is allowed[(offset + i + k) mod
  len(allowed)], k = 0..len-1, where allowed = the base vocabulary minus special ids.
- the ids are decoded to text and re-encoded; too long -> truncated, too short -> padded with random ids from the
  whole vocabulary; up to 10 rounds. The recorded prompt_len is the final re-tokenised length, which may differ
  from the drawn one (vLLM does the same and warns with the summed mismatch). Padding uses a per-request
  generator default_rng([seed, i]) (vLLM shares one stream) so prompts can be built in parallel deterministically.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ladle.bench.tokenizer import BenchTokenizer


@dataclass
class SampleRequest:
    """prompt: text or token ids; prompt_len: tokens (client's count); expected_output_len: max_tokens to send."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    request_id: str = ""


def random_length_bounds(
    input_len: int, output_len: int, range_ratio: float, num_special: int, mode: str = "vllm"
) -> tuple[int, int, int, int]:
    """(input_low, input_high, output_low, output_high), inclusive. Raises ValueError for a bad ratio or mode."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    real_in = max(0, input_len - num_special)
    if mode == "vllm":
        in_lo, in_hi = math.floor(real_in * (1 - range_ratio)), math.ceil(real_in * (1 + range_ratio))
        out_lo, out_hi = math.floor(output_len * (1 - range_ratio)), math.ceil(output_len * (1 + range_ratio))
    elif mode == "inferencex":
        in_lo, in_hi = int(real_in * range_ratio), real_in
        out_lo, out_hi = int(output_len * range_ratio), output_len
    else:
        raise ValueError(f"unknown --random-range-mode {mode!r}")
    return in_lo, in_hi, max(out_lo, 1), max(out_hi, 1)


def decode_to_target_len(
    tok: BenchTokenizer, ids: list[int], target: int, rng: np.random.Generator, max_rounds: int = 10
) -> tuple[str, int]:
    """Text whose re-tokenised length is as close to `target` as 10 decode/encode rounds get; returns (text, len)."""
    text = tok.decode(ids)
    enc = tok.encode(text)
    for _ in range(max_rounds):
        if len(enc) == target:
            break
        if len(enc) > target:
            enc = enc[:target]
        else:
            enc = enc + rng.integers(0, tok.vocab_size, size=target - len(enc)).tolist()
        text = tok.decode(enc)
        enc = tok.encode(text)
    return text, len(enc)


def sample_random(
    tok: BenchTokenizer,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    range_mode: str = "vllm",
    num_workers: int = 16,
) -> list[SampleRequest]:
    """The random workload (see the module docstring). Raises ValueError if a prompt could be empty."""
    in_lo, in_hi, out_lo, out_hi = random_length_bounds(
        input_len, output_len, range_ratio, tok.num_special_tokens_to_add, range_mode
    )
    if prefix_len + in_lo < 1:
        raise ValueError("--random-input-len too small: the shortest prompt would be empty")
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    offsets = rng.integers(0, tok.vocab_size, size=num_requests)
    allowed = np.array(sorted(set(range(tok.vocab_size)) - tok.special_ids), dtype=np.int64)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []

    def build(i: int) -> SampleRequest:
        body = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)].tolist()
        target = prefix_len + int(input_lens[i])
        text, n = decode_to_target_len(tok, prefix + body, target, np.random.default_rng([seed, i]))
        return SampleRequest(text, n, int(output_lens[i]), str(i))

    with ThreadPoolExecutor(max_workers=max(1, num_workers)) as pool:
        requests = list(pool.map(build, range(num_requests)))
    drawn = int(input_lens.sum()) + prefix_len * num_requests
    mismatch = sum(r.prompt_len for r in requests) - drawn
    if mismatch:
        print(f"WARNING: re-tokenised prompts have {mismatch:+d} tokens against the drawn lengths", file=sys.stderr)
    return requests


def _oversample(reqs: list[SampleRequest], num: int, seed: int) -> list[SampleRequest]:
    if len(reqs) >= num or not reqs:
        return reqs[:num]
    rnd = random.Random(seed)
    extra = [rnd.choice(reqs) for _ in range(num - len(reqs))]
    return reqs + [SampleRequest(r.prompt, r.prompt_len, r.expected_output_len, str(len(reqs) + j))
                   for j, r in enumerate(extra)]


def _read_json_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)


def sample_sharegpt(
    tok: BenchTokenizer, path: str, num_requests: int, output_len: int | None, seed: int, oversample: bool = True
) -> list[SampleRequest]:
    """ShareGPT-style records {"conversations": [{"from", "value"}, ...]} (JSON list or JSONL). As vLLM: shuffled
    with random.seed(seed); prompt = turn 0, reference completion = turn 1; kept when prompt and output have >= 4
    tokens, prompt <= 1024 and prompt + output <= 2048 (unless --sharegpt-output-len fixes the output)."""
    data = [d for d in _read_json_records(path) if len(d.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(data)
    out: list[SampleRequest] = []
    for d in data:
        if len(out) >= num_requests:
            break
        prompt, completion = d["conversations"][0]["value"], d["conversations"][1]["value"]
        p_len = len(tok.encode(prompt))
        o_len = output_len if output_len is not None else len(tok.encode(completion))
        if output_len is None and (p_len < 4 or o_len < 4 or p_len > 1024 or p_len + o_len > 2048):
            continue
        out.append(SampleRequest(prompt, p_len, o_len, str(len(out))))
    return _oversample(out, num_requests, seed) if oversample else out


def sample_custom(
    tok: BenchTokenizer,
    path: str,
    num_requests: int,
    output_len: int,
    seed: int,
    shuffle: bool = True,
    chat_template: bool = True,
    oversample: bool = True,
) -> list[SampleRequest]:
    """JSONL with a "prompt" field per line (vLLM's custom dataset); an optional per-line "output_tokens" overrides
    --custom-output-len (ladle extension). The chat template is applied only with a local tokenizer that has one."""
    rows = _read_json_records(path)
    if any("prompt" not in r for r in rows):
        raise ValueError(f"{path}: every line needs a 'prompt' field")
    if shuffle:
        random.Random(seed).shuffle(rows)
    out: list[SampleRequest] = []
    for r in rows[: num_requests if num_requests > 0 else len(rows)]:
        prompt = r["prompt"]
        if chat_template and hasattr(tok, "chat_prompt") and getattr(tok.hf, "chat_template", None):
            prompt = tok.chat_prompt(prompt)
        out.append(SampleRequest(prompt, len(tok.encode(prompt)), int(r.get("output_tokens", output_len)),
                                 str(len(out))))
    return _oversample(out, num_requests, seed) if oversample and num_requests > 0 else out


def align_to_server(server_tok: BenchTokenizer, reqs: Sequence[SampleRequest]) -> list[SampleRequest]:
    """vLLM's alignment: if the server counts prompt 0 differently from the client, re-tokenise every prompt on the
    server and cut the too-long ones to their recorded length with /detokenize."""
    if not reqs or not isinstance(reqs[0].prompt, str):
        return list(reqs)
    if len(server_tok.encode(reqs[0].prompt)) == reqs[0].prompt_len:
        return list(reqs)
    print("WARNING: the server tokenizer disagrees with the local one; re-aligning prompts", file=sys.stderr)

    def fix(r: SampleRequest) -> SampleRequest:
        ids = server_tok.encode(r.prompt)
        if len(ids) <= r.prompt_len:
            return r
        return SampleRequest(server_tok.decode(ids[: r.prompt_len]), r.prompt_len, r.expected_output_len,
                             r.request_id)

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(fix, reqs))
