"""`ladle bench sweep`: `serve` at several concurrencies; one JSON per point, a Markdown table and a PNG.

The picture follows InferenceX (bench_methodology.md §2.2): throughput per GPU (total tokens/s / --num-gpus) on the
y axis against interactivity = 1000 / median TPOT ms (tokens/s per user) on the x axis, one point per concurrency;
beside it, TTFT (median and p99) against concurrency. The table gives p90/p99 as well. Every point uses the same
seed, so all points see the same prompts (a server with prefix caching sees the prompts again at later points;
start it with prefix caching off for fixed-length sweeps, as InferenceX does). The PNG needs matplotlib (the
`bench` extra); without it the sweep says so before the first point and writes the table and JSON only.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import json
import os
import sys
from typing import Any

DEFAULT_CONCURRENCIES = "1,4,16,64,256"


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument("--concurrencies", default=DEFAULT_CONCURRENCIES,
                   help="comma-separated; points above --num-prompts are dropped")
    g.add_argument("--prompts-per-concurrency", type=int, default=None,
                   help="if set, each point sends K x concurrency prompts (InferenceX uses 10) instead of --num-prompts")
    g.add_argument("--warmups-per-concurrency", type=int, default=None,
                   help="if set, each point warms up with K x concurrency requests (InferenceX uses 2)")


def concurrency_points(args: argparse.Namespace) -> list[int]:
    pts = sorted({int(c) for c in args.concurrencies.split(",") if c.strip()})
    if any(c <= 0 for c in pts):
        raise ValueError("--concurrencies must be positive")
    if args.prompts_per_concurrency is None:
        capped = [c for c in pts if c <= args.num_prompts]
        pts = capped or [args.num_prompts]
    return pts


def point_args(args: argparse.Namespace, c: int, out_dir: str) -> argparse.Namespace:
    from ladle.bench.report import selected_metrics, selected_percentiles

    a = copy.copy(args)
    a.max_concurrency = c
    if args.prompts_per_concurrency is not None:
        a.num_prompts = args.prompts_per_concurrency * c
    if args.warmups_per_concurrency is not None:
        a.num_warmups = args.warmups_per_concurrency * c
    pcts = sorted(set(selected_percentiles(args)) | {50.0, 90.0, 99.0})
    a.metric_percentiles = ",".join(f"{p:g}" for p in pcts)
    a.percentile_metrics = ",".join(dict.fromkeys(selected_metrics(args) + ["ttft", "tpot", "itl", "e2el"]))
    a.save_result, a.result_dir, a.result_filename = True, out_dir, f"c{c}.json"
    return a


def _row(c: int, r: dict[str, Any], num_gpus: int) -> dict[str, Any]:
    def inter(key: str) -> float | None:
        v = r.get(key)
        return 1000.0 / v if v else None

    return {
        "concurrency": c, "completed": r["completed"], "failed": r["failed"],
        "req_s": r["request_throughput"], "out_tok_s": r["output_throughput"], "tot_tok_s": r["total_token_throughput"],
        "tok_s_gpu": r["total_token_throughput"] / num_gpus, "out_tok_s_gpu": r["output_throughput"] / num_gpus,
        "ttft_med": r.get("median_ttft_ms"), "ttft_p90": r.get("p90_ttft_ms"), "ttft_p99": r.get("p99_ttft_ms"),
        "tpot_med": r.get("median_tpot_ms"), "tpot_p90": r.get("p90_tpot_ms"), "tpot_p99": r.get("p99_tpot_ms"),
        "intvty_med": inter("median_tpot_ms"), "intvty_p90": inter("p90_tpot_ms"), "intvty_p99": inter("p99_tpot_ms"),
        "e2el_med": r.get("median_e2el_ms"), "e2el_p99": r.get("p99_e2el_ms"),
    }


COLUMNS = [
    ("concurrency", "conc"), ("completed", "ok"), ("failed", "failed"), ("req_s", "req/s"),
    ("out_tok_s", "out tok/s"), ("tot_tok_s", "total tok/s"), ("tok_s_gpu", "tok/s/GPU"),
    ("ttft_med", "TTFT med ms"), ("ttft_p90", "TTFT p90"), ("ttft_p99", "TTFT p99"),
    ("tpot_med", "TPOT med ms"), ("tpot_p90", "TPOT p90"), ("tpot_p99", "TPOT p99"),
    ("intvty_med", "tok/s/user med"), ("intvty_p90", "tok/s/user p90"), ("intvty_p99", "tok/s/user p99"),
    ("e2el_med", "E2EL med ms"), ("e2el_p99", "E2EL p99"),
]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r[k]) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    pts = [r for r in rows if r["intvty_med"]]
    ax1.plot([r["intvty_med"] for r in pts], [r["tok_s_gpu"] for r in pts], "o-")
    for r in pts:
        ax1.annotate(f"c={r['concurrency']}", (r["intvty_med"], r["tok_s_gpu"]), textcoords="offset points",
                     xytext=(4, 4), fontsize=8)
    ax1.set_xlabel("interactivity (tok/s/user = 1000 / median TPOT ms)")
    ax1.set_ylabel("throughput per GPU (total tok/s)")
    ax1.grid(True, alpha=0.3)
    conc = [r["concurrency"] for r in rows]
    ax2.plot(conc, [r["ttft_med"] for r in rows], "o-", label="median")
    ax2.plot(conc, [r["ttft_p99"] for r in rows], "s--", label="p99")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("TTFT (ms)")
    ax2.legend()
    ax2.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MISSING_MATPLOTLIB = ("ladle bench sweep: matplotlib is not installed, so this sweep writes sweep.md and sweep.json "
                      "but no sweep.png; for the plot, install it: pip install matplotlib (or pip install "
                      "'ladle[bench]')")


def can_plot() -> bool:
    """Whether matplotlib can be imported (checked before the first point, not after the last)."""
    return importlib.util.find_spec("matplotlib") is not None


def run_sweep(args: argparse.Namespace, argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Runs every point; writes c{C}.json, sweep.md, sweep.json and (with matplotlib) sweep.png under --result-dir
    (default ./bench_sweep). Returns the table rows."""
    from ladle.bench.serve import run_serve

    plotting = can_plot()
    if not plotting:
        print(MISSING_MATPLOTLIB, file=sys.stderr)
    out_dir = args.result_dir or "bench_sweep"
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    model = args.model
    for c in concurrency_points(args):
        print(f"=== sweep point: concurrency {c} ===")
        result = asyncio.run(run_serve(point_args(args, c, out_dir), argv))
        rows.append(_row(c, result, args.num_gpus or 1))
        model = result["model_id"]
    table = markdown_table(rows)
    with open(os.path.join(out_dir, "sweep.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out_dir, "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if plotting:
        plot(rows, os.path.join(out_dir, "sweep.png"), f"{model} - {args.dataset_name}, {args.num_gpus or 1} GPU(s)")
    print(table)
    return rows
