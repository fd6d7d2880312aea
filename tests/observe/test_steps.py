"""The per-step record on a tiny real engine: /debug/steps and /debug/shapes return the documented JSON, the
histogram's tokens equal the tokens the engine scheduled, and recording a step stays cheap."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from helpers import make_bundle, tiny_model  # tests/engine/helpers.py

from ladle.core.outputs import NewRequestData, ScheduledChunk, SchedulerOutput
from ladle.core.sampling_params import SamplingParams
from ladle.core.scheduler import SchedulerStats
from ladle.engine.llm import LLM
from ladle.observe import dispatch, shapes, steps
from ladle.server.debug import router

STEP_KEYS = {"t", "host_ms", "gpu_ms", "num_reqs", "num_tokens", "prefill_tokens", "num_sampled", "context_tokens",
             "waiting", "running", "kv_usage", "preempted", "admitted", "admission_delay_ms", "bytes", "flops",
             "roofline_ms"}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    app.include_router(router)
    with TestClient(app) as c:
        yield c


def _generate(model, prompts, max_tokens, **kw):
    steps.OBSERVER.reset()
    shapes.reset()
    dispatch.reset()
    llm = LLM(bundle=make_bundle(model, **kw))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return llm


def test_debug_steps_and_shapes_json(model, client):
    prompts = [[11, 12, 13, 14, 15, 16, 17], [40, 41, 42]]
    _generate(model, prompts, max_tokens=5, enable_prefix_caching=False)
    fed = sum(len(p) for p in prompts) + len(prompts) * (5 - 1)  # prompts, then every sampled token but the last
    body = client.get("/debug/steps?last=1000").json()
    assert set(body) == {"totals", "by_batch", "history", "rates", "timing", "plan", "open_files"}
    assert body["totals"]["tokens"] == fed and body["totals"]["sampled"] == 2 * 5
    assert body["totals"]["admitted"] == 2 and body["totals"]["preemptions"] == 0
    assert sum(h["num_tokens"] for h in body["history"]) == fed
    assert all(set(h) == STEP_KEYS for h in body["history"])
    first = body["history"][0]
    assert first["gpu_ms"] is None and first["host_ms"] > 0 and first["roofline_ms"] is None  # CPU, no rates
    assert set(first["bytes"]) == {"compute", "persistent", "communication", "flops"}
    assert first["bytes"]["persistent"]["kv_written"] == first["num_tokens"] * body["plan"]["kv_bytes_per_token"]
    assert body["rates"]["source"] == "absent" and body["timing"]["gpu_timing"] is False
    assert body["open_files"]["soft"] is None or body["open_files"]["soft"] > 0
    assert sum(r["steps"] for r in body["by_batch"].values()) == body["totals"]["steps"]
    assert len(client.get("/debug/steps?last=2").json()["history"]) == 2
    sh = client.get("/debug/shapes").json()
    assert set(sh) == {"gemm", "kernels", "tokens_scheduled", "measured"} and sh["tokens_scheduled"] == fed
    for op in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert sum(r["tokens"] for r in sh["gemm"][op]) == fed
        assert sum(r["launches"] for r in sh["gemm"][op]) == 2 * body["totals"]["steps"]  # 2 layers
    assert sum(r["tokens"] for r in sh["gemm"]["lm_head"]) == 2 * 5
    assert sh["kernels"]["kv_store"] == {b: c["calls"] for b, c in dispatch.snapshot()["ops"]["kv_store"]["buckets"].items()}


def test_preemptions_and_queue_are_recorded(model):
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    llm = _generate(model, prompts, max_tokens=24, num_blocks=12, max_num_batched_tokens=32, max_model_len=128)
    body = steps.OBSERVER.snapshot()
    assert body["totals"]["preemptions"] == llm.core.get_stats().num_preemptions_total > 0
    assert max(h["waiting"] for h in body["history"]) > 0 and max(h["kv_usage"] for h in body["history"]) > 0.5


def _fake_core(plan_model, num_reqs: int):
    runner = SimpleNamespace(model=plan_model, kv_cache_specs=plan_model.kv_cache_specs(), dtype=None,
                             runner_config=None, device="cpu")
    stats = SchedulerStats(num_running=num_reqs)
    scheduler = SimpleNamespace(get_stats=lambda: stats, requests={})
    return SimpleNamespace(runner=runner, scheduler=scheduler)


def test_recording_cost_is_small(model):
    """One decode step of 64 requests: begin + end costs well under a millisecond (about 30-60 us here)."""
    obs = steps.StepObserver(history=256)
    core = _fake_core(model, 64)
    out = SchedulerOutput(chunks=[ScheduledChunk(f"r{i}", [1], 100 + i, [1, 2], True) for i in range(64)],
                          new_requests=[NewRequestData("r0", [1], [], SamplingParams())])
    obs.end(core, out, obs.begin())  # plans once
    n = 300
    t0 = time.perf_counter()
    for _ in range(n):
        obs.end(core, out, obs.begin())
    per_step = (time.perf_counter() - t0) / n
    assert obs.snapshot(last=0)["totals"]["steps"] == n + 1
    assert per_step < 1e-3, f"recording a step costs {per_step * 1e6:.0f} us"


def test_build_app_serves_the_debug_endpoints():
    from fake_engine import FakeEngineClient  # tests/server/fake_engine.py

    from ladle.server.api import build_app

    with TestClient(build_app(FakeEngineClient())) as c:
        for path in ("/debug/shapes", "/debug/steps", "/debug/dispatch"):
            r = c.get(path)
            assert r.status_code == 200 and isinstance(r.json(), dict), path


def test_a_recording_failure_never_reaches_the_engine():
    obs = steps.StepObserver()
    broken = SimpleNamespace(runner=None, scheduler=None)  # no get_stats: recording raises inside
    obs.end(broken, SchedulerOutput(), obs.begin())
    assert obs.snapshot()["totals"] == {}


def test_kv_bytes_follow_the_allocated_cache_dtype(model):
    """KV bytes per token use the allocated cache element size (1 byte: an fp8 cache); activations the model dtype."""
    import torch

    core = _fake_core(model, 1)
    core.runner.kv_caches = [SimpleNamespace(key_cache=torch.zeros(1, dtype=torch.uint8))]
    obs = steps.StepObserver()
    obs.end(core, SchedulerOutput(chunks=[ScheduledChunk("r", [1], 0, [1], True)]), obs.begin())
    assert obs.plan.kv_bytes_per_token == 2 * (2 * 2 * 16) * 1 and obs.plan.act_bytes == 4
