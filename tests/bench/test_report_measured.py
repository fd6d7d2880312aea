"""Section 1 of the --report ranks by measured time per op and bucket when the server measured it (the run's share:
after - before of /debug/shapes "measured"), says on how many sampled steps (eager / CUDA graph) and from which
clock, and falls back to the modeled ranking, saying so, when nothing was measured."""

from __future__ import annotations

import json
import random

from ladle.bench.bottleneck import diff
from ladle.bench.bottleneck_report import local_shapes, write_report


def _row(op, bucket, total_ms, samples, mb=None, n=None, k=None):
    return {"op": op, "bucket": bucket, "m_bucket": mb, "n": n, "k": k, "total_ms": total_ms, "samples": samples,
            "mean_us": 1e3 * total_ms / samples}


def _snapshots(rng: random.Random, source: str) -> tuple[dict, dict, dict]:
    """(before, after, what the run added) with random times; qkv_proj's row grows most."""
    add = {"qkv_proj": rng.uniform(50, 60), "rmsnorm": rng.uniform(5, 10), "cuda_graph_replay": rng.uniform(1, 4)}
    old = {"qkv_proj": rng.uniform(1, 100), "rmsnorm": rng.uniform(1, 100), "cuda_graph_replay": 0.0}
    keys = {"qkv_proj": ("M<=8", 8, 96, 64), "rmsnorm": ("T<=8", None, None, None),
            "cuda_graph_replay": ("T<=4", None, None, None)}

    def snap(times, samples, steps):
        rows = [_row(op, keys[op][0], times[op], samples, *keys[op][1:]) for op in times if times[op] > 0]
        return {"gemm": {"qkv_proj": [{"m_bucket": 8, "n": 96, "k": 64, "launches": samples, "tokens": 6 * samples,
                                       "flops": 2.0 * 6 * 96 * 64 * samples, "modeled_ms": None}]},
                "kernels": {}, "tokens_scheduled": 0,
                "measured": {"source": source, "sampled_steps": steps, "unread_steps": 0, "ops": rows}}

    before = snap(old, 4, {"eager": 2, "graph": 0})
    after = snap({op: old[op] + add[op] for op in add}, 10, {"eager": 5, "graph": 1})
    return before, after, add


def _steps_record() -> dict:
    return {"totals": {"steps": 3.0, "tokens": 18.0, "host_s": 0.1}, "by_batch": {}, "history": [],
            "rates": {"copy_bytes_per_s": None, "gemm_flop_per_s": None, "source": "absent"},
            "plan": {"gemms": [{"name": "qkv_proj", "count": 1, "m_source": "tokens"}], "num_layers": 1,
                     "act_bytes": 2}, "timing": {}, "open_files": {}}


def test_section_one_ranks_by_measured_time(tmp_path):
    rng = random.Random(7)
    before, after, add = _snapshots(rng, "cuda_events")
    rec = diff({"shapes": before, "steps": _steps_record()}, {"shapes": after, "steps": _steps_record()})
    rows = rec["measured"]["rows"]
    assert [r["op"] for r in rows] == ["qkv_proj", "rmsnorm", "cuda_graph_replay"]
    assert abs(rows[0]["total_ms"] - add["qkv_proj"]) < 1e-9 and rows[0]["samples"] == 6
    assert rec["measured"]["sampled_steps"] == {"eager": 3, "graph": 1}
    lines, head = local_shapes(rec)
    share = 100 * add["qkv_proj"] / sum(add.values())
    assert head == (f"qkv_proj at M <= 8 (N=96, K=64) is {share:.0f}% of the measured GPU time (measured on 4 "
                    f"sampled steps, 3 eager).")
    text = "\n".join(lines)
    assert "measured on 4 sampled steps: 3 eager" in text and "1 that replayed a CUDA graph" in text
    assert f"| qkv_proj | 8 | 96 | 64 | 6 | 36 | 0.0004424 | - | {add['qkv_proj']:.4g} |" in text  # measured beside
    rec["rates"] = {"copy_bytes_per_s": 1e6, "gemm_flop_per_s": 1e9, "source": "given"}
    mean_s = add["qkv_proj"] / 6 / 1e3  # M = 36 tokens / 6 launches; weight + input + output, 2-byte activations
    pct = 100 * (96 * 64 + 6 * 64 + 6 * 96) * 2 / mean_s / 1e6
    head = head.replace(" (measured on", f" at {pct:.0f}% of copy bandwidth (measured on")
    assert local_shapes(rec)[1] == head
    path = write_report(str(tmp_path), rec, {"model_id": "m"}, None)
    assert head in open(path).read()
    assert json.loads((tmp_path / "report.json").read_text())["headlines"]["1. Local shapes"] == head


def test_section_one_says_modeled_without_measurements():
    rng = random.Random(8)
    before, after, _ = _snapshots(rng, "host_clock")
    for snap in (before, after):
        snap["measured"] = {"source": None, "sampled_steps": {"eager": 0, "graph": 0}, "unread_steps": 0, "ops": []}
    rec = diff({"shapes": before, "steps": _steps_record()}, {"shapes": after, "steps": _steps_record()})
    lines, head = local_shapes(rec)
    assert rec["measured"]["rows"] == [] and head.endswith("(modeled, not measured).")
    assert any("No per-op time was measured" in line for line in lines)


def test_host_clock_rows_are_labelled_host_time():
    before, after, _ = _snapshots(random.Random(9), "host_clock")
    rec = diff({"shapes": before, "steps": _steps_record()}, {"shapes": after, "steps": _steps_record()})
    lines, head = local_shapes(rec)
    assert "of the measured host time" in head and any("host time (host clock)" in line for line in lines)


def test_repeated_work_adds_the_measured_time_per_launch():
    from ladle.bench.bottleneck_report import repeated_work

    before, after, add = _snapshots(random.Random(10), "cuda_events")
    rec = diff({"shapes": before, "steps": _steps_record()}, {"shapes": after, "steps": _steps_record()})
    rec["totals"]["steps"] = 3.0  # the run's steps (the synthetic step records did not change)
    lines, _ = repeated_work(rec, {})
    mean_us = 1e3 * add["qkv_proj"] / 6
    step_ms = 6 / 3 * mean_us / 1e3  # 6 qkv_proj launches over 3 steps; rmsnorm has no launches in the run
    line = next(x for x in lines if x.startswith("Measured GPU time (CUDA events) per launch"))
    assert line.startswith(f"Measured GPU time (CUDA events) per launch on the sampled eager steps: qkv_proj "
                           f"{mean_us:.3g} us")
    assert f"a mean step take {step_ms:.3g} ms" in line and "cuda_graph_replay" not in line
