"""The PNGs beside report.md: shapes.png (launches per local shape, with measured time (--observe-timing) and/or
modeled time or GFLOP per bucket),
roofline.png (step time against its byte/FLOP roofline per batch size), queues.png (queue depth and KV usage over
time). Needs matplotlib; without it no PNG is written and the list is empty (report.md says so via the JSON)."""

from __future__ import annotations

import importlib.util
import os


def write_plots(out_dir: str, rec: dict) -> list[str]:
    """Write the three PNGs; returns their file names (empty without matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, draw in (("shapes.png", _shapes), ("roofline.png", _roofline), ("queues.png", _queues)):
        fig, ax = plt.subplots(figsize=(10, 4.5))
        draw(ax, rec)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=100)
        plt.close(fig)
        written.append(name)
    return written


def _shapes(ax, rec: dict) -> None:
    rows = rec["shapes"]
    labels = [f"{r['op']}\nM<={r['m_bucket']}" for r in rows]
    x = range(len(rows))
    ax.bar(x, [r["launches"] for r in rows], color="tab:blue", label="launches")
    ax.set_xticks(list(x), labels, rotation=60, fontsize=7)
    ax.set_ylabel("launches")
    twin = ax.twinx()
    timed = rows and all(r["modeled_ms"] is not None for r in rows)
    measured = {(m["op"], m["m_bucket"], m["n"], m["k"]): m["total_ms"]
                for m in (rec.get("measured") or {}).get("rows", []) if m.get("n") is not None}
    if measured:  # --observe-timing: measured time of the sampled steps per bucket (modeled beside it if known)
        twin.plot(list(x), [measured.get((r["op"], r["m_bucket"], r["n"], r["k"]), float("nan")) for r in rows],
                  "x", color="tab:green", label="measured ms (sampled steps)")
        if timed:
            twin.plot(list(x), [r["modeled_ms"] for r in rows], "o", color="tab:red", label="modeled ms")
        twin.set_ylabel("ms per bucket")
        twin.legend(loc="upper right")
    else:
        twin.plot(list(x), [r["modeled_ms"] if timed else r["flops"] / 1e9 for r in rows], "o", color="tab:red")
        twin.set_ylabel("modeled ms per bucket" if timed else "GFLOP per bucket (no device rates)")
    ax.set_title("local GEMM shapes: launches and time per bucket")


def _roofline(ax, rec: dict) -> None:
    xs, step, roof = [], [], []
    for bucket, r in rec["by_batch"].items():
        xs.append(int(bucket))
        step.append(1e3 * ((r["gpu_s"] / r["gpu_steps"]) if r.get("gpu_steps") else r["host_s"] / r["steps"]))
        roof.append(1e3 * r["roofline_s"] / r["steps"] if r["roofline_s"] else None)
    ax.plot(xs, step, "o-", label="step time (GPU if timed, else host)")
    if any(v is not None for v in roof):
        ax.plot(xs, [v or float("nan") for v in roof], "s--", label="byte/FLOP roofline")
    if xs:  # a run without steps draws empty axes (log scales need data)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xlabel("requests in the step (bucket)")
    ax.set_ylabel("ms per step")
    ax.legend()
    ax.grid(True, alpha=0.3)


def _queues(ax, rec: dict) -> None:
    hist = rec["history"]
    t0 = hist[0]["t"] if hist else 0.0
    ts = [h["t"] - t0 for h in hist]
    ax.plot(ts, [h["waiting"] for h in hist], label="waiting")
    ax.plot(ts, [h["running"] for h in hist], label="running")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests")
    ax.legend(loc="upper left")
    twin = ax.twinx()
    twin.plot(ts, [100 * h["kv_usage"] for h in hist], color="tab:red", alpha=0.6)
    twin.set_ylabel("KV usage %")
    ax.set_title("queues and KV usage")
