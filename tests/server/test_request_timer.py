"""Per-request latency bookkeeping in the server: with n > 1 choices decoding side by side, ITL and TPOT are per
sequence (vLLM times each child), not per token summed over the choices."""

from __future__ import annotations

from ladle.engine.client import CompletionOutput, EngineStats, RequestOutput
from ladle.server.metrics import RequestTimer, ServerMetrics
from ladle.server.serving_common import PromptRun


class _Hist:
    def __init__(self):
        self.values = []

    def observe(self, v):
        self.values.append(v)


def test_n_choices_count_one_token_per_step():
    metrics = ServerMetrics(lambda: EngineStats(), "m")
    metrics.itl, metrics.tpot = _Hist(), _Hist()
    run = PromptRun(index=0, prompt_ids=[1, 2], prompt_text="", params=None, timer=RequestTimer(metrics))
    for step in range(4):  # 3 choices, one new token each per step
        outs = [CompletionOutput(index=i, token_ids_delta=[10 + step]) for i in range(3)]
        run.absorb(RequestOutput(request_id="r", prompt_token_ids=[1, 2], outputs=outs, finished=step == 3))
    assert run.timer.num_tokens == 4
    assert len(metrics.itl.values) == 3  # one gap per step after the first, not one per choice-token
    assert len(metrics.tpot.values) == 1  # observed once, by absorb() on the finished output


def test_repeated_observation_reads_like_one_observe_per_token():
    """A k-token output observes its ITL gap k times; observe_repeated does it in one bucket search and /metrics
    reads exactly as k separate observe() calls (sum, every bucket, count), on random gaps and counts."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from ladle.server.metrics import ITL_BUCKETS, observe_repeated

    rng = random.Random(7)
    registries = CollectorRegistry(), CollectorRegistry()
    one, many = (Histogram("itl", "d", ["m"], buckets=ITL_BUCKETS, registry=r).labels(m="x") for r in registries)
    for _ in range(2000):
        gap, k = rng.choice([rng.random() * 0.02, rng.random(), rng.random() * 200]), rng.randrange(1, 9)
        for _ in range(k):
            one.observe(gap)
        observe_repeated(many, gap, k)
    text = [[ln for ln in generate_latest(r).decode().splitlines() if "_created" not in ln] for r in registries]
    assert text[0] == text[1]
    assert any(ln.startswith("itl_count") and not ln.endswith(" 0.0") for ln in text[0])
