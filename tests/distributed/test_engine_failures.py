"""The engine side of the failure model without processes: a runner error fails the step's requests and the engine
goes on; a fatal one (a dead rank, ladle/runner/executor.py WorkerDied) stops the loop; health follows the runner."""

from __future__ import annotations

import pytest

from ladle.core.outputs import FINISH_ERROR
from ladle.core.sampling_params import SamplingParams
from ladle.runner.executor import WorkerDied

from engine.helpers import make_bundle, tiny_model


class _FlakyRunner:
    """Wraps a ModelRunner: raises `error` once on the next execute (or, with asynchronous scheduling, the next
    `raise_in` of launch / wait), reports `healthy`."""

    def __init__(self, runner, error, raise_in="launch"):
        self.runner, self.error, self.healthy, self.stopped = runner, error, True, False
        self.num_blocks, self.raise_in = runner.num_blocks, raise_in

    def _maybe_raise(self, where: str) -> None:
        if self.error is not None and where in ("execute", self.raise_in):
            error, self.error = self.error, None
            raise error

    def execute(self, scheduler_output):
        self._maybe_raise("execute")
        return self.runner.execute(scheduler_output)

    def launch(self, scheduler_output):
        self._maybe_raise("launch")
        return self.runner.launch(scheduler_output)

    def wait(self, handle):
        self._maybe_raise("wait")
        return self.runner.wait(handle)

    def is_healthy(self):
        return self.healthy

    def shutdown(self):
        self.stopped = True


def _core(error, async_scheduling=False, raise_in="launch"):
    bundle = make_bundle(tiny_model(), async_scheduling=async_scheduling)
    core = bundle.core
    core.runner = _FlakyRunner(core.runner, error, raise_in)
    core.add_request(core.make_request("a", [3, 4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0)))
    return core


def test_rank_error_fails_the_step_and_the_engine_goes_on():
    core = _core(RuntimeError("rank 1: ValueError: boom"))
    outs = core.step()
    assert [o.finish_reason for o in outs] == [FINISH_ERROR] and core.is_healthy()
    core.add_request(core.make_request("b", [3, 4, 5], SamplingParams(max_tokens=2, temperature=0.0)))
    while core.has_unfinished_requests():
        outs = core.step()
    assert outs[-1].finish_reason != FINISH_ERROR


def test_dead_rank_is_fatal_and_health_follows_the_runner():
    core = _core(WorkerDied("tensor-parallel rank 1 (pid 1) exited with code -9"))
    with pytest.raises(WorkerDied):
        core.step()
    core.runner.healthy = False
    assert not core.is_healthy()
    core.shutdown()
    assert core.runner.stopped


@pytest.mark.parametrize("raise_in", ["launch", "wait"])
def test_under_async_scheduling_a_rank_error_fails_the_step_and_a_dead_rank_is_fatal(raise_in):
    """The same rules when the engine drives launch / wait (the TP executor raises from either)."""
    core = _core(RuntimeError("rank 1: ValueError: boom"), async_scheduling=True, raise_in=raise_in)
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert [o.finish_reason for o in outs if o.finished] == [FINISH_ERROR] and core.is_healthy()
    core.add_request(core.make_request("b", [3, 4, 5], SamplingParams(max_tokens=2, temperature=0.0)))
    while core.has_unfinished_requests():
        outs = core.step() or outs
    assert outs[-1].finish_reason not in (None, FINISH_ERROR)
    core = _core(WorkerDied("tensor-parallel rank 1 (pid 1) exited with code -9"), async_scheduling=True,
                 raise_in=raise_in)
    with pytest.raises(WorkerDied):
        while core.has_unfinished_requests():
            core.step()
