"""Cost of the per-step bottleneck record (ladle/observe/steps.py): `begin()` + `end()` per engine step, on CPU.

Prints microseconds per recorded step for decode batches of 1..256 requests, with the plan of the tiny random
Llama of tests/engine/helpers.py (the cost does not depend on the model size: one dict update per GEMM kind).
No GPU needed; GPU time sampling (--observe-timing) adds two CUDA events every Nth step.

Per-op timing (ladle/observe/op_timing.py, --observe-timing): the cost of the hook on every op call while no step
is sampled (one attribute read in the decorator, against the bare call), and the cost of one timed launch on a
sampled step (two CUDA events on CUDA, two host-clock reads on the CPU; the clock that runs here is printed).

    python benchmarks/observe_cost.py [--steps 2000] [--calls 200000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests", "engine"))

from ladle.core.outputs import ScheduledChunk, SchedulerOutput  # noqa: E402
from ladle.core.scheduler import SchedulerStats  # noqa: E402
from ladle.observe import op_timing, steps  # noqa: E402


def fake_core(model, num_reqs: int):
    runner = SimpleNamespace(model=model, kv_cache_specs=model.kv_cache_specs(), dtype=None, runner_config=None,
                             device="cpu")
    stats = SchedulerStats(num_running=num_reqs)
    return SimpleNamespace(runner=runner, scheduler=SimpleNamespace(get_stats=lambda: stats, requests={}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--calls", type=int, default=200000)
    args = p.parse_args()
    from helpers import tiny_model

    model = tiny_model()
    print(f"{'batch':>6} {'us/step':>9}")
    for batch in (1, 8, 64, 256):
        obs = steps.StepObserver()
        core = fake_core(model, batch)
        out = SchedulerOutput(chunks=[ScheduledChunk(f"r{i}", [1], 500 + i, [1], True) for i in range(batch)])
        obs.end(core, out, obs.begin())
        t0 = time.perf_counter()
        for _ in range(args.steps):
            obs.end(core, out, obs.begin())
        print(f"{batch:>6} {(time.perf_counter() - t0) / args.steps * 1e6:>9.1f}")
    op_timing_cost(args.calls)


def _per_call_ns(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(1)
    return (time.perf_counter() - t0) / calls * 1e9


def op_timing_cost(calls: int) -> None:
    """ns per op call of the @timed_op hook when the step is not sampled, and us per timed launch when it is."""
    import torch

    def bare(x):
        return x

    hooked = op_timing.timed_op(bare)
    timer = op_timing.TIMER
    cuda = torch.cuda.is_available()
    base = min(_per_call_ns(bare, calls) for _ in range(3))
    off = min(_per_call_ns(hooked, calls) for _ in range(3))
    print(f"@timed_op on an unsampled step: {off - base:.0f} ns per op call (bare call {base:.0f} ns)")
    launches = min(calls, 20000)
    timer.start_step(cuda)
    t0 = time.perf_counter()
    for _ in range(launches):
        hooked(1)
    on = (time.perf_counter() - t0) / launches * 1e6
    timer.finish_step(None)
    t0 = time.perf_counter()
    snap = timer.snapshot()  # reads the events (CUDA) or sums the host-clock rows
    read = (time.perf_counter() - t0) / launches * 1e6
    timer.reset()
    print(f"timed launch on a sampled step ({snap['source']}): {on:.2f} us to record + {read:.3f} us to read, "
          f"per launch")


if __name__ == "__main__":
    main()
