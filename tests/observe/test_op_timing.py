"""Measured time per op and bucket (ladle/observe/op_timing.py) on a tiny real engine, on the CPU (host clock):
the rows exist for the ops a Llama step runs, their sample counts equal the launches of the sampled steps, their
times are positive and fit inside the sampled steps' host time; timing off records nothing; a step that replays a
CUDA graph records no per-op row, only cuda_graph_replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient

from helpers import make_bundle, tiny_model  # tests/engine/helpers.py

from ladle.core.sampling_params import SamplingParams
from ladle.engine.llm import LLM
from ladle.observe import dispatch, op_timing, shapes, steps
from ladle.runner.cuda_graph import CudaGraphRunner
from ladle.server.debug import router

GEMMS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
KERNELS = ("rmsnorm", "rope", "kv_store")
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [40, 41, 42]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def _llm(model, interval: int, timing: bool = True, async_scheduling: bool = False) -> LLM:
    for record in (steps.OBSERVER, shapes, dispatch, op_timing.TIMER):
        record.reset()
    llm = LLM(bundle=make_bundle(model, enable_prefix_caching=False, async_scheduling=async_scheduling))
    runner = llm.core.runner  # the resolver turns --observe-timing off on CPU; the host-clock stand-in is tested here
    runner.runner_config = dataclasses.replace(runner.runner_config, observe_timing=timing,
                                               observe_timing_interval=interval)
    steps.OBSERVER.attach(llm.core)  # the plan and the timing interval, before the first step
    return llm


def _run(llm, max_tokens: int = 4) -> None:
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def _rows(snap: dict) -> dict:
    out: dict = {}
    for r in snap["ops"]:
        out.setdefault(r["op"], []).append(r)
    return out


def test_every_step_sampled_counts_every_launch(model):
    llm = _llm(model, interval=1)
    _run(llm)
    snap = op_timing.TIMER.snapshot()
    hist = steps.OBSERVER.snapshot()["history"]
    rows = _rows(snap)
    assert snap["source"] == "host_clock" and snap["sampled_steps"] == {"eager": len(hist), "graph": 0}
    assert set(GEMMS + KERNELS) <= set(rows), sorted(rows)
    assert all(r["total_ms"] > 0 and r["samples"] > 0 and r["mean_us"] > 0 for r in snap["ops"])
    launches = {op: sum(c["calls"] for c in e["buckets"].values()) for op, e in dispatch.snapshot()["ops"].items()}
    for op in KERNELS:  # one sample per launch: every step was sampled
        assert sum(r["samples"] for r in rows[op]) == launches[op]
    by_key = {(r["op"], r["m_bucket"], r["n"], r["k"]): r["samples"] for r in snap["ops"] if r["n"] is not None}
    gemm = shapes.snapshot()["gemm"]
    for op in GEMMS:  # GEMM rows are keyed as the shape histogram's rows
        for row in gemm[op]:
            assert by_key[(op, row["m_bucket"], row["n"], row["k"])] == row["launches"]
    sampled_ms = sum(h["host_ms"] for h in hist)
    assert 0 < sum(r["total_ms"] for r in snap["ops"]) <= sampled_ms


def test_interval_samples_only_every_nth_step(model):
    llm = _llm(model, interval=2)
    _run(llm, max_tokens=6)
    snap = op_timing.TIMER.snapshot()
    hist = steps.OBSERVER.snapshot()["history"]
    qkv = sum(r["samples"] for r in snap["ops"] if r["op"] == "qkv_proj")
    eager = snap["sampled_steps"]["eager"]
    assert eager in (len(hist) // 2, (len(hist) + 1) // 2) and eager < len(hist) and qkv == 2 * eager  # 2 layers


def test_timing_off_records_nothing(model, monkeypatch):
    llm = _llm(model, interval=1, timing=False)
    started = []
    monkeypatch.setattr(op_timing.TIMER, "start_step", lambda cuda: started.append(cuda))
    _run(llm)
    assert started == [] and not op_timing.TIMER.active
    snap = op_timing.TIMER.snapshot()
    assert snap["ops"] == [] and snap["sampled_steps"] == {"eager": 0, "graph": 0}
    assert steps.OBSERVER.snapshot(last=0)["timing"]["op_timing"] is None


class _EagerGraph:
    """Stands in for a captured torch.cuda.CUDAGraph on the CPU: replay() runs the bucket's forward eagerly into
    the static output (a real replay runs no Python, so no op hook fires; here they do and must be ignored)."""

    def __init__(self, graphs: CudaGraphRunner, bucket: int) -> None:
        self.graphs, self.bucket = graphs, bucket

    def replay(self) -> None:
        self.graphs.outputs[self.bucket].copy_(self.graphs._forward(self.bucket))


def _cpu_graph_runner(runner, buckets=(1, 2)) -> CudaGraphRunner:
    """The real CudaGraphRunner.run / can_run over CPU static buffers and _EagerGraph stand-ins."""
    g = CudaGraphRunner.__new__(CudaGraphRunner)
    n, width = max(buckets), 16
    g.model, g.kv_caches, g.block_size, g.max_blocks = runner.model, runner.kv_caches, runner.block_size, width
    g.device, g.backends, g.buckets, g._pool = torch.device("cpu"), runner.backends, list(buckets), None
    g.input_ids, g.positions = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    g.slot_mapping = torch.full((n,), -1, dtype=torch.int64)
    g.seq_lens, g.context_lens = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    g.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
    g.block_table = torch.zeros(n, width, dtype=torch.int32)
    hidden = runner.model.model.embed_tokens.weight.shape[1]
    g.outputs = {b: torch.zeros(b, hidden) for b in buckets}
    g.graphs = {b: _EagerGraph(g, b) for b in buckets}
    return g


def test_graph_steps_record_no_per_op_rows(model):
    llm = _llm(model, interval=1)
    runner = llm.core.runner
    runner.graphs = _cpu_graph_runner(runner)
    before = dispatch.snapshot()["ops"].get("cuda_graph_decode", {}).get("buckets", {})
    _run(llm, max_tokens=4)  # one prefill step (eager), then 3 decode steps replayed
    snap = op_timing.TIMER.snapshot()
    replays = sum(c["executed"] for c in dispatch.snapshot()["ops"]["cuda_graph_decode"]["buckets"].values())
    assert replays - sum(c["executed"] for c in before.values()) == 3
    assert snap["sampled_steps"] == {"eager": 1, "graph": 3}
    rows = _rows(snap)
    assert [r["samples"] for r in rows[op_timing.GRAPH_OP]] == [3] and rows[op_timing.GRAPH_OP][0]["bucket"] == "T<=2"
    assert sum(r["samples"] for r in rows["qkv_proj"]) == 2  # the prefill step's 2 layers only
    assert sum(r["samples"] for r in rows["kv_store"]) == 2


def test_debug_shapes_serves_the_measured_rows(model):
    llm = _llm(model, interval=1)
    _run(llm)
    app = FastAPI()
    app.include_router(router)
    with TestClient(app) as c:
        body = c.get("/debug/shapes").json()
    m = body["measured"]
    assert m["source"] == "host_clock" and m["sampled_steps"]["eager"] > 0
    assert set(m["ops"][0]) == {"op", "bucket", "m_bucket", "n", "k", "total_ms", "samples", "mean_us"}
    assert [r["total_ms"] for r in m["ops"]] == sorted((r["total_ms"] for r in m["ops"]), reverse=True)


def test_a_sampled_step_that_never_finishes_is_dropped(model):
    """begin() of a sampled step, then no end() (the step scheduled nothing): the next, unsampled, step stops the
    timer and nothing of the first is recorded."""
    llm = _llm(model, interval=2)
    obs = steps.OBSERVER
    while not obs.begin()[2]:  # advance to a sampled begin()
        pass
    assert op_timing.TIMER.active
    assert not obs.begin()[2] and not op_timing.TIMER.active
    _run(llm, max_tokens=1)  # one prefill step: sampled or not, it is recorded whole
    snap = op_timing.TIMER.snapshot()
    assert snap["sampled_steps"]["eager"] in (0, 1)
    assert sum(r["samples"] for r in snap["ops"] if r["op"] == "qkv_proj") == 2 * snap["sampled_steps"]["eager"]


@pytest.mark.gpu
def test_cuda_events_time_launches_and_skip_graph_capture():
    """On CUDA: a timed launch gives a positive event-pair time, read without a synchronize of its own (the rows
    appear once the events completed); nothing is timed while a CUDA graph is being captured."""
    timer = op_timing.TIMER
    timer.reset()
    x = torch.randn(512, 512, device="cuda")
    matmul = op_timing.timed_op(lambda a: a @ a)
    timer.start_step(True)
    matmul(x)
    timer.finish_step(None)
    torch.cuda.synchronize()
    snap = timer.snapshot()
    assert snap["source"] == "cuda_events" and snap["sampled_steps"] == {"eager": 1, "graph": 0}
    assert [r["samples"] for r in snap["ops"]] == [1] and snap["ops"][0]["total_ms"] > 0
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        matmul(x)  # warm-up outside the timer
    torch.cuda.current_stream().wait_stream(stream)
    timer.start_step(True)
    with torch.cuda.graph(graph):
        matmul(x)
    timer.finish_step(None)
    torch.cuda.synchronize()
    assert [r["samples"] for r in timer.snapshot()["ops"]] == [1]


def test_async_scheduling_times_the_same_launches(model):
    """--async-scheduling launches step N+1 before step N's results are read: each sampled step's brackets close at
    its launch (steps.launched), so the rows and their sample counts equal the synchronous run's."""
    counts = []
    for async_scheduling in (False, True):
        llm = _llm(model, interval=1, async_scheduling=async_scheduling)
        _run(llm)
        snap = op_timing.TIMER.snapshot()
        counts.append(({(r["op"], r["bucket"]): r["samples"] for r in snap["ops"]}, snap["sampled_steps"]))
        assert all(r["total_ms"] > 0 for r in snap["ops"])
    assert counts[0] == counts[1] and "attn_prefill" in {op for op, _ in counts[1][0]}
