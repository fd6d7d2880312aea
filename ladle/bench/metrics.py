"""Aggregate metrics over a run, exactly as vLLM's `calculate_metrics` defines them.

Source: vLLM's `calculate_metrics` in `vllm/benchmarks/serve.py`.

- TPOT per request = (E2EL - TTFT) / (output_tokens - 1), only for output_tokens > 1; single-token outputs are
  excluded from the TPOT statistics and count as TPOT = 0 for goodput.
- ITL statistics are over the flattened list of chunk gaps of all successful requests (chunk-weighted).
- TTFT, TPOT, E2EL statistics are over successful requests.
- request/output/total-token throughput = completed / dur, sum(output) / dur, (sum(input) + sum(output)) / dur;
  only successful requests contribute input tokens.
- goodput: a completed request is good when each named metric (ttft, tpot, e2el in ms) is <= its SLO.
- mean/median/std/percentiles with numpy (`np.percentile`, linear interpolation); empty lists give 0, as in vLLM.
- max_output_tokens_per_s: token timestamps start + TTFT + cumulative ITLs, one per *chunk*, in 1 s buckets.
- max_concurrent_requests: exact sweep line over [start, start + latency), departures before arrivals on ties.
All times in the returned dict are milliseconds where the key ends in `_ms`, else seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ladle.bench.request import RequestOutput

STAT_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0}. Raises ValueError on a bad name or value."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        try:
            name, value = pair.split(":")
            slos[name] = float(value)
        except ValueError as e:
            raise ValueError(f"bad --goodput pair {pair!r}: expected KEY:VALUE with VALUE in ms") from e
        if name not in GOODPUT_KEYS:
            raise ValueError(f"bad --goodput metric {name!r}: must be one of {GOODPUT_KEYS}")
        if slos[name] < 0:
            raise ValueError(f"bad --goodput value {pair!r}: must be non-negative")
    return slos


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def stats_ms(values_s: Sequence[float], name: str, percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pNN of `values_s` (seconds) in ms under vLLM's key names; an empty list gives zeros."""
    v = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64)
    out = {
        f"mean_{name}_ms": float(np.mean(v) * 1000),
        f"median_{name}_ms": float(np.median(v) * 1000),
        f"std_{name}_ms": float(np.std(v) * 1000),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(v, p) * 1000)
    return out


def usage_prefix_hit_rate(outputs: Sequence[RequestOutput]) -> float | None:
    """sum(usage.prompt_tokens_details.cached_tokens) / sum(prompt tokens) over successful requests that reported
    cached_tokens; None if the server never reported it (or no prompt tokens)."""
    rep = [o for o in outputs if o.success and o.cached_tokens is not None]
    total = sum(o.prompt_len for o in rep)
    return sum(o.cached_tokens or 0 for o in rep) / total if total else None


def _peaks(ok: list[RequestOutput]) -> tuple[float, int]:
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t1 = max(o.start_time + o.latency for o in ok)
    buckets = np.zeros(int(np.ceil(t1 - t0)) + 1)
    for o in ok:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for tt in times:
            b = int(tt - t0)
            if 0 <= b < len(buckets):
                buckets[b] += 1
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok])
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return float(buckets.max()), peak


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    dur_s: float,
    percentiles: Sequence[float],
    goodput_slos: dict[str, float],
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """Returns (vLLM's aggregate fields, per-request output lengths with 0 for failures).

    count_tokens: used for a successful request whose server sent no usage (vLLM re-tokenizes the generated text
    without special tokens; without a tokenizer it counts 1).
    """
    output_lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    e2els: list[float] = []
    itls: list[float] = []
    total_input = completed = 0
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        n = o.output_tokens
        if not n:
            n = count_tokens(o.generated_text) if count_tokens else 1
        output_lens.append(n)
        total_input += o.prompt_len
        tpot = 0.0
        if n > 1:
            tpot = (o.latency - o.ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(o.itl)
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    good = 0
    if goodput_slos:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        for i in range(completed):
            if all(per_metric[k][i] <= slo / 1000 for k, slo in goodput_slos.items()):
                good += 1
    ok = [o for o in outputs if o.success]
    peak_tok, peak_conc = _peaks(ok)
    total_output = sum(output_lens)
    result: dict[str, Any] = {
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / dur_s,
        "request_goodput": good / dur_s if goodput_slos else None,
        "output_throughput": total_output / dur_s,
        "total_token_throughput": (total_input + total_output) / dur_s,
        "max_output_tokens_per_s": peak_tok,
        "max_concurrent_requests": peak_conc,
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in STAT_METRICS:
        result.update(stats_ms(series[name], name, percentiles))
    return result, output_lens
