"""Fast-path dispatch record: configured / eligible / executed counts per op and per shape bucket.

Stdlib only (a leaf any package may import). Every fast path (a Triton kernel, a CUDA graph, ...) registers
once with a one-line statement of its eligibility rule; the rule itself is code next to the fast path, and each
call site reports its outcome through `decide()`:

    reason = my_rule(x, w)                      # None when eligible, else a short reason string
    if dispatch.decide("rmsnorm", dispatch.tokens_bucket(T), configured=True, ineligible_reason=reason):
        run_fast_path()
    else:
        run_reference()                         # the fallback is visible in the record, never silent

Counts (ARCHITECTURE.md, "Fast paths and how we keep them honest"):
  configured — the flag / backend asked for the fast path;
  eligible   — its rule passed (evaluated whether or not it was configured);
  executed   — configured and eligible, i.e. the fast path ran.
Fallback reasons are counted per op as well. Inside a CUDA graph replay no Python runs, so ops captured in a
graph are counted only at capture time (warm-up runs included); the graph itself records one `executed` per
replay (op "cuda_graph_decode").

`snapshot()` is served as JSON at GET /debug/dispatch; `format_table()` is printed at shutdown with
`--dispatch-report`. Thread-safe (one lock); counting costs a dict update per call.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

_LOCK = threading.Lock()
_PATHS: dict[str, dict] = {}  # op -> {"path": name, "rule": text}
_COUNTS: dict[tuple[str, str], list[int]] = {}  # (op, bucket) -> [configured, eligible, executed, calls]
_REASONS: dict[tuple[str, str], int] = {}  # (op, reason) -> count
_listener: Optional[Callable[[str, str], None]] = None  # told (op, bucket) of every decision (set_listener)


def register(op: str, path: str, rule: str) -> None:
    """Declare the fast path `path` for `op` and its eligibility rule in words (the rule's code lives next to it).
    Re-registering the same op replaces the description (module reloads are harmless)."""
    with _LOCK:
        _PATHS[op] = {"path": path, "rule": rule}


def set_listener(fn: Optional[Callable[[str, str], None]]) -> None:
    """Have `fn(op, bucket)` called on every recorded decision (None: nobody). ladle.observe.op_timing sets it
    during a sampled step to label the launch it is timing with the op's own decision."""
    global _listener
    _listener = fn


def decide(op: str, bucket: str, *, configured: bool, ineligible_reason: Optional[str]) -> bool:
    """Record one dispatch decision and return whether the fast path runs (configured and eligible).

    `ineligible_reason` is None when the eligibility rule passed, else why it failed (counted per reason).
    """
    eligible = ineligible_reason is None
    executed = configured and eligible
    fallback = str(ineligible_reason) if configured and not eligible else None
    _count(op, bucket, configured, eligible, executed, fallback)
    return executed


def record(op: str, bucket: str, *, configured: bool, eligible: bool, executed: bool,
           reason: Optional[str] = None) -> None:
    """Record an outcome decided elsewhere (e.g. a layer that picked its backend itself)."""
    fallback = None
    if configured and not executed:
        fallback = reason or ("not eligible" if not eligible else "not executed")
    _count(op, bucket, configured, eligible, executed, fallback)


def _count(op: str, bucket: str, configured: bool, eligible: bool, executed: bool,
           fallback_reason: Optional[str]) -> None:
    """Add one call to the (op, bucket) row, and one to (op, fallback_reason) unless that is None."""
    if _listener is not None:
        _listener(op, bucket)
    with _LOCK:
        row = _COUNTS.setdefault((op, bucket), [0, 0, 0, 0])
        row[0] += int(configured)
        row[1] += int(eligible)
        row[2] += int(executed)
        row[3] += 1
        if fallback_reason is not None:
            key = (op, fallback_reason)
            _REASONS[key] = _REASONS.get(key, 0) + 1


def tokens_bucket(num_tokens: int) -> str:
    """Shape bucket for a token (or batch) count: the next power of two, e.g. 'T<=64'."""
    n = max(int(num_tokens), 1)
    return f"T<={1 << (n - 1).bit_length()}"


def snapshot() -> dict:
    """JSON-able view: {"ops": {op: {"path", "rule", "buckets": {bucket: {configured, eligible, executed,
    calls}}, "fallback_reasons": {reason: n}}}}. Ops that registered but never ran appear with empty buckets."""
    with _LOCK:
        ops: dict[str, dict] = {}
        for op, meta in _PATHS.items():
            ops[op] = {"path": meta["path"], "rule": meta["rule"], "buckets": {}, "fallback_reasons": {}}
        for (op, bucket), (c, e, x, n) in sorted(_COUNTS.items(), key=lambda kv: (kv[0][0], _bucket_key(kv[0][1]))):
            entry = ops.setdefault(op, {"path": "?", "rule": "?", "buckets": {}, "fallback_reasons": {}})
            entry["buckets"][bucket] = {"configured": c, "eligible": e, "executed": x, "calls": n}
        for (op, reason), n in sorted(_REASONS.items()):
            ops[op]["fallback_reasons"][reason] = n
    return {"ops": ops}


def format_table() -> str:
    """Fixed-width text table of the snapshot, one line per (op, bucket), fallback reasons below."""
    snap = snapshot()["ops"]
    lines = [f"{'op':<22} {'path':<12} {'bucket':<10} {'configured':>10} {'eligible':>9} {'executed':>9}"]
    reasons = []
    for op in sorted(snap):
        entry = snap[op]
        if not entry["buckets"]:
            lines.append(f"{op:<22} {entry['path']:<12} {'-':<10} {0:>10} {0:>9} {0:>9}")
        for bucket, cnt in entry["buckets"].items():
            lines.append(
                f"{op:<22} {entry['path']:<12} {bucket:<10} {cnt['configured']:>10} {cnt['eligible']:>9} {cnt['executed']:>9}"
            )
        reasons += [f"  {op}: {r} (x{n})" for r, n in entry["fallback_reasons"].items()]
    if reasons:
        lines.append("fallbacks (configured but not eligible):")
        lines += reasons
    return "\n".join(lines)


def reset() -> None:
    """Clear all counts (registrations stay). For tests and per-benchmark records."""
    with _LOCK:
        _COUNTS.clear()
        _REASONS.clear()


def _bucket_key(bucket: str) -> tuple:
    digits = "".join(ch for ch in bucket if ch.isdigit())
    return (len(digits), digits, bucket)
