"""The result dict (vLLM's `--save-result` field names and order, bench_methodology.md §1.7), the printed summary,
the file name, and ladle's own section under the top-level key "ladle".

Differences from vLLM, on purpose: the per-request arrays (input_lens, output_lens, ttfts, itls, start_times,
generated_texts, errors) are always kept (vLLM keeps them only with --save-detailed, which ladle accepts); no
`.pytorch.json` side file is written. The printed summary uses vLLM's lines and wording as of vLLM 0.33.0
(`vllm/benchmarks/serve.py`: e.g. "Total token throughput (tok/s):"; releases before mid-2025 printed "Total Token
throughput"), plus ladle's "Failures by kind:" line and agentic section.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from importlib import metadata
from typing import Any


from ladle.bench.metrics import calculate_metrics, parse_goodput, percentile_key, stats_ms, usage_prefix_hit_rate
from ladle.bench.request import RequestOutput
from ladle.bench.server_info import machine_info


def selected_metrics(args: argparse.Namespace) -> list[str]:
    return (args.percentile_metrics or "ttft,tpot,itl").split(",")


def selected_percentiles(args: argparse.Namespace) -> list[float]:
    return [float(p) for p in str(args.metric_percentiles).split(",")]


def build_result(
    args: argparse.Namespace,
    model_id: str,
    tokenizer_id: str | None,
    outputs: list[RequestOutput],
    dur_s: float,
    count_tokens: Callable[[str], int] | None,
) -> dict[str, Any]:
    pcts = selected_percentiles(args)
    agg, output_lens = calculate_metrics(outputs, dur_s, pcts, parse_goodput(args.goodput), count_tokens)
    res: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": args.num_prompts,
    }
    for item in args.metadata or []:
        k, _, v = item.partition("=")
        res[k.strip()] = v.strip()
    res["request_rate"] = args.request_rate if not math.isinf(args.request_rate) else "inf"
    res["burstiness"] = args.burstiness
    res["max_concurrency"] = args.max_concurrency
    res["duration"] = dur_s
    for k in ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
              "request_goodput", "output_throughput", "total_token_throughput"):
        res[k] = agg[k]
    res.update(
        input_lens=[o.prompt_len for o in outputs],
        output_lens=output_lens,
        ttfts=[o.ttft for o in outputs],
        itls=[o.itl for o in outputs],
        latencies=[o.latency for o in outputs],
        start_times=[o.start_time for o in outputs],
        queue_times=[o.client_queue_time for o in outputs],
        generated_texts=[o.generated_text for o in outputs],
        errors=[o.error for o in outputs],
        max_output_tokens_per_s=agg["max_output_tokens_per_s"],
        max_concurrent_requests=agg["max_concurrent_requests"],
        rtfx=0.0,
    )
    chosen = selected_metrics(args)
    for name in ("ttft", "tpot", "itl", "e2el"):
        if name in chosen:
            res.update({k: v for k, v in agg.items() if k.endswith(f"_{name}_ms")})
    if args.max_concurrency is not None:
        ok = [o for o in outputs if o.success]
        if "client_queue_time" in chosen:
            res.update(stats_ms([o.client_queue_time for o in ok], "client_queue_time", pcts))
        if "e2el_including_client_queue" in chosen and not math.isinf(args.request_rate):
            res.update(stats_ms([o.latency + o.client_queue_time for o in ok], "e2el_including_client_queue", pcts))
    return res


def _interactivity(tpot_stats: dict[str, float], pcts: list[float]) -> dict[str, float | None]:
    """InferenceX's interactivity, tok/s/user = 1000 / TPOT_ms, for the median and each percentile of TPOT, from
    `tpot_stats` = stats_ms(tpots, "tpot", pcts); None where the TPOT is 0 (no request had two tokens)."""
    keys = {"median": "median_tpot_ms", **{percentile_key(p): f"{percentile_key(p)}_tpot_ms" for p in pcts}}
    return {k: (1000 / tpot_stats[src] if tpot_stats[src] > 0 else None) for k, src in keys.items()}


def ladle_section(
    args: argparse.Namespace,
    argv: list[str] | None,
    outputs: list[RequestOutput],
    result: dict[str, Any],
    info: dict[str, Any],
    server: dict[str, Any],
    agentic_stats: dict[str, Any] | None,
) -> dict[str, Any]:
    try:
        version = metadata.version("ladle")
    except metadata.PackageNotFoundError:
        version = None
    ok = [o for o in outputs if o.success]
    chunks = sum(o.num_chunks for o in ok)
    num_gpus = getattr(args, "num_gpus", 1) or 1
    pcts = sorted(set(selected_percentiles(args)) | {90.0, 99.0})
    tpot_stats = stats_ms(_tpots(outputs, result["output_lens"]), "tpot", pcts)
    return {
        "ladle_version": version,
        "argv": argv,
        "machine": machine_info(),
        "server": server,
        "dataset": {"name": args.dataset_name, **{k: v for k, v in info.items() if k != "salt"}},
        "errors_by_kind": dict(Counter(o.error_kind or "unknown" for o in outputs if not o.success)),
        "num_chunks": chunks,
        "tokens_per_chunk": (sum(result["output_lens"]) / chunks) if chunks else None,
        "num_gpus": num_gpus,
        "total_token_throughput_per_gpu": result["total_token_throughput"] / num_gpus,
        "output_throughput_per_gpu": result["output_throughput"] / num_gpus,
        "interactivity_tok_s_user": _interactivity(tpot_stats, pcts),
        "tpot_percentiles_ms": {k.split("_")[0]: v for k, v in tpot_stats.items() if k.startswith("p")},
        "achieved_prefix_hit_rate_usage": usage_prefix_hit_rate(outputs),
        "agentic": agentic_stats,
    }


def _tpots(outputs: list[RequestOutput], output_lens: list[int]) -> list[float]:
    """TPOT in seconds of each successful request with more than one output token."""
    return [(o.latency - o.ttft) / (n - 1) for o, n in zip(outputs, output_lens) if o.success and n > 1]


def print_summary(args: argparse.Namespace, r: dict[str, Any]) -> None:
    line = "{:<40} {:<10}".format
    fline = "{:<40} {:<10.2f}".format
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(line("Successful requests:", r["completed"]))
    print(line("Failed requests:", r["failed"]))
    if r["ladle"]["errors_by_kind"]:
        print(line("Failures by kind:", json.dumps(r["ladle"]["errors_by_kind"])))
    if args.max_concurrency is not None:
        print(line("Maximum request concurrency:", args.max_concurrency))
    if args.request_rate != float("inf"):
        print(fline("Request rate configured (RPS):", args.request_rate))
    print(fline("Benchmark duration (s):", r["duration"]))
    print(line("Total input tokens:", r["total_input_tokens"]))
    print(line("Total generated tokens:", r["total_output_tokens"]))
    print(fline("Request throughput (req/s):", r["request_throughput"]))
    if r["request_goodput"] is not None:
        print(fline("Request goodput (req/s):", r["request_goodput"]))
    print(fline("Output token throughput (tok/s):", r["output_throughput"]))
    print(fline("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"]))
    print(fline("Peak concurrent requests:", r["max_concurrent_requests"]))
    print(fline("Total token throughput (tok/s):", r["total_token_throughput"]))
    headers = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
               "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency"),
               "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
               "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency")}
    for name in selected_metrics(args):
        if f"mean_{name}_ms" not in r or name not in headers:
            continue
        short, long = headers[name]
        print("{s:{c}^{n}}".format(s=long, n=50, c="-"))
        print(fline(f"Mean {short} (ms):", r[f"mean_{name}_ms"]))
        print(fline(f"Median {short} (ms):", r[f"median_{name}_ms"]))
        for p in selected_percentiles(args):
            key = percentile_key(p)
            print(fline(f"{key.upper()} {short} (ms):", r[f"{key}_{name}_ms"]))
    ag = r["ladle"].get("agentic")
    if ag:
        print("{s:{c}^{n}}".format(s="Agentic replay", n=50, c="-"))
        for k in ("num_sessions", "num_requests", "num_dropped_too_long", "theoretical_hit_rate_trace_block",
                  "theoretical_hit_rate_server_block", "achieved_hit_rate_usage", "achieved_hit_rate_metrics"):
            print(line(k + ":", "n/a" if ag.get(k) is None else (f"{ag[k]:.4f}" if isinstance(ag[k], float) else ag[k])))
    print("=" * 50)


def result_path(args: argparse.Namespace, model_id: str, date: str) -> str:
    """vLLM's default name `{label}-{rate}qps[-concurrency{C}]-{model}-{date}.json`, or --result-filename."""
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or f"{args.label or args.backend}-{args.request_rate}qps{conc}-{model_id.split('/')[-1]}-{date}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def save(args: argparse.Namespace, result: dict[str, Any], model_id: str) -> str:
    path = result_path(args, model_id, result["date"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, default=str)
    return path
