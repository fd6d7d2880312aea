"""`ladle bench serve`'s interactivity (tok/s/user = 1000 / TPOT ms) and usage-reported prefix hit rate."""

from __future__ import annotations

from ladle.bench.metrics import stats_ms, usage_prefix_hit_rate
from ladle.bench.report import _interactivity
from ladle.bench.request import RequestOutput


def test_interactivity_is_1000_over_tpot_percentiles():
    stats = stats_ms([0.010, 0.020, 0.030, 0.040], "tpot", [50.0, 90.0])  # seconds per token
    got = _interactivity(stats, [50.0, 90.0])
    assert abs(got["median"] - 1000 / 25.0) < 1e-9
    assert abs(got["p90"] - 1000 / stats["p90_tpot_ms"]) < 1e-9 and got["p90"] < got["median"]
    assert _interactivity(stats_ms([], "tpot", [90.0]), [90.0]) == {"median": None, "p90": None}


def test_usage_prefix_hit_rate_counts_reporting_successes_only():
    def out(prompt_len, cached, success=True):
        o = RequestOutput()
        o.prompt_len, o.cached_tokens, o.success = prompt_len, cached, success
        return o

    assert usage_prefix_hit_rate([out(100, 50), out(100, None), out(300, 0), out(100, 100, success=False)]) == 50 / 400
    assert usage_prefix_hit_rate([out(100, None)]) is None
