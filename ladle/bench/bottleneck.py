"""`ladle bench serve --report DIR`: read the server's bottleneck record (/debug/shapes, /debug/dispatch,
/debug/steps; ladle/server/debug.py) before and after the load, and take the difference: what this run did.

The server keeps cumulative counters, so the run's share is after - before for every counter, and the step records
of the run are the last (after.steps - before.steps) of the history (the server keeps 4096; a longer run reports
its totals exactly and its queue history for the last 4096 steps only). Everything the gate sends is outside the
window (the gate runs before `before` and after `after`); warm-up requests are inside it.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from ladle.bench import server_info

HISTORY_STEPS = 4096


async def collect(session: aiohttp.ClientSession, base_url: str, history: int = 0) -> dict[str, Any]:
    """{"shapes", "dispatch", "steps"} from the server; a missing endpoint gives None (not a ladle server)."""
    out = {}
    for key, path in (("shapes", "/debug/shapes"), ("dispatch", "/debug/dispatch"),
                      ("steps", f"/debug/steps?last={history}")):
        out[key] = await server_info.get_json(session, base_url + path)
    return out


def _num(d: dict, key: str) -> float:
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) else 0.0


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The run's record: {"shapes", "kernels", "measured", "dispatch", "totals", "by_batch", "history", "rates",
    "plan", "timing", "open_files", "available"}; available False when the server has no /debug/steps."""
    b_steps, a_steps = before.get("steps") or {}, after.get("steps") or {}
    if not isinstance(a_steps, dict) or "totals" not in a_steps:
        return {"available": False}
    b_tot, a_tot = b_steps.get("totals", {}), a_steps["totals"]
    totals = {k: _num(a_tot, k) - _num(b_tot, k) for k in a_tot}
    n_steps = int(totals.get("steps", 0))
    history = a_steps.get("history", [])[-n_steps:] if n_steps > 0 else []
    by_batch = {}
    b_batch = b_steps.get("by_batch", {})
    for bucket, row in a_steps.get("by_batch", {}).items():
        prev = b_batch.get(bucket, {})
        d = {k: (row[k] or 0) - (prev.get(k) or 0) for k in ("steps", "host_s", "roofline_s", "bytes", "gpu_steps")}
        d["gpu_s"] = ((row.get("gpu_s") or 0) - (prev.get("gpu_s") or 0)) if row.get("gpu_s") is not None else None
        if d["steps"] > 0:
            by_batch[bucket] = d
    return {"available": True, "shapes": _diff_shapes(before.get("shapes") or {}, after.get("shapes") or {}),
            "kernels": _diff_kernels(before.get("shapes") or {}, after.get("shapes") or {}),
            "measured": _diff_measured(before.get("shapes") or {}, after.get("shapes") or {}),
            "dispatch": _diff_dispatch(before.get("dispatch") or {}, after.get("dispatch") or {}),
            "totals": totals, "by_batch": by_batch, "history": history, "rates": a_steps.get("rates"),
            "plan": a_steps.get("plan"), "timing": a_steps.get("timing"), "open_files": a_steps.get("open_files")}


def _diff_shapes(before: dict, after: dict) -> list[dict[str, Any]]:
    """Rows {op, m_bucket, n, k, launches, tokens, flops, modeled_ms} that changed during the run."""
    prev = {(op, r["m_bucket"], r["n"], r["k"]): r for op, rows in (before.get("gemm") or {}).items() for r in rows}
    out = []
    for op, rows in (after.get("gemm") or {}).items():
        for r in rows:
            p = prev.get((op, r["m_bucket"], r["n"], r["k"]), {})
            row = {"op": op, "m_bucket": r["m_bucket"], "n": r["n"], "k": r["k"]}
            for key in ("launches", "tokens", "flops"):
                row[key] = (r.get(key) or 0) - (p.get(key) or 0)
            row["modeled_ms"] = (None if r.get("modeled_ms") is None
                                 else r["modeled_ms"] - (p.get("modeled_ms") or 0.0))
            if row["launches"] > 0:
                out.append(row)
    return out


def _diff_measured(before: dict, after: dict) -> dict[str, Any]:
    """{"source", "sampled_steps": {"eager", "graph"}, "rows": [{op, bucket, m_bucket, n, k, total_ms, samples,
    mean_us}]} of the run, largest total_ms first (ladle.observe.op_timing; empty rows without --observe-timing)."""
    b, a = before.get("measured") or {}, after.get("measured") or {}
    key = ("op", "bucket", "m_bucket", "n", "k")
    prev = {tuple(r[f] for f in key): r for r in b.get("ops", [])}
    rows = []
    for r in a.get("ops", []):
        p = prev.get(tuple(r[f] for f in key), {})
        d = {f: r[f] for f in key}
        d["total_ms"] = r["total_ms"] - p.get("total_ms", 0.0)
        d["samples"] = r["samples"] - p.get("samples", 0)
        if d["samples"] > 0:
            d["mean_us"] = 1e3 * d["total_ms"] / d["samples"]
            rows.append(d)
    rows.sort(key=lambda r: -r["total_ms"])
    b_steps, a_steps = b.get("sampled_steps") or {}, a.get("sampled_steps") or {}
    return {"source": a.get("source"), "rows": rows,
            "sampled_steps": {k: a_steps.get(k, 0) - b_steps.get(k, 0) for k in ("eager", "graph")}}


def _diff_kernels(before: dict, after: dict) -> dict[str, dict[str, int]]:
    prev = before.get("kernels") or {}
    out: dict[str, dict[str, int]] = {}
    for op, buckets in (after.get("kernels") or {}).items():
        for bucket, n in buckets.items():
            d = n - (prev.get(op, {}).get(bucket) or 0)
            if d > 0:
                out.setdefault(op, {})[bucket] = d
    return out


def _diff_dispatch(before: dict, after: dict) -> dict[str, dict[str, Any]]:
    """Per op: path, rule, configured/eligible/executed/calls summed over buckets, and fallback reasons."""
    prev = (before or {}).get("ops", {})
    out = {}
    for op, entry in (after or {}).get("ops", {}).items():
        p = prev.get(op, {})
        row = {"path": entry.get("path"), "rule": entry.get("rule")}
        for key in ("configured", "eligible", "executed", "calls"):
            row[key] = (sum(c[key] for c in entry.get("buckets", {}).values())
                        - sum(c[key] for c in p.get("buckets", {}).values()))
        row["fallback_reasons"] = {r: n - p.get("fallback_reasons", {}).get(r, 0)
                                   for r, n in entry.get("fallback_reasons", {}).items()
                                   if n - p.get("fallback_reasons", {}).get(r, 0) > 0}
        out[op] = row
    return out


async def before_load(session: aiohttp.ClientSession, base_url: str, model: str, args: Any) -> dict[str, Any]:
    """The gate's first pass (and --save-gate), then the record before the load. Returns the state for after_load."""
    from ladle.bench import gate

    state: dict[str, Any] = {"spec": gate.parse_gate(args.gate), "gate_before": None, "before": None}
    if state["spec"] is not None:
        state["gate_before"] = await gate.run_once(session, base_url, model, state["spec"], args.gate_data,
                                                   args.gate_max_tokens)
    if args.save_gate:
        run = state["gate_before"] if (state["spec"] or {}).get("kind") == "reference" else \
            await gate.run_once(session, base_url, model, {"kind": "reference"}, None)
        gate.save(args.save_gate, run)
        print(f"saved the gate reference {args.save_gate}")
    if args.report:
        state["before"] = await collect(session, base_url)
    return state


async def after_load(session: aiohttp.ClientSession, base_url: str, model: str, args: Any,
                     state: dict[str, Any]) -> None:
    """The record after the load, then the gate's second pass."""
    from ladle.bench import gate

    if args.report:
        state["after"] = await collect(session, base_url, HISTORY_STEPS)
    if state["spec"] is not None:
        after = await gate.run_once(session, base_url, model, state["spec"], args.gate_data, args.gate_max_tokens)
        state["gate"] = gate.verdict(state["spec"], state["gate_before"], after)


def finish(args: Any, state: dict[str, Any], result: dict[str, Any]) -> None:
    """Put the gate verdict (without the per-question runs) into result["ladle"]["gate"]; write --report DIR."""
    verdict = state.get("gate")
    if verdict is not None:
        result.setdefault("ladle", {})["gate"] = {k: v for k, v in verdict.items() if k not in ("before", "after")}
        print(f"correctness gate {'PASSED' if verdict['passed'] else 'FAILED'}: {verdict['summary']}")
    if args.report:
        from ladle.bench.bottleneck_report import write_report

        rec = diff(state["before"] or {}, state.get("after") or {})
        path = write_report(args.report, rec, result, verdict)
        result.setdefault("ladle", {})["report"] = path
        print(f"wrote {path}")
