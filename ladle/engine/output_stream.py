"""One request's outputs on the API server's event loop, and the merge of consecutive outputs.

The engine client puts each step's RequestOutput of a request into its `RequestOutputStream` (one `put` per request
per step, no task switch per token); the request's `generate` iterator takes what is there. A consumer that fell
behind (a slow client, a busy loop) finds everything since its last read merged into one RequestOutput, so its next
SSE chunk carries all of it instead of one chunk per step queued up behind it. vLLM's AsyncLLM does the same
(`RequestOutputCollector` in vllm/v1/engine/output_processor.py: a put while an output is waiting aggregates the two).
`--stream-interval N` is applied here too (the stream's `stream_interval`): the consumer is woken once per N tokens
of a choice, not once per step, and what it reads is one SSE chunk per choice.

The merge keeps the meaning of every field: deltas concatenated in order (text, token ids, logprobs: one entry per
token), finish / stop reason and the cumulative fields from the later output (they are set on the finishing one),
the request's first prompt logprobs and queue time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Optional, Union

from ladle.engine.client import CompletionOutput, RequestOutput


def merge_many_request_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """`outs` (in order) as one output, in one pass (each choice's deltas concatenated once, not once per output:
    a pairwise fold over a backlog of k outputs cost O(k^2) list and string copies). Choices in order of first
    appearance; a choice that appears once keeps its object; request_id, prompt_token_ids, finished and
    num_cached_tokens from the last output, prompt_logprobs and queue_time the first that are set. None of `outs` is
    modified."""
    if len(outs) == 1:
        return outs[0]
    groups: dict[int, list[CompletionOutput]] = {}  # choice index -> its outputs in order (first appearance order)
    for out in outs:
        for c in out.outputs:
            group = groups.get(c.index)
            if group is None:
                groups[c.index] = [c]
            else:
                group.append(c)
    prompt_logprobs = queue_time = None
    for out in outs:
        if prompt_logprobs is None:
            prompt_logprobs = out.prompt_logprobs
        if queue_time is None:
            queue_time = out.queue_time
    last = outs[-1]
    return RequestOutput(request_id=last.request_id, prompt_token_ids=last.prompt_token_ids,
                         outputs=[g[0] if len(g) == 1 else _merge_choice_group(g) for g in groups.values()],
                         finished=last.finished, num_cached_tokens=last.num_cached_tokens,
                         prompt_logprobs=prompt_logprobs, queue_time=queue_time)


def _merge_choice_group(group: list[CompletionOutput]) -> CompletionOutput:
    """Outputs of one choice, in order, as one: text / token ids / logprobs deltas concatenated (logprobs None unless
    some output had them), the cumulative fields, finish / stop reason and error from the last."""
    token_ids_delta: list[int] = []
    logprobs_delta = None  # None unless some output had logprobs; then all of theirs, in order
    for c in group:
        token_ids_delta += c.token_ids_delta
        if c.logprobs_delta is not None:
            if logprobs_delta is None:
                logprobs_delta = []
            logprobs_delta += c.logprobs_delta
    first, last = group[0], group[-1]
    return CompletionOutput(index=first.index, text=last.text, token_ids=last.token_ids,
                            text_delta="".join(c.text_delta for c in group), token_ids_delta=token_ids_delta,
                            logprobs=last.logprobs, logprobs_delta=logprobs_delta, finish_reason=last.finish_reason,
                            stop_reason=last.stop_reason, error=last.error)


class RequestOutputStream:
    """Single consumer, loop-thread only. `put` never blocks and never switches tasks; `get` returns what was put
    since the last `get` as one RequestOutput (merged once, when read: `merge_many_request_outputs`), then the
    exception put after it (if any), as asyncio.Queue's items were: returned, not raised, so the caller tells it from
    its own cancellation.

    `stream_interval` N (`--stream-interval`, tokens per streamed chunk) paces the consumer, vLLM's rule
    (RequestState.make_request_output in vllm/v1/engine/output_processor.py): a choice is due when nothing of it was
    returned yet (its first token goes at once: TTFT is unchanged), when it finished, or when N of its tokens
    (`token_ids_delta`) wait. The consumer is woken only when a choice is due (or the request finished, or an error
    came); `get` returns the due choices and keeps the others for a later `get`. With one token per step and T
    tokens a choice comes out at most 1 + ceil((T - 1) / N) times (exactly, for a consumer that keeps up; a lagging
    one reads fewer, merged outputs). N = 1: every put wakes.
    """

    __slots__ = ("_interval", "_pending", "_error", "_waiter", "_finished", "_waiting", "_returned", "_due")

    def __init__(self, stream_interval: int = 1) -> None:
        assert stream_interval >= 1, stream_interval  # the server refuses others (stream_interval_refusals)
        self._interval = stream_interval
        self._pending: list[RequestOutput] = []
        self._error: Optional[BaseException] = None
        self._waiter: Optional[asyncio.Future] = None
        self._finished = False  # the request's finishing output was put (N > 1: everything is due)
        self._waiting: dict[int, int] = {}  # choice index -> its tokens put since it was last returned (N > 1)
        self._returned: set[int] = set()  # choices returned at least once (N > 1)
        self._due: set[int] = set()  # choices the next `get` returns (N > 1)

    def put(self, item: Union[RequestOutput, BaseException]) -> None:
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        else:
            self._pending.append(item)
            if self._interval > 1:
                self._note(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self.ready():
            waiter.set_result(None)

    def _note(self, item: RequestOutput) -> None:
        """Count `item`'s tokens per choice and mark the choices it makes due."""
        self._finished = self._finished or item.finished
        for c in item.outputs:
            waiting = self._waiting.get(c.index, 0) + len(c.token_ids_delta)
            self._waiting[c.index] = waiting
            if c.finish_reason is not None or waiting >= self._interval or c.index not in self._returned:
                self._due.add(c.index)

    def ready(self) -> bool:
        """Whether `get` would return at once: something is due (N = 1: anything was put) or an error came."""
        if self._error is not None:
            return True
        return bool(self._pending) and (self._interval == 1 or self._finished or bool(self._due))

    async def get(self) -> Union[RequestOutput, BaseException]:
        while not self.ready():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._pending:
            pending, self._pending = self._pending, []
            merged = merge_many_request_outputs(pending)
            if self._interval == 1 or self._error is not None or self._finished:
                self._due = set()
                return merged  # everything goes (N > 1: the stream ends after it)
            return self._take_due(merged)
        return self._error  # type: ignore[return-value]

    def _take_due(self, merged: RequestOutput) -> RequestOutput:
        """`merged` with its due choices only; the others stay pending (their request-level fields went out)."""
        due, self._due = self._due, set()
        self._returned |= due
        for index in due:
            self._waiting[index] = 0
        held = [c for c in merged.outputs if c.index not in due]
        if not held:
            return merged
        self._pending = [RequestOutput(request_id=merged.request_id, prompt_token_ids=merged.prompt_token_ids,
                                       outputs=held, num_cached_tokens=merged.num_cached_tokens)]
        return dataclasses.replace(merged, outputs=[c for c in merged.outputs if c.index in due])
