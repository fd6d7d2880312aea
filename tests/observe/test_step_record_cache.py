"""The per-step record computes the (num_tokens, num_sampled)-only parts of a step once per pair (StepObserver.
_step_constants): every recorded step must still equal the plan's formulas evaluated on that step alone."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from ladle.core.outputs import ScheduledChunk, SchedulerOutput
from ladle.core.scheduler import SchedulerStats
from ladle.observe import shapes, steps
from ladle.observe.plan import (GemmGroup, ModelPlan, MoEGroup, StepBatch, roofline_seconds, step_bytes,
                                step_gemm_shapes)


def _random_plan(rng: random.Random) -> ModelPlan:
    h, layers, act = rng.choice([64, 96, 128]), rng.randint(2, 6), rng.choice([2, 4])
    gemms = tuple(GemmGroup(name, rng.randint(8, 300), h, layers, rng.randint(1, 10**6))
                  for name in ("qkv_proj", "o_proj", "gate_up_proj")) + (
        GemmGroup("moe_router", 8, h, layers - 1, 8 * h * 4), GemmGroup("lm_head", 512, h, 1, 512 * h * act, "sampled"))
    moe = MoEGroup(layers - 1, 8, 2, h, rng.randint(8, 64), rng.randint(1000, 10**5), shared_folded=rng.random() < 0.5)
    return ModelPlan(gemms, moe, rng.randint(0, 10**4), h, layers, act, kv_bytes_per_token=rng.randint(64, 4096),
                     index_k_bytes_per_token=rng.randint(0, 512), tp_size=rng.choice([1, 2, 4]))


def _random_step(rng: random.Random, shapes_seen: list) -> list[ScheduledChunk]:
    """Decode-like batches that repeat (a cache hit) and fresh mixed prefill/decode ones (a miss)."""
    if shapes_seen and rng.random() < 0.6:
        num_reqs, prefill = rng.choice(shapes_seen)
    else:
        num_reqs, prefill = rng.randint(1, 40), rng.random() < 0.4
        shapes_seen.append((num_reqs, prefill))
    chunks = []
    for i in range(num_reqs):
        n = rng.randint(2, 50) if prefill and i == 0 else 1
        chunks.append(ScheduledChunk(f"r{i}", [rng.randint(3, 500) for _ in range(n)], rng.randint(0, 9000), [1],
                                     sample=not (prefill and i == 0 and rng.random() < 0.5),
                                     prompt_logprob_positions=rng.choice([0, 0, 0, 3])))
    return chunks


def _modeled(plan: ModelPlan, m: int, n: int, k: int, launches: int, bw, rate):
    """The docstring's model, written out here as the reference: weight + input + output bytes vs 2MNK FLOPs."""
    if not (bw and rate):
        return 0.0
    return launches * max((n * k + m * k + m * n) * plan.act_bytes / bw, 2.0 * m * n * k / rate)


@pytest.mark.parametrize("seed", [random.randrange(2**31) for _ in range(3)])
def test_every_recorded_step_equals_the_plan_formulas(seed):
    rng = random.Random(seed)
    obs = steps.StepObserver()
    core = SimpleNamespace(runner=SimpleNamespace(runner_config=None, device="cpu"),
                           scheduler=SimpleNamespace(get_stats=lambda: SchedulerStats(), requests={}))
    obs.end(core, SchedulerOutput(chunks=[ScheduledChunk("r", [1], 0, [1], True)]), obs.begin())  # attaches: no plan
    shapes.reset()
    expected_shapes: dict = {}
    seen: list = []
    for phase in range(3):  # new plan and rates each phase: nothing computed for the old ones may be reused
        obs.plan = _random_plan(rng)
        bw, rate = [(None, None), (rng.uniform(1e11, 5e12), rng.uniform(1e13, 1e15))][phase % 2]
        obs.rates = {"copy_bytes_per_s": bw, "gemm_flop_per_s": rate, "source": "test"}
        for _ in range(25):
            chunks = _random_step(rng, seen)
            obs.end(core, SchedulerOutput(chunks=chunks), obs.begin())
            seq_lens = [c.start_position + len(c.token_ids) for c in chunks]
            batch = StepBatch(sum(len(c.token_ids) for c in chunks),
                              sum(c.sample + c.prompt_logprob_positions for c in chunks), seq_lens)
            planes = step_bytes(obs.plan, batch)
            rec = obs.snapshot(last=1)["history"][0]
            assert rec["bytes"] == planes and list(rec["bytes"]["persistent"]) == list(planes["persistent"])
            assert rec["context_tokens"] == sum(seq_lens) and rec["num_tokens"] == batch.num_tokens
            roof = roofline_seconds(planes, bw, rate)
            assert rec["roofline_ms"] == (None if roof is None else pytest.approx(roof * 1e3, rel=1e-12))
            for op, m, n, k, launches in step_gemm_shapes(obs.plan, batch):
                row = expected_shapes.setdefault((op, shapes.m_bucket(m), n, k), [0, 0, 0.0, 0.0])
                row[0] += launches
                row[1] += m
                row[2] += _modeled(obs.plan, m, n, k, launches, bw, rate)
                row[3] += 2.0 * m * n * k * launches
    got = {(op, r["m_bucket"], r["n"], r["k"]): [r["launches"], r["tokens"], (r["modeled_ms"] or 0.0) / 1e3, r["flops"]]
           for op, rows in shapes.snapshot()["gemm"].items() for r in rows}
    assert got.keys() == expected_shapes.keys()
    for key, want in expected_shapes.items():
        assert got[key][:2] == want[:2] and got[key][2:] == pytest.approx(want[2:], rel=1e-9), key
