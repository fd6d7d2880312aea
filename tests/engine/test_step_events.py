"""The device-idle measurement of asynchronous scheduling (EngineCore.step_host_s["device_idle"]) and the CUDA
timing events it reads: recorded only where that one reader exists (the in-process runner with
--async-scheduling), never on a tensor-parallel rank. Split from test_async_scheduling.py (file size)."""

from __future__ import annotations

import pytest

from helpers import M3_ENGINE, m3_llm, make_bundle, tiny_model

from ladle.core.sampling_params import SamplingParams
from ladle.engine.llm import LLM

@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


class _FakeEvent:
    """A CUDA timing event stand-in: `t` is its device timestamp in ms."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, later: "_FakeEvent") -> float:
        return later.t - self.t


def test_device_idle_sums_the_gaps_between_steps_while_requests_are_unfinished(model):
    """step_host_s["device_idle"] adds, per completed step, the gap between the previous step's done event and this
    step's begin event; a gap after the engine ran out of requests is not counted. Fake events give each launch
    a device span [10 k, 10 k + 7] ms, so every gap between consecutive steps is 3 ms."""
    bundle = make_bundle(model, async_scheduling=True)
    core, runner = bundle.core, bundle.core.runner
    launches, offset = [], [0.0]
    real_launch = runner.launch

    def launch(so):
        step = real_launch(so)
        if so.chunks:
            k = len(launches)
            t = offset[0] + 10.0 * k
            step.begin_event, step.done_event = _FakeEvent(t), _FakeEvent(t + 7)
            launches.append(k)
        return step

    runner.launch = launch
    llm = LLM(bundle=bundle)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    first = len(launches)
    assert first >= 6 and core.step_host_s["device_idle"] == pytest.approx(3e-3 * (first - 1))
    offset[0] = 5000.0  # the engine sat idle for 5 s of device time: not counted
    llm.generate([[8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert core.step_host_s["device_idle"] == pytest.approx(3e-3 * (len(launches) - 2))


def test_device_idle_is_absent_where_nothing_measures_it(model):
    """Synchronous steps (and CPU steps, which have no CUDA events) do not measure the device's idle gaps: the phase
    is absent from step_host_s (and so from /metrics), not a 0 that reads as "no idle time"."""
    for async_scheduling in (False, True):  # on CPU the async handles carry no events either
        bundle = make_bundle(model, async_scheduling=async_scheduling)
        LLM(bundle=bundle).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert "device_idle" not in bundle.core.step_host_s and bundle.core.step_host_s["execute"] > 0


def test_step_events_are_recorded_only_where_the_engine_reads_them(tiny_m3_dir, monkeypatch):
    """The runner records its steps' two CUDA timing events only for their one reader, EngineCore's device_idle
    (asynchronous scheduling, the runner in process): build_engine asks for them with --async-scheduling only, and
    a tensor-parallel rank's runner never does. Counted through `_timing_event` (None on CPU, a recorded event on
    CUDA): a synchronous engine calls it never, an asynchronous one twice per model step."""
    from ladle.runner.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(ModelRunner, "_timing_event", lambda self: calls.append(self))
    for async_scheduling in (False, True):
        calls.clear()
        llm = m3_llm(tiny_m3_dir)(async_scheduling)
        assert llm.core.runner.record_step_events is async_scheduling
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(calls) == (2 * llm.core.num_steps if async_scheduling else 0)


def test_tensor_parallel_ranks_record_no_step_events(tiny_m3_dir, monkeypatch):
    """A rank's runner (runner/worker.py build_rank_runner) records no step events even with asynchronous
    scheduling: the engine sees only the executor's handles, never a rank's events."""
    import torch

    from ladle.engine.config_resolve import resolve_engine_config
    from ladle.engine.engine_factory import engine_config_from_kwargs
    from ladle.models.loader import resolve_model_source
    from ladle.models.registry import resolve_model_class
    from ladle.runner import worker

    config = engine_config_from_kwargs(tiny_m3_dir, device="cpu", async_scheduling=True, **M3_ENGINE)
    source = resolve_model_source(config.model)
    resolved = resolve_engine_config(config, source.hf_config, resolve_model_class(source.architectures))
    spec = worker.WorkerSpec(resolved.model, resolved.cache, resolved.scheduler, resolved.runner, source, (), 0, 1)
    monkeypatch.setattr(worker, "init_tensor_parallel", lambda *args: None)  # one rank, no group to join
    threads = torch.get_num_threads()
    try:
        runner, _ = worker.build_rank_runner(spec)
    finally:
        torch.set_num_threads(threads)  # a CPU rank takes its share of the cores
    assert resolved.scheduler.async_scheduling and runner.record_step_events is False
