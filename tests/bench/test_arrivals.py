"""Request arrival schedule (vLLM's get_request): gamma gaps, rescaled so the last arrival lands at N / rate."""

from __future__ import annotations

import numpy as np
import pytest

from ladle.bench.serve import arrival_offsets


def test_inf_rate_sends_everything_at_once():
    assert arrival_offsets(5, float("inf"), 1.0, 0) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_gaps(burstiness):
    n, rate = 4000, 20.0
    t = np.array(arrival_offsets(n, rate, burstiness, seed=1))
    assert t[-1] == pytest.approx(n / rate)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    # Gamma(k, theta): coefficient of variation 1/sqrt(k) (Poisson at k = 1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.06)
    assert arrival_offsets(n, rate, burstiness, seed=1) == t.tolist()


def test_infinite_burstiness_is_constant():
    assert arrival_offsets(4, 2.0, float("inf"), 0) == pytest.approx([0.5, 1.0, 1.5, 2.0])
