"""GET /debug/shapes and /debug/steps: the bottleneck record of ladle/observe/ as JSON (issue 15).

/debug/steps?last=N  ladle.observe.steps.OBSERVER.snapshot(last): totals (steps, tokens, host_s, gpu_s, bytes per
                     plane item, roofline_s, preemptions, admission delay), per batch-size bucket, the last N step
                     records (default 256; each with host_ms, gpu_ms, tokens, context tokens, byte planes,
                     roofline_ms, waiting, running, kv_usage, preempted, admission_delay_ms), device rates, the
                     model's plan and the open-files limit.
/debug/shapes        {"gemm": local GEMM shapes per op and M bucket (ladle.observe.shapes), "kernels": the
                     dispatch call counts per op and token bucket (one per launch), "tokens_scheduled": the
                     tokens the recorded steps fed}.
/debug/dispatch stays in api.py.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ladle.observe import dispatch, shapes, steps

router = APIRouter()


def shapes_snapshot() -> dict:
    """The /debug/shapes body."""
    kernels = {op: {b: c["calls"] for b, c in entry["buckets"].items()}
               for op, entry in dispatch.snapshot()["ops"].items() if entry["buckets"]}
    out = shapes.snapshot()
    out["kernels"] = kernels
    out["tokens_scheduled"] = int(steps.OBSERVER.snapshot(last=0)["totals"].get("tokens", 0))
    return out


@router.get("/debug/shapes")
async def debug_shapes() -> JSONResponse:
    return JSONResponse(shapes_snapshot())


@router.get("/debug/steps")
async def debug_steps(last: int = 256) -> JSONResponse:
    return JSONResponse(steps.OBSERVER.snapshot(last=max(0, last)))
