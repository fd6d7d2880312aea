"""DIR/report.md (five sections, then Correctness), DIR/report.json and the PNG plots of `--report DIR`.

Sections (issue 15): `1. Local shapes`, `2. Repeated work`, `3. Bytes moved`, `4. Fast paths`, `5. Queues`, then
`Correctness`; each ends with one sentence naming its largest item. Input: the run's record from
`ladle.bench.bottleneck.diff`, the benchmark result, and the gate result (ladle/bench/gate.py) or None.

Section 1 ranks by measured time per op and bucket when the server ran with --observe-timing (sampled steps; CUDA
events on eager steps, a CUDA-graph replay as one row; ladle/observe/op_timing.py), else by modeled roofline time
(or FLOPs without device rates), and says which.

Repeated work assumes LAUNCH_US per kernel launch (the issue's example figure; a CUDA launch costs a few us of host
time) and counts one decode step per output token per request; it is an estimate from the plan and the run.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

LAUNCH_US = 5.0
GRAPH_OP = "cuda_graph_replay"  # ladle.observe.op_timing.GRAPH_OP (bench/ may not import observe/)
SECTIONS = ("1. Local shapes", "2. Repeated work", "3. Bytes moved", "4. Fast paths", "5. Queues", "Correctness")


def _pct(x: float, total: float) -> float:
    return 100.0 * x / total if total else 0.0


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]


def _token_ops(rec: dict) -> list[str]:
    plan = rec.get("plan") or {}
    return [g["name"] for g in plan.get("gemms", []) if g.get("m_source") == "tokens"]


def _gemm_key(r: dict) -> tuple:
    return (r["op"], r["m_bucket"], r["n"], r["k"])


def local_shapes(rec: dict) -> tuple[list[str], str]:
    rows = rec["shapes"]
    measured = rec.get("measured") or {}
    mrows = measured.get("rows") or []
    gemm_ms = {_gemm_key(r): r["total_ms"] for r in mrows if r.get("n") is not None}
    timed = bool(rows) and all(r["modeled_ms"] is not None for r in rows)
    weight = (lambda r: r["modeled_ms"]) if timed else (lambda r: r["flops"])
    total = sum(weight(r) for r in rows)
    lines = [f"GEMMs by local shape (N, K after sharding; MoE experts at tokens per expert under uniform routing); "
             f"share of {'modeled GEMM time (roofline per launch)' if timed else 'GEMM FLOPs (no device rates)'}"
             f"{'; measured ms on the sampled steps beside it' if gemm_ms else ''}:", ""]
    lines += _table(["op", "M <=", "N", "K", "launches", "tokens", "GFLOP", "modeled ms", "measured ms", "share %"],
                    [[r["op"], r["m_bucket"], r["n"], r["k"], r["launches"], r["tokens"], r["flops"] / 1e9,
                      r["modeled_ms"], gemm_ms.get(_gemm_key(r)), _pct(weight(r), total)] for r in rows])
    kernels = rec.get("kernels") or {}
    if kernels:
        lines += ["", "Kernel ops (launches per token bucket, from the dispatch record):", ""]
        lines += _table(["op", "bucket", "launches"], [[op, b, n] for op, bs in sorted(kernels.items())
                                                       for b, n in bs.items()])
    tokens = int(rec["totals"].get("tokens", 0))
    ops = _token_ops(rec)
    hist = sum(r["tokens"] for r in rows if ops and r["op"] == ops[0])
    lines += ["", f"Tokens in the histogram ({ops[0] if ops else '-'}): {hist}; tokens the run scheduled: {tokens}."]
    t = rec["totals"]
    if t.get("gpu_steps"):
        lines.append(f"GPU time per sampled step: {1e3 * t['gpu_s'] / t['gpu_steps']:.3f} ms over "
                     f"{int(t['gpu_steps'])} steps (--observe-timing).")
    if mrows:
        lines += [""] + measured_table(rec)
        return lines, _measured_headline(rec)
    lines.append("No per-op time was measured (--observe-timing off): shares are modeled, not measured.")
    if not rows or not total:
        return lines, "No GEMM ran during the run."
    top = max(rows, key=weight)
    return lines, (f"{top['op']} at M <= {top['m_bucket']} (N={top['n']}, K={top['k']}) is "
                   f"{_pct(weight(top), total):.0f}% of {'modeled GEMM time' if timed else 'GEMM FLOPs'} (modeled, "
                   f"not measured).")


def _sampled_words(measured: dict) -> str:
    steps = measured.get("sampled_steps") or {}
    eager, graph = int(steps.get("eager", 0)), int(steps.get("graph", 0))
    return (f"measured on {eager + graph} sampled steps: {eager} eager (prefill, mixed, and decode steps that no "
            f"captured CUDA graph served; the per-op rows come from these only) and {graph} that replayed a CUDA "
            f"graph (one {GRAPH_OP} row each, their whole step time)")


def _time_kind(measured: dict) -> str:
    return "GPU time (CUDA events)" if measured.get("source") == "cuda_events" else "host time (host clock)"


def measured_table(rec: dict) -> list[str]:
    """Measured time per op and bucket, ranked (ladle/observe/op_timing.py via /debug/shapes)."""
    measured = rec["measured"]
    rows = measured["rows"]
    total = sum(r["total_ms"] for r in rows)
    lines = [f"Measured {_time_kind(measured)} per op and bucket, {_sampled_words(measured)}:", ""]
    lines += _table(["op", "bucket", "N", "K", "samples", "total ms", "mean us per launch", "share %",
                     "% of copy bandwidth"],
                    [[r["op"], r["bucket"], r["n"], r["k"], r["samples"], r["total_ms"], r["mean_us"],
                      _pct(r["total_ms"], total), _copy_share(rec, r)] for r in rows])
    return lines


def _copy_share(rec: dict, row: dict) -> Optional[float]:
    """Bytes of one launch of a GEMM row (weight + input + output at the shape rows' mean M) over its measured
    mean time, as % of the device copy bandwidth; None for kernel ops, host time or without rates."""
    bw = (rec.get("rates") or {}).get("copy_bytes_per_s")
    plan = rec.get("plan") or {}
    if row.get("n") is None or not bw or (rec.get("measured") or {}).get("source") != "cuda_events":
        return None
    count = {g["name"]: g["count"] for g in plan.get("gemms", [])}.get(row["op"], 1)
    shape = [r for r in rec["shapes"] if _gemm_key(r) == _gemm_key(row)]
    launches = sum(r["launches"] for r in shape)
    if not launches or not row["mean_us"]:
        return None
    m = sum(r["tokens"] for r in shape) * count / launches  # mean M per launch
    nbytes = (row["n"] * row["k"] + m * row["k"] + m * row["n"]) * plan.get("act_bytes", 2)
    return _pct(nbytes / (row["mean_us"] * 1e-6), bw)


def _measured_headline(rec: dict) -> str:
    measured = rec["measured"]
    rows = measured["rows"]
    top, total = rows[0], sum(r["total_ms"] for r in rows)
    shape = f" (N={top['n']}, K={top['k']})" if top.get("n") is not None else ""
    bw = _copy_share(rec, top)
    steps = measured.get("sampled_steps") or {}
    return (f"{top['op']} at {top['bucket'].replace('<=', ' <= ')}{shape} is {_pct(top['total_ms'], total):.0f}% of "
            f"the measured {_time_kind(measured).split(' (')[0]}"
            + (f" at {bw:.0f}% of copy bandwidth" if bw is not None else "")
            + f" (measured on {int(steps.get('eager', 0)) + int(steps.get('graph', 0))} sampled steps, "
              f"{int(steps.get('eager', 0))} eager).")


def repeated_work(rec: dict, result: dict) -> tuple[list[str], str]:
    t = rec["totals"]
    steps = max(t.get("steps", 0), 1)
    layers = (rec.get("plan") or {}).get("num_layers") or 1
    hist = rec["history"]
    active = sum(h["num_reqs"] for h in hist) / len(hist) if hist else 0.0
    out_tokens = int(result.get("total_output_tokens") or t.get("sampled", 0))
    items = []
    by_op: dict[str, float] = {}
    for r in rec["shapes"]:
        by_op[r["op"]] = by_op.get(r["op"], 0) + r["launches"]
    for op, bs in (rec.get("kernels") or {}).items():
        by_op[op] = by_op.get(op, 0) + sum(bs.values())
    counts = {g["name"]: g["count"] for g in (rec.get("plan") or {}).get("gemms", [])}  # weights per GEMM kind
    for op, launches in by_op.items():
        per_step = launches / steps
        where = counts.get(op, layers)  # a GEMM repeats once per weight it has (lm_head: 1), a kernel per layer
        items.append([op, per_step / where, where, per_step, int(launches), per_step * LAUNCH_US * 1e-6 * 1000])
    items.sort(key=lambda r: -r[-1])
    lines = [f"Run: {int(t.get('steps', 0))} steps, {out_tokens} output tokens, {active:.1f} active requests per step "
             f"on average, {layers} layers. Per-layer work x layers x output tokens x active requests: every "
             f"launch below repeats once per step, and a reply of 1,000 tokens takes 1,000 steps.", ""]
    lines += _table(["op", "per layer per step", "layers (GEMMs: weights of that kind)", "launches per step", "launches in run",
                     f"s per 1,000-token reply at {LAUNCH_US:g} us/launch"], items)
    lines += _measured_per_launch(rec, {r[0]: r[3] for r in items})
    plan = rec.get("plan") or {}
    w = t.get("compute.weights_read", 0.0) / steps
    bw = (rec.get("rates") or {}).get("copy_bytes_per_s")
    lines += ["", f"Weights read per step: {w / 1e6:.3f} MB, shared by {active:.1f} requests "
                  f"({w / max(active, 1e-9) / 1e6:.3f} MB per request per token)"
                  + (f"; at copy bandwidth that is {w / bw * 1e3:.3f} s per 1,000 steps." if bw else ".")]
    if plan.get("tp_size", 1) > 1:
        lines.append(f"Tensor parallel size {plan['tp_size']}: shapes above are one rank's.")
    if not items:
        return lines, "No launches were recorded during the run."
    total = sum(r[-1] for r in items)
    top = items[0]
    return lines, (f"{top[0]}: {top[1]:.3g} launch(es) in each of {top[2]} layers add {top[-1]:.3g} s to every "
                   f"1,000-token reply at {LAUNCH_US:g} us per launch (all launches: {total:.3g} s).")


def _measured_per_launch(rec: dict, per_step: dict[str, float]) -> list[str]:
    """With --observe-timing: the measured mean time per launch of each op (all its buckets) and what the launches
    of one step add up to at those times (per 1,000-token reply: x 1,000 steps)."""
    measured = rec.get("measured") or {}
    sums: dict[str, list[float]] = {}
    for r in measured.get("rows") or []:
        if r["op"] != GRAPH_OP:
            row = sums.setdefault(r["op"], [0.0, 0])
            row[0] += r["total_ms"]
            row[1] += r["samples"]
    if not sums:
        return []
    mean_us = {op: 1e3 * ms / n for op, (ms, n) in sums.items()}
    step_ms = sum(per_step.get(op, 0.0) * us / 1e3 for op, us in mean_us.items())
    ranked = sorted(mean_us.items(), key=lambda kv: -kv[1] * per_step.get(kv[0], 0.0))
    return ["", f"Measured {_time_kind(measured)} per launch on the sampled eager steps: "
                + ", ".join(f"{op} {us:.3g} us" for op, us in ranked)
                + f". At these times the launches of a mean step take {step_ms:.3g} ms, i.e. {step_ms:.3g} s per "
                  f"1,000-token reply."]


def bytes_moved(rec: dict) -> tuple[list[str], str]:
    t = rec["totals"]
    steps = max(t.get("steps", 0), 1)
    items = [(k, v) for k, v in t.items() if k.split(".")[0] in ("compute", "persistent", "communication")]
    total = sum(v for _, v in items)
    lines = _table(["plane.item", "bytes in run", "bytes per step", "share %"],
                   [[k, v, v / steps, _pct(v, total)] for k, v in sorted(items, key=lambda kv: -kv[1])])
    rates = rec.get("rates") or {}
    bw, gemm = rates.get("copy_bytes_per_s"), rates.get("gemm_flop_per_s")
    lines += ["", f"Device rates ({rates.get('source', 'absent')}): copy "
                  f"{'-' if not bw else f'{bw / 1e9:.1f} GB/s'}, GEMM {'-' if not gemm else f'{gemm / 1e12:.1f} TFLOP/s'}.",
              f"GEMM FLOPs in run: {t.get('flops.gemm', 0.0):.4g}.", ""]
    rows = []
    for bucket, r in rec["by_batch"].items():
        step_s = (r["gpu_s"] / r["gpu_steps"]) if r.get("gpu_steps") else r["host_s"] / r["steps"]
        roof = r["roofline_s"] / r["steps"] if bw and gemm else None
        rows.append([bucket, int(r["steps"]), step_s * 1e3, None if roof is None else roof * 1e3,
                     None if not roof else _pct(roof, step_s), r["bytes"] / r["steps"]])
    lines += _table(["batch <=", "steps", "step ms (GPU if timed, else host)", "roofline ms", "% of roofline speed",
                     "bytes per step"], rows)
    if not items or not total:
        return lines, "No bytes were recorded (the server has no model plan)."
    top_k, top_v = max(items, key=lambda kv: kv[1])
    tail = ""
    if bw and gemm and t.get("host_s"):
        run_s = t["gpu_s"] if t.get("gpu_steps") == t.get("steps") else t["host_s"]
        tail = f"; the steps ran at {_pct(t.get('roofline_s', 0.0), run_s):.0f}% of their byte/FLOP roofline"
    else:
        tail = "; no device rates, so no roofline (pass --observe-copy-bandwidth and --observe-gemm-rate)"
    return lines, f"{top_k} is {_pct(top_v, total):.0f}% of the {total / 1e9:.3g} GB moved{tail}."


def fast_paths(rec: dict) -> tuple[list[str], str]:
    rows, warnings = [], []
    for op, d in sorted(rec["dispatch"].items()):
        reasons = "; ".join(f"{r} (x{n})" for r, n in d["fallback_reasons"].items())
        rows.append([op, d["path"], d["configured"], d["eligible"], d["executed"], d["calls"], reasons or "-"])
        if d["configured"] > 0 and d["executed"] == 0:
            warnings.append(f"WARNING: {op}: {d['path']} was configured {d['configured']} times and never executed"
                            + (f" ({reasons})" if reasons else ""))
    lines = _table(["op", "path", "configured", "eligible", "executed", "calls", "not-eligible reasons"], rows)
    configured = [r for r in rows if r[2] > 0]
    if not configured:
        warnings.append("No fast path was configured during the run (every op ran its torch reference).")
    lines += [""] + (warnings or ["Every configured fast path executed at least once."])
    ran = [r for r in rows if r[5] > 0]
    if not ran:
        return lines, "No dispatch decision was recorded during the run."
    fallbacks = [r for r in ran if r[2] > r[4]]
    if fallbacks:
        worst = max(fallbacks, key=lambda r: r[2] - r[4])
        return lines, f"{worst[0]} fell back to its reference on {worst[2] - worst[4]} of {worst[2]} configured calls."
    unconfigured = [r for r in ran if r[2] == 0]
    if unconfigured:
        top = max(unconfigured, key=lambda r: r[5])
        return lines, (f"{top[0]} ran its reference path on all {top[5]} calls (its {top[1]} path was not "
                       f"configured); {len(ran) - len(unconfigured)} of {len(ran)} ops ran configured fast paths.")
    return lines, f"All {len(ran)} ops ran their configured fast path on every call."


def queues(rec: dict) -> tuple[list[str], str]:
    hist, t = rec["history"], rec["totals"]
    of = rec.get("open_files") or {}
    if not hist:
        return [f"Open files limit: {of.get('soft')} (hard {of.get('hard')}), {of.get('open')} open."], \
               "No step ran during the run."
    span = hist[-1]["t"] - hist[0]["t"]
    longest, start = 0.0, None
    for h in hist:
        if h["waiting"] > 0 and start is None:
            start = h["t"]
        elif h["waiting"] == 0 and start is not None:
            longest, start = max(longest, h["t"] - start), None
    if start is not None:
        longest = max(longest, hist[-1]["t"] - start)
    kv_max = max(h["kv_usage"] for h in hist)
    adm = t.get("admission_delay_s", 0.0) / t["admitted"] if t.get("admitted") else None
    adm_max = max((h["admission_delay_ms"] or 0.0) for h in hist)
    lines = _table(["", "value"], [
        ["steps recorded", len(hist)], ["seconds covered", span],
        ["waiting max / mean", f"{max(h['waiting'] for h in hist)} / {sum(h['waiting'] for h in hist) / len(hist):.2f}"],
        ["running max / mean", f"{max(h['running'] for h in hist)} / {sum(h['running'] for h in hist) / len(hist):.2f}"],
        ["KV usage max %", 100 * kv_max], ["preemptions", int(t.get("preemptions", 0))],
        ["admission delay mean ms", None if adm is None else adm * 1e3], ["admission delay max ms (step mean)", adm_max],
        ["longest stretch with a waiting request, s", longest],
        ["open files (limit soft / hard / open)", f"{of.get('soft')} / {of.get('hard')} / {of.get('open')}"]])
    if longest > 0:
        return lines, (f"the waiting queue grew for {longest:.3g} s (longest stretch) while KV usage peaked at "
                       f"{100 * kv_max:.3g}%, with {int(t.get('preemptions', 0))} preemptions.")
    return lines, (f"no request waited at a step boundary; KV usage peaked at {100 * kv_max:.3g}% and the mean "
                   f"admission delay was {0.0 if adm is None else adm * 1e3:.3g} ms.")


def correctness(gate: Optional[dict]) -> tuple[list[str], str]:
    if not gate:
        return ["No gate was asked for (--gate gsm8k[:N] or --gate reference FILE)."], "Correctness was not gated."
    lines = [f"Gate: {gate['kind']}; {gate['summary']}"]
    if gate.get("divergence"):  # --gate reference: first-divergence token per prompt and run (None: identical)
        lines += ["", "First divergence from the reference (token position; - = identical):", ""]
        lines += _table(["prompt", "before the load", "after the load"],
                        [[repr(d["prompt"])[:48].replace("|", "\\|"), d["before"], d["after"]]
                         for d in gate["divergence"]])
        lines.append("")
    for d in gate.get("details", [])[:20]:
        lines.append(f"- {d}")
    return lines, f"Correctness gate {'PASSED' if gate['passed'] else 'FAILED'}: {gate['summary']}."


def write_report(out_dir: str, rec: dict, result: dict, gate: Optional[dict]) -> str:
    """Write report.md, report.json and the plots; returns the report.md path."""
    os.makedirs(out_dir, exist_ok=True)
    headlines: dict[str, str] = {}
    md = ["# ladle bottleneck report", "",
          f"Model {result.get('model_id')}, {result.get('completed')} requests, duration "
          f"{result.get('duration', 0.0):.3g} s, output {result.get('output_throughput', 0.0):.4g} tok/s.", ""]
    if not rec.get("available"):
        md += ["The server has no /debug/steps (not a ladle server?): sections 1-5 are empty.", ""]
    writers = (lambda: local_shapes(rec), lambda: repeated_work(rec, result), lambda: bytes_moved(rec),
               lambda: fast_paths(rec), lambda: queues(rec))
    for title, write in zip(SECTIONS, writers + (lambda: correctness(gate),)):
        if not rec.get("available") and title != "Correctness":
            lines, head = ["(no record)"], "Not available."
        else:
            lines, head = write()
        headlines[title] = head
        md += [f"## {title}", ""] + lines + ["", head, ""]
    path = os.path.join(out_dir, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    plots = []
    if rec.get("available"):
        from ladle.bench.bottleneck_plots import write_plots

        plots = write_plots(out_dir, rec)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump({"headlines": headlines, "record": rec, "gate": gate, "plots": plots,
                   "result": {k: v for k, v in result.items() if not isinstance(v, list)}}, f, indent=1, default=str)
    return path
