"""One request's outputs on the API server's event loop, and the merge of consecutive outputs.

The engine client puts each step's RequestOutput of a request into its `RequestOutputStream` (one `put` per request
per step, no task switch per token); the request's `generate` iterator takes what is there. A consumer that fell
behind (a slow client, a busy loop) finds everything since its last read merged into one RequestOutput, so its next
SSE chunk carries all of it instead of one chunk per step queued up behind it. vLLM's AsyncLLM does the same
(`RequestOutputCollector` in vllm/v1/engine/output_processor.py: a put while an output is waiting aggregates the two).

The merge keeps the meaning of every field: deltas concatenated in order (text, token ids, logprobs: one entry per
token), finish / stop reason and the cumulative fields from the later output (they are set on the finishing one),
the request's first prompt logprobs and queue time.
"""

from __future__ import annotations

import asyncio
from typing import Optional, Union

from ladle.engine.client import CompletionOutput, RequestOutput


def merge_choice_outputs(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    """Choice output `a` followed by `b` (same index) as one output; neither is modified."""
    logprobs_delta = a.logprobs_delta
    if b.logprobs_delta is not None:
        logprobs_delta = (a.logprobs_delta or []) + b.logprobs_delta
    return CompletionOutput(index=a.index, text=b.text, token_ids=b.token_ids, text_delta=a.text_delta + b.text_delta,
                            token_ids_delta=a.token_ids_delta + b.token_ids_delta, logprobs=b.logprobs,
                            logprobs_delta=logprobs_delta, finish_reason=b.finish_reason, stop_reason=b.stop_reason,
                            error=b.error)


def merge_request_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Request output `a` followed by `b` as one output (choices in order of first appearance); neither is
    modified."""
    outputs = list(a.outputs)
    where = {c.index: i for i, c in enumerate(outputs)}
    for c in b.outputs:
        i = where.get(c.index)
        if i is None:
            where[c.index] = len(outputs)
            outputs.append(c)
        else:
            outputs[i] = merge_choice_outputs(outputs[i], c)
    return RequestOutput(request_id=b.request_id, prompt_token_ids=b.prompt_token_ids, outputs=outputs,
                         finished=b.finished, num_cached_tokens=b.num_cached_tokens,
                         prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
                         queue_time=a.queue_time if a.queue_time is not None else b.queue_time)


class RequestOutputStream:
    """Single consumer, loop-thread only. `put` never blocks and never switches tasks; `get` returns everything put
    since the last `get` as one RequestOutput, then the exception put after it (if any), as asyncio.Queue's items
    were: returned, not raised, so the caller tells it from its own cancellation."""

    __slots__ = ("_pending", "_error", "_waiter")

    def __init__(self) -> None:
        self._pending: Optional[RequestOutput] = None
        self._error: Optional[BaseException] = None
        self._waiter: Optional[asyncio.Future] = None

    def put(self, item: Union[RequestOutput, BaseException]) -> None:
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        elif self._pending is None:
            self._pending = item
        else:
            self._pending = merge_request_outputs(self._pending, item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return self._pending is None and self._error is None

    async def get(self) -> Union[RequestOutput, BaseException]:
        while self._pending is None and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        return self._error  # type: ignore[return-value]
