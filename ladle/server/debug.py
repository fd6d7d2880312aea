"""GET /debug/shapes and /debug/steps: the bottleneck record of ladle/observe/ as JSON (issue 15).

/debug/steps?last=N  ladle.observe.steps.OBSERVER.snapshot(last): totals (steps, tokens, host_s, gpu_s, bytes per
                     plane item, roofline_s, preemptions, admission delay), per batch-size bucket, the last N step
                     records (default 256; each with host_ms, gpu_ms, tokens, context tokens, byte planes,
                     roofline_ms, waiting, running, kv_usage, preempted, admission_delay_ms), device rates, the
                     model's plan and the open-files limit.
/debug/shapes        {"gemm": local GEMM shapes per op and M bucket (ladle.observe.shapes), "kernels": the
                     dispatch call counts per op and token bucket (one per launch), "tokens_scheduled": the
                     tokens the recorded steps fed, "measured": with --observe-timing, total ms, samples and mean
                     us per launch per (op, bucket) over the sampled steps, their source ("cuda_events" or
                     "host_clock") and the sampled steps counted eager / CUDA graph (ladle.observe.op_timing;
                     per-op rows come from eager steps only, a graph replay is one "cuda_graph_replay" row)}.
The records live where the engine core runs: an app whose engine has `observe_snapshot` (the engine-core process
client, ladle/engine/core_client.py) asks it; otherwise they are read in this process.
/debug/dispatch stays in api.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ladle.engine.observe_snapshots import observe_snapshot

router = APIRouter()


async def engine_snapshot(request: Request, name: str, **kwargs: Any) -> dict:
    """The record `name` from the app's engine (its process), or from this process."""
    engine = getattr(getattr(request.app.state, "ctx", None), "engine", None)
    fetch = getattr(engine, "observe_snapshot", None)
    if fetch is None:
        return observe_snapshot(name, **kwargs)
    return await fetch(name, **kwargs)


@router.get("/debug/shapes")
async def debug_shapes(request: Request) -> JSONResponse:
    return JSONResponse(await engine_snapshot(request, "shapes"))


@router.get("/debug/steps")
async def debug_steps(request: Request, last: int = 256) -> JSONResponse:
    return JSONResponse(await engine_snapshot(request, "steps", last=max(0, last)))
