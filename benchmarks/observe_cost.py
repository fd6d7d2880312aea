"""Cost of the per-step bottleneck record (ladle/observe/steps.py): `begin()` + `end()` per engine step, on CPU.

Prints microseconds per recorded step for decode batches of 1..256 requests, with the plan of the tiny random
Llama of tests/engine/helpers.py (the cost does not depend on the model size: one dict update per GEMM kind).
No GPU needed; GPU time sampling (--observe-timing) adds two CUDA events every Nth step.

    python benchmarks/observe_cost.py [--steps 2000]
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
from ladle.observe import steps  # noqa: E402


def fake_core(model, num_reqs: int):
    runner = SimpleNamespace(model=model, kv_cache_specs=model.kv_cache_specs(), dtype=None, runner_config=None,
                             device="cpu")
    stats = SchedulerStats(num_running=num_reqs)
    return SimpleNamespace(runner=runner, scheduler=SimpleNamespace(get_stats=lambda: stats, requests={}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
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


if __name__ == "__main__":
    main()
