"""Local-shape histogram: per op and per (M bucket, N, K) the launch count, the tokens (sum of M), FLOPs and the modeled
time (roofline seconds of those launches, when the device rates are known).

Stdlib only. M is bucketed to the next power of two ("M<=32"); N and K are exact (a layer's local weight shape
after tensor parallelism). Recorded by `ladle.observe.steps` from the model's plan once per step (one dict update
per GEMM kind, not per launch); kernel ops that record dispatch decisions appear beside them with their dispatch
call counts per token bucket (`ladle.observe.dispatch`), which count one per launch. Measured time per op and
bucket (--observe-timing, sampled steps) is ladle.observe.op_timing's; its GEMM rows use these keys.
"""

from __future__ import annotations

import threading
from typing import Optional

_LOCK = threading.Lock()
_ROWS: dict[tuple[str, int, int, int], list[float]] = {}  # (op, m_bucket, n, k) -> [launches, tokens, modeled_s, flops]


def m_bucket(m: int) -> int:
    """Next power of two >= m (1 for m <= 1)."""
    return 1 << (max(int(m), 1) - 1).bit_length()


def record(op: str, m: int, n: int, k: int, launches: int, modeled_s: Optional[float] = None) -> None:
    """Count `launches` launches of `op` at local shape (m, n, k); `modeled_s` their roofline seconds if known."""
    key = (op, m_bucket(m), n, k)
    with _LOCK:
        row = _ROWS.get(key)
        if row is None:
            row = _ROWS[key] = [0, 0, 0.0, 0.0]
        row[0] += launches
        row[1] += m
        row[2] += modeled_s or 0.0
        row[3] += 2.0 * m * n * k * launches


def snapshot() -> dict:
    """{"gemm": {op: [{"m_bucket", "n", "k", "launches", "tokens", "flops", "modeled_ms"}, ...]}} sorted by M;
    tokens = the sum of M over the steps recorded (not times launches); modeled_ms None without device rates."""
    with _LOCK:
        rows = sorted(_ROWS.items())
    out: dict[str, list[dict]] = {}
    for (op, mb, n, k), (launches, tokens, secs, flops) in rows:
        out.setdefault(op, []).append({"m_bucket": mb, "n": n, "k": k, "launches": int(launches),
                                       "tokens": int(tokens), "flops": flops,
                                       "modeled_ms": secs * 1e3 if secs else None})
    return {"gemm": out}


def reset() -> None:
    with _LOCK:
        _ROWS.clear()
