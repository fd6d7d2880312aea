"""Asynchronous scheduling through the tensor-parallel executor without processes: `MultiprocExecutor.launch` /
`wait` talking to `worker.serve` loops in threads (one per fake rank, each with a recording fake runner). A rank
launches step N+1 before it waits for step N; a wait with no later launch drains; replies of steps the engine never
waits for are dropped; a launch error fails that launch only, a wait error that wait only; a rank error while
another rank stays silent stops the group (RankDiverged); a rank that exits is fatal (WorkerDied)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from ladle.runner.executor import RankDiverged, WorkerDied
from ladle.runner.worker import serve

from distributed.test_executor_divergence import _executor


class _FakeRunner:
    """Records execute/launch/wait; `fail_execute` / `fail_launch` / `fail_wait`: step names whose execute / launch /
    wait raise; a step named in `hang` blocks its execute or launch for good (a rank held in a collective; the
    thread is a daemon)."""

    def __init__(self, calls: list, fail_execute=(), fail_launch=(), fail_wait=(), hang=()) -> None:
        self.calls, self.fail_launch, self.fail_wait, self.hang = calls, set(fail_launch), set(fail_wait), set(hang)
        self.fail_execute = set(fail_execute)
        self.release = threading.Event()  # never set

    def execute(self, so):
        self.calls.append(("execute", so))
        if so in self.hang:
            self.release.wait()
        if so in self.fail_execute:
            raise ValueError(f"execute {so}")
        return f"tokens of {so}"

    def launch(self, so):
        self.calls.append(("launch", so))
        if so in self.hang:
            self.release.wait()
        if so in self.fail_launch:
            raise ValueError(f"launch {so}")
        return so

    def wait(self, step):
        self.calls.append(("wait", step))
        if step in self.fail_wait:
            raise ValueError(f"wait {step}")
        return f"tokens of {step}"


def _group(world: int, diverged_timeout_s: float = 5.0, **faults):
    """An executor whose ranks are serve() threads; `faults` maps rank -> _FakeRunner kwargs."""
    ex, ends = _executor(world, diverged_timeout_s)
    calls = [[] for _ in range(world)]
    runners = [_FakeRunner(calls[r], **faults.get(f"rank{r}", {})) for r in range(world)]
    threads = [threading.Thread(target=serve, args=(runners[r], r, ends[r]), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    return ex, calls, runners, threads


def _stop(ex, threads) -> None:
    for conn in ex._conns:
        conn.send_bytes(b"\x80\x04N.")  # pickle of None: stop
    for t in threads:
        t.join(5)


def test_each_rank_launches_the_next_step_before_waiting_for_the_previous():
    ex, calls, _, threads = _group(2)
    h1 = ex.launch("s1")
    h2 = ex.launch("s2")
    assert ex.wait(h1) == "tokens of s1"
    h3 = ex.launch("s3")
    assert ex.wait(h2) == "tokens of s2"
    assert ex.wait(h3) == "tokens of s3"  # nothing launched after it: the ranks are told to drain
    _stop(ex, threads)
    expected = [("launch", "s1"), ("launch", "s2"), ("wait", "s1"), ("launch", "s3"), ("wait", "s2"), ("wait", "s3")]
    assert calls[0] == expected and calls[1] == expected


def test_replies_of_steps_never_waited_for_are_dropped():
    ex, calls, _, threads = _group(2)
    h1 = ex.launch("s1")
    ex.launch("finished ids only")  # the engine never waits for a step without chunks
    assert ex.wait(h1) == "tokens of s1"
    h3 = ex.launch("s3")
    assert ex.wait(h3) == "tokens of s3"
    h4 = ex.launch("s4")
    h5 = ex.launch("s5")
    assert ex.wait(h4) == "tokens of s4"  # the engine may drop h5 (waiting for h4 failed) and launch again
    h6 = ex.launch("s6")
    assert ex.wait(h6) == "tokens of s6"
    _stop(ex, threads)
    assert all(not inbox for inbox in ex._inboxes), ex._inboxes
    assert ("wait", "s5") in calls[1] and h5 == h4 + 1


def test_a_launch_error_fails_that_launch_and_the_pipeline_goes_on():
    ex, calls, _, threads = _group(2, rank1=dict(fail_launch={"bad"}))
    h1 = ex.launch("s1")
    with pytest.raises(RuntimeError, match="rank 1: ValueError: launch bad") as e:
        ex.launch("bad")
    assert not isinstance(e.value, WorkerDied)
    assert ex.wait(h1) == "tokens of s1"  # answered on the failed launch's message: no drain needed
    h3 = ex.launch("s3")
    assert ex.wait(h3) == "tokens of s3"
    _stop(ex, threads)
    assert calls[1] == [("launch", "s1"), ("launch", "bad"), ("wait", "s1"), ("launch", "s3"), ("wait", "s3")]


def test_a_wait_error_fails_that_wait_only():
    ex, _, _, threads = _group(2, rank0=dict(fail_wait={"s1"}))
    h1 = ex.launch("s1")
    h2 = ex.launch("s2")
    with pytest.raises(RuntimeError, match="rank 0: ValueError: wait s1"):
        ex.wait(h1)
    assert ex.wait(h2) == "tokens of s2"
    _stop(ex, threads)


def test_a_launch_error_while_a_rank_stays_in_a_collective_stops_the_group():
    ex, _, _, _ = _group(2, 0.3, rank0=dict(hang={"s2"}), rank1=dict(fail_launch={"s2"}))
    h1 = ex.launch("s1")
    t0 = time.monotonic()
    with pytest.raises(RankDiverged, match=r"rank 1: ValueError: launch s2; rank\(s\) \[0\] did not answer") as e:
        ex.launch("s2")
    assert 0.25 < time.monotonic() - t0 < 5.0 and h1 == 1
    assert e.value.fatal and ex._closed and all(p.stopped for p in ex._procs)


def test_a_rank_that_exits_while_the_engine_waits_is_fatal():
    ex, ranks = _executor(2, 5.0)  # hand-driven ranks: rank 1 acknowledges the launch, then its process exits
    for r in ranks:
        r.send(("launched", 1, "ok", None))
    h1 = ex.launch("s1")
    ranks[0].send(("result", 1, "ok", "tokens"))
    ex._procs[1].exit()
    with pytest.raises(WorkerDied, match="rank 1"):
        ex.wait(h1)


def test_a_closed_pipe_mid_pipeline_is_fatal():
    ex, ranks = _executor(2, 5.0)
    for r in ranks:
        r.send(("launched", 1, "ok", None))
    h1 = ex.launch("s1")
    ranks[1].close()
    ex._procs[1].exit()
    with pytest.raises(WorkerDied, match="rank 1"):
        ex.wait(h1)


def test_synchronous_steps_are_tagged_and_collected_like_launches():
    """execute goes through the same reply loop: rank 0's tokens, a rank's error fails that step only, a launch after
    it (the same sequence numbers) is answered as usual and nothing is left in the inboxes."""
    ex, calls, _, threads = _group(2, rank1=dict(fail_execute={"bad"}))
    assert ex.execute("s1") == "tokens of s1"
    with pytest.raises(RuntimeError, match="rank 1: ValueError: execute bad") as e:
        ex.execute("bad")
    assert not isinstance(e.value, WorkerDied)
    assert ex.execute("s3") == "tokens of s3"
    h4 = ex.launch("s4")
    assert ex.wait(h4) == "tokens of s4" and h4 == 4
    _stop(ex, threads)
    assert all(not inbox for inbox in ex._inboxes), ex._inboxes
    assert calls[0] == calls[1] == [("execute", "s1"), ("execute", "bad"), ("execute", "s3"), ("launch", "s4"),
                                    ("wait", "s4")]


def test_a_synchronous_error_while_a_rank_stays_in_a_collective_stops_the_group():
    ex, _, _, _ = _group(2, 0.3, rank0=dict(hang={"s1"}), rank1=dict(fail_execute={"s1"}))
    t0 = time.monotonic()
    with pytest.raises(RankDiverged, match=r"rank 1: ValueError: execute s1; rank\(s\) \[0\] did not answer") as e:
        ex.execute("s1")
    assert 0.25 < time.monotonic() - t0 < 5.0
    assert e.value.fatal and ex._closed and all(p.stopped for p in ex._procs)


def test_serve_answers_a_drain_with_nothing_in_flight_by_nothing():
    parent, child = mp.Pipe()
    calls: list = []
    t = threading.Thread(target=serve, args=(_FakeRunner(calls), 0, child), daemon=True)
    t.start()
    import pickle

    parent.send_bytes(pickle.dumps(("drain", 7)))
    parent.send_bytes(pickle.dumps(("launch", 8, "s8")))
    assert parent.recv() == ("launched", 8, "ok", None)
    parent.send_bytes(pickle.dumps(("drain", 8)))
    assert parent.recv() == ("result", 8, "ok", "tokens of s8")
    parent.send_bytes(pickle.dumps(None))
    t.join(5)
    assert not parent.poll() and calls == [("launch", "s8"), ("wait", "s8")]
