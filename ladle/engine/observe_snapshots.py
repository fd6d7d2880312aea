"""The observe records the debug endpoints serve, computed where the engine core runs (its own process or this one).

`observe_snapshot("dispatch")`: ladle.observe.dispatch's counters; `("steps", last=N)`: the step record
(ladle.observe.steps.OBSERVER.snapshot(last)); `("shapes")`: GEMM shapes per op and M bucket, kernel launches per op
and token bucket, the tokens the recorded steps fed, and the measured time per op and bucket (ladle.observe.op_timing;
empty without --observe-timing). All plain JSON-able dicts (they cross a process boundary).
"""

from __future__ import annotations

from typing import Any

from ladle.observe import dispatch, op_timing, shapes, steps


def shapes_snapshot() -> dict:
    """The /debug/shapes body."""
    kernels = {op: {b: c["calls"] for b, c in entry["buckets"].items()}
               for op, entry in dispatch.snapshot()["ops"].items() if entry["buckets"]}
    out = shapes.snapshot()
    out["kernels"] = kernels
    out["tokens_scheduled"] = int(steps.OBSERVER.snapshot(last=0)["totals"].get("tokens", 0))
    out["measured"] = op_timing.TIMER.snapshot()
    return out


def observe_snapshot(name: str, **kwargs: Any) -> dict:
    """One record by name ("dispatch", "steps" with `last`, "shapes"). Raises ValueError for another name."""
    if name == "dispatch":
        return dispatch.snapshot()
    if name == "steps":
        return steps.OBSERVER.snapshot(last=max(0, int(kwargs.get("last", 256))))
    if name == "shapes":
        return shapes_snapshot()
    raise ValueError(f"unknown observe record {name!r}")
