"""The executor's reply collection (ladle/runner/executor.py) for synchronous steps, with fake ranks that answer
("executed", seq, kind, payload) by hand (the first step's seq is 1): replies are taken as they arrive, a
rank error with every rank answering fails the step (RuntimeError, not fatal), and a rank error while another rank
stays silent (held in a collective the failed rank never joined) stops the group with RankDiverged (fatal) after
`diverged_timeout_s` instead of hanging the engine."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from ladle.runner.executor import MultiprocExecutor, RankDiverged, WorkerDied


class _FakeProc:
    """Stands in for a rank's Process: `sentinel` becomes ready only when `exit()` is called."""

    def __init__(self) -> None:
        self._sentinel_r, self._sentinel_w = mp.Pipe(duplex=False)
        self.sentinel, self.pid, self.exitcode, self.stopped = self._sentinel_r, 0, None, False

    def exit(self) -> None:
        self.exitcode = -9
        self._sentinel_w.send(None)

    def is_alive(self) -> bool:
        return not self.stopped and self.exitcode is None

    def join(self, timeout=None) -> None:
        pass

    def terminate(self) -> None:
        self.stopped = True

    kill = terminate


def _executor(world_size: int, diverged_timeout_s: float):
    ex = object.__new__(MultiprocExecutor)  # no processes: the reply logic alone
    ex.world_size, ex.diverged_timeout_s, ex._closed = world_size, diverged_timeout_s, False
    ex._procs = [_FakeProc() for _ in range(world_size)]
    pairs = [mp.Pipe() for _ in range(world_size)]
    ex._conns = [parent for parent, _ in pairs]
    return ex, [child for _, child in pairs]


def test_replies_in_rank_order_whatever_their_arrival():
    ex, ranks = _executor(3, 5.0)
    ranks[2].send(("executed", 1, "ok", None))
    ranks[1].send(("executed", 1, "ok", None))
    ranks[0].send(("executed", 1, "ok", "rank 0's tokens"))
    assert ex.execute("step") == "rank 0's tokens"


def test_an_error_with_every_rank_answering_fails_the_step_only():
    ex, ranks = _executor(2, 5.0)
    ranks[1].send(("executed", 1, "error", "rank 1: ValueError: boom"))
    ranks[0].send(("executed", 1, "ok", "tokens"))
    with pytest.raises(RuntimeError, match="rank 1: ValueError: boom") as e:
        ex.execute("step")
    assert not isinstance(e.value, WorkerDied) and not ex._closed


def test_an_error_while_a_rank_stays_in_a_collective_stops_the_group():
    ex, ranks = _executor(2, 0.3)
    ranks[1].send(("executed", 1, "error", "rank 1: ValueError: boom"))  # rank 0 never answers: in an all-reduce
    t0 = time.monotonic()
    with pytest.raises(RankDiverged, match=r"rank 1: ValueError: boom; rank\(s\) \[0\] did not answer") as e:
        ex.execute("step")
    assert 0.25 < time.monotonic() - t0 < 5.0
    assert e.value.fatal and ex._closed and all(p.stopped for p in ex._procs)


def test_a_rank_that_exits_is_fatal():
    ex, ranks = _executor(2, 5.0)
    ranks[0].send(("executed", 1, "ok", "tokens"))
    ex._procs[1].exit()
    with pytest.raises(WorkerDied, match="rank 1"):
        ex.execute("step")
