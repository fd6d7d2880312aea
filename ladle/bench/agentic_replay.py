"""Replaying agentic sessions against a server: timing, concurrency, prefix-cache accounting.

Timing (after AIPerf's / AgentX's replay, bench_methodology.md §2.5): within a session the next ordinary request is
sent `think_time * think_time_scale` seconds after the previous ordinary request finished (the anchor); a subagent
starts `(t_subagent - t_anchor) * scale` after the anchor and then runs concurrently with its parent, which does not
wait for it (the traces show the parent continuing while its subagents run). A session ends when its own requests
and all its subagents are done. `max_concurrency` bounds live top-level sessions ("lanes"); subagents run inside
their parent's lane. Dropped requests (too long for the server) are skipped and move the anchor to "now".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from ladle.bench.agentic import AgenticRequest, AgenticSession
from ladle.bench.request import RequestOutput

SendFn = Callable[[AgenticRequest], Awaitable[RequestOutput]]


async def _run_session(
    sess: AgenticSession, send: SendFn, scale: float, results: list[tuple[AgenticRequest, RequestOutput]]
) -> None:
    anchor = time.perf_counter()
    subtasks: list[asyncio.Task] = []
    for item in sess.items:
        wait = anchor + item.delay_s * scale - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if isinstance(item, AgenticSession):
            subtasks.append(asyncio.create_task(_run_session(item, send, scale, results)))
            continue
        if not item.dropped:
            results.append((item, await send(item)))
        anchor = time.perf_counter()
    if subtasks:
        await asyncio.gather(*subtasks)


async def replay(
    sessions: list[AgenticSession],
    send: SendFn,
    max_concurrency: int | None,
    think_time_scale: float,
) -> list[tuple[AgenticRequest, RequestOutput]]:
    """Runs every session; returns (request, output) pairs in completion order. `send` must not raise."""
    results: list[tuple[AgenticRequest, RequestOutput]] = []
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def lane(sess: AgenticSession) -> None:
        if sem is None:
            await _run_session(sess, send, think_time_scale, results)
            return
        async with sem:
            await _run_session(sess, send, think_time_scale, results)

    await asyncio.gather(*(lane(s) for s in sessions))
    return results

