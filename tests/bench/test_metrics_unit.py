"""calculate_metrics against hand-computed values on synthetic per-request records (no timing jitter)."""

from __future__ import annotations

import pytest

from ladle.bench.metrics import calculate_metrics, parse_goodput, percentile_key
from ladle.bench.request import RequestOutput


def _out(start, ttft, itl, n, ok=True, prompt_len=10):
    return RequestOutput(success=ok, start_time=start, ttft=ttft, itl=list(itl), latency=ttft + sum(itl),
                         output_tokens=n, prompt_len=prompt_len)


def test_formulas_match_hand_computation():
    outs = [
        _out(0.0, 0.100, [0.05] * 4, 5),            # TPOT (0.3-0.1)/4 = 0.05
        _out(0.5, 0.050, [0.08] * 3, 8),            # 3 chunks after the first carry 7 tokens: TPOT 0.24/7
        _out(1.0, 0.150, [], 1),                    # single token: no TPOT sample, TPOT 0 for goodput
        _out(1.2, 0.0, [], 0, ok=False),            # a failure contributes nothing
    ]
    m, lens = calculate_metrics(outs, 2.0, [50, 99], parse_goodput(["ttft:120", "tpot:40"]))
    assert lens == [5, 8, 1, 0]
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 14
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(7.0)
    assert m["total_token_throughput"] == pytest.approx(22.0)
    # good: request 2 only (req 1: TPOT 50 > 40; req 3: TTFT 150 > 120)
    assert m["request_goodput"] == pytest.approx(0.5)
    assert m["mean_ttft_ms"] == pytest.approx(100.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    tpots = [50.0, 240 / 7]
    assert m["mean_tpot_ms"] == pytest.approx(sum(tpots) / 2)
    assert m["p99_tpot_ms"] == pytest.approx(tpots[1] + 0.99 * (tpots[0] - tpots[1]))
    itls = [50.0] * 4 + [80.0] * 3
    assert m["mean_itl_ms"] == pytest.approx(sum(itls) / 7)
    assert m["median_itl_ms"] == pytest.approx(50.0)
    e2el = [300.0, 290.0, 150.0]
    mean = sum(e2el) / 3
    assert m["mean_e2el_ms"] == pytest.approx(mean)
    assert m["std_e2el_ms"] == pytest.approx((sum((x - mean) ** 2 for x in e2el) / 3) ** 0.5)  # population std
    # requests [0,0.3) [0.5,0.79) [1.0,1.15): never overlap
    assert m["max_concurrent_requests"] == 1
    # second 0 holds 5 + 4 chunk timestamps (0.55, 0.63, 0.71, 0.79 are all < 1)
    assert m["max_output_tokens_per_s"] == 9.0


def test_no_goodput_is_null_and_missing_usage_uses_counter():
    o = _out(0.0, 0.1, [0.1], 0)
    o.generated_text = "a b c"
    m, lens = calculate_metrics([o], 1.0, [99], {}, count_tokens=lambda t: len(t.split()))
    assert m["request_goodput"] is None and lens == [3]
    m, lens = calculate_metrics([o], 1.0, [99], {})
    assert lens == [1]  # vLLM counts 1 without a tokenizer


def test_peak_concurrency_sweep_line():
    outs = [_out(0.0, 0.1, [0.9], 2), _out(0.5, 0.1, [0.9], 2), _out(1.0, 0.1, [0.1], 2)]
    m, _ = calculate_metrics(outs, 2.0, [99], {})
    assert m["max_concurrent_requests"] == 2  # [0,1) and [0.5,1.5) overlap; the third starts as the first ends


def test_goodput_and_percentile_names():
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError):
        parse_goodput(["ttft=5"])
