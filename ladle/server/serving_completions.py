"""POST /v1/completions: prompt forms, echo, logprobs (OpenAI's legacy format), streaming and not.

Choice index = prompt_index * n + choice_index (OpenAI/vLLM order for a batch of prompts).
`max_tokens: 0` returns the prompt (echo) or nothing, with finish_reason "length"; with echo + logprobs it
still returns the prompt logprobs (lm-eval's scoring pattern): the engine runs one token that is discarded.
"""

from __future__ import annotations

from typing import AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ladle.core.outputs import TokenLogprobs
from ladle.server.errors import OpenAIError
from ladle.server.metrics import RequestTimer
from ladle.server.protocol import (CompletionLogprobs, CompletionRequest, CompletionResponse,
                                   CompletionResponseChoice, random_id)
from ladle.server.serving_common import (ClientDisconnected, PromptRun, ServingContext, clamp_logprob, collect_runs,
                                         include_usage, make_sampling_params, make_usage, merge_runs, prepare,
                                         resolve_max_tokens, sse_body, stop_reason_or_none, stream_runs)
from ladle.server.stream_chunks import SSE_DONE, SSEFrame
from ladle.server.validation import check_logprobs_count, check_sampling_fields

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def _prompts(ctx: ServingContext, prompt: Union[str, list], need_text: bool) -> list[tuple[list[int], str]]:
    """Normalise the four prompt forms to (token ids, text) pairs; 400 on empty or out-of-vocabulary ids. Token-id
    prompts are decoded only when `need_text` (echo): the text is read nowhere else, and decoding a long prompt
    blocks the event loop."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise OpenAIError("The prompt is empty; send at least one prompt.", 400, "prompt")
    limit = ctx.limits.max_prompts_per_request
    if len(items) > limit:
        raise OpenAIError(f"prompt holds {len(items)} prompts; at most {limit} are allowed in one request "
                          f"(--max-prompts-per-request)", 400, "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((list(ctx.tokenizer.encode(item)), item))
        else:
            ctx.check_token_ids(item, "prompt")
            out.append((list(item), ctx.tokenizer.decode(item) if need_text else ""))
    return out


def _new_logprobs() -> dict[str, list]:
    """Legacy-format logprobs as a plain dict (CompletionLogprobs' fields; a stream chunk encodes it as is)."""
    return {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}


def _append_logprobs(ctx: ServingContext, lp: dict[str, list], token_ids: list[int],
                     entries: Optional[list[Optional[TokenLogprobs]]], k: int, offset: int) -> int:
    """Append tokens to `lp` (from _new_logprobs: legacy format); returns the text offset after them."""
    tokens, text_offset, token_logprobs, top_logprobs = (lp["tokens"], lp["text_offset"], lp["token_logprobs"],
                                                         lp["top_logprobs"])
    for i, tid in enumerate(token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        s = ctx.token_str(tid)
        tokens.append(s)
        text_offset.append(offset)
        offset += len(s)
        if not entry:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp_logprob(entry[0][1]))
        top = {ctx.token_str(alt): clamp_logprob(alt_lp) for alt, alt_lp, _rank in entry[1:1 + k]}
        top.setdefault(s, clamp_logprob(entry[0][1]))  # the chosen token is always listed (as vLLM does)
        top_logprobs.append(top)
    return offset


class CompletionHandler:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    def _build_runs(self, req: CompletionRequest) -> tuple[list[PromptRun], bool]:
        """Validate, tokenize and make the SamplingParams (runs on the preparation pool, off the event loop)."""
        ctx = self.ctx
        check_sampling_fields(req, ctx.limits, ctx.vocab_size)
        ctx.check_model(req.model)
        check_logprobs_count(req.logprobs, ctx.limits, ctx.vocab_size, "logprobs")
        zero = req.max_tokens == 0
        runs = []
        for i, (ids, text) in enumerate(_prompts(ctx, req.prompt, need_text=bool(req.echo))):
            max_tokens = resolve_max_tokens(req.max_tokens, len(ids), ctx.max_model_len, DEFAULT_MAX_TOKENS)
            prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
            params = make_sampling_params(req, max(max_tokens, 1) if zero else max_tokens, req.logprobs, prompt_lp,
                                          scoring_only=zero)
            runs.append(PromptRun(index=i, prompt_ids=ids, prompt_text=text, params=params,
                                  timer=RequestTimer(ctx.metrics)))
        return runs, zero

    async def handle(self, req: CompletionRequest, raw: Request) -> Response:
        runs, zero = await prepare(self.ctx, self._build_runs, req)
        needs_engine = not zero or (req.echo and req.logprobs is not None)
        if req.stream and not zero:
            return await stream_runs(self.ctx, raw, runs, lambda: self._stream(req, runs))
        try:
            if needs_engine:
                await collect_runs(self.ctx, raw, runs)
        except ClientDisconnected:
            return Response(status_code=499)
        response = self._response(req, runs, zero)
        if req.stream:  # max_tokens 0: the whole answer in one chunk per choice
            return StreamingResponse(self._replay(req, response), media_type="text/event-stream")
        return JSONResponse(response.model_dump())

    # ------------------------------------------------------------------------------------ non-streaming
    def _choice(self, req: CompletionRequest, run: PromptRun, index: int, zero: bool) -> CompletionResponseChoice:
        c = run.choices.get(index)
        text = run.prompt_text if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            lp = _new_logprobs()
            offset = 0
            if req.echo:
                offset = _append_logprobs(self.ctx, lp, run.prompt_ids, run.prompt_logprobs, req.logprobs, 0)
            if c is not None and not zero:
                _append_logprobs(self.ctx, lp, c.token_ids, c.logprobs, req.logprobs, offset)
            logprobs = CompletionLogprobs(**lp)
        if zero or c is None:
            return CompletionResponseChoice(index=run.index * req.n + index, text=text, logprobs=logprobs,
                                            finish_reason="length")
        return CompletionResponseChoice(index=run.index * req.n + index, text=text + c.text, logprobs=logprobs,
                                        finish_reason=c.finish_reason, stop_reason=stop_reason_or_none(c.stop_reason))

    def _response(self, req: CompletionRequest, runs: list[PromptRun], zero: bool) -> CompletionResponse:
        choices = [self._choice(req, run, i, zero) for run in runs for i in range(req.n)]
        usage = make_usage(runs)
        if zero:
            usage.total_tokens -= usage.completion_tokens
            usage.completion_tokens = 0
        return CompletionResponse(id=random_id("cmpl"), model=self.ctx.model_name, choices=choices, usage=usage)

    async def _replay(self, req: CompletionRequest, response: CompletionResponse) -> AsyncIterator[bytes]:
        frame = SSEFrame(response.id, "text_completion", response.model, response.created)
        for ch in response.choices:
            yield frame.choice(ch.model_dump(exclude={"prompt_logprobs"}))
        if include_usage(req):
            yield frame.usage(response.usage)
        yield SSE_DONE

    # ------------------------------------------------------------------------------------ streaming
    def _stream(self, req: CompletionRequest, runs: list[PromptRun]) -> AsyncIterator[bytes]:
        """One chunk per choice output (the engine client paces outputs by --stream-interval): a plain dict, encoded
        once."""
        ctx = self.ctx
        frame = SSEFrame(random_id("cmpl"), "text_completion", ctx.model_name)
        offsets: dict[int, int] = {}  # choice index -> text offset (logprobs)
        n, k, echo = req.n, req.logprobs, req.echo

        def usage_chunk() -> Optional[bytes]:
            return frame.usage(make_usage(runs)) if include_usage(req) else None

        async def chunks() -> AsyncIterator[bytes]:
            async for run, out in merge_runs(runs):
                for c in out.outputs:
                    index = run.index * n + c.index
                    text, logprobs = c.text_delta, None
                    first = index not in offsets
                    if k is not None:
                        logprobs = _new_logprobs()
                        offset = offsets.get(index, 0)
                        if first and echo:
                            offset = _append_logprobs(ctx, logprobs, run.prompt_ids, run.prompt_logprobs, k, offset)
                        offsets[index] = _append_logprobs(ctx, logprobs, c.token_ids_delta, c.logprobs_delta, k,
                                                          offset)
                    else:
                        offsets[index] = 0
                    if first and echo:
                        text = run.prompt_text + text
                    if not text and not c.finish_reason and not (logprobs and logprobs["tokens"]):
                        continue
                    yield frame.choice({"index": index, "text": text, "logprobs": logprobs,
                                        "finish_reason": c.finish_reason,
                                        "stop_reason": stop_reason_or_none(c.stop_reason)})

        return sse_body(ctx, runs, chunks(), usage_chunk)  # no pass-through generator: one frame less per chunk
