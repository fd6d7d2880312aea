"""The periodic stats line of `ladle serve` (off with `--disable-log-stats`, vLLM's flag).

Every `interval` seconds (vLLM's default 10 s) one line with what vLLM's logging stat logger reports: average prompt
and generation throughput over the interval (tokens/s), running and waiting requests, KV-cache usage, and the
prefix-cache hit rate (cached prompt tokens / prompt tokens looked up, over the interval). The line is logged at
INFO while anything happens (tokens processed, requests running or waiting) and at DEBUG when the server is idle, so
an idle server does not fill its log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from ladle.engine.client import EngineStats

logger = logging.getLogger("ladle.server.stats")


class StatsLogger:
    """Turns successive EngineStats snapshots into stats lines. `get_stats` is EngineClient.get_stats."""

    def __init__(self, get_stats: Callable[[], EngineStats], interval: float = 10.0):
        self.get_stats = get_stats
        self.interval = interval
        self._last = self._snapshot()
        self._last_time = time.monotonic()

    def _snapshot(self) -> tuple[int, int, int, int]:
        s = self.get_stats()
        return (s.prompt_tokens_total, s.generation_tokens_total, s.prefix_cache_queries_total,
                s.prefix_cache_hits_total)

    def line(self, now: Optional[float] = None) -> tuple[str, bool]:
        """(the stats line since the previous call, whether anything happened in that time)."""
        now = time.monotonic() if now is None else now
        s = self.get_stats()
        current = (s.prompt_tokens_total, s.generation_tokens_total, s.prefix_cache_queries_total,
                   s.prefix_cache_hits_total)
        prompt, generation, queries, hits = (c - p for c, p in zip(current, self._last))
        elapsed = max(now - self._last_time, 1e-9)
        self._last, self._last_time = current, now
        hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
        text = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{generation / elapsed:.1f} tokens/s, Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                f"KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")
        busy = bool(prompt or generation or s.num_running or s.num_waiting)
        return text, busy

    async def run(self) -> None:
        """Log a line every `interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                text, busy = self.line()
            except Exception as e:  # noqa: BLE001 — a stats failure must not end the server
                logger.warning("stats line failed: %s: %s", type(e).__name__, e)
                continue
            logger.log(logging.INFO if busy else logging.DEBUG, "%s", text)
