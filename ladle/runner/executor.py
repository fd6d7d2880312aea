"""The multiprocessing executor (`--distributed-executor-backend mp`): one worker process per tensor-parallel rank.

Same interface as a ModelRunner for the engine core: `execute(SchedulerOutput) -> RunnerOutput`, `num_blocks`, plus
`is_healthy()` and `shutdown()`. Each step's message (its kind, sequence number and SchedulerOutput; the protocol is
in ladle/runner/worker.py) is pickled once and the same bytes go down every rank's pipe (the broadcast); every rank
answers (phase, sequence number, "ok" | "error", payload), rank 0 with the sampled tokens; one loop, `_collect`, takes
the replies of every kind. A rank that raises makes `execute` raise RuntimeError naming the rank (the engine fails
that step's requests); a rank process that exits makes it raise WorkerDied (fatal: the engine loop stops, /health
turns 503). When one rank raises while others do not answer within `diverged_timeout_s`, those are held in a
collective the failed rank never joined: the group is stopped and RankDiverged (a WorkerDied, fatal) is raised
instead of hanging the engine. With one rank the engine keeps its ModelRunner in process and no executor exists.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import time
from multiprocessing.connection import wait
from typing import Optional

from ladle.distributed.parallel_state import WORKER_ENV, free_port
from ladle.runner.worker import RankInfo, WorkerSpec, main_module_left_alone, worker_main

logger = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """A rank's process exited. `fatal`: the engine must stop (its requests end with an error)."""

    fatal = True


class RankDiverged(WorkerDied):
    """A rank raised and others stayed inside a collective it never joined: the group cannot go on (fatal)."""


class MultiprocExecutor:
    """Start `spec.world_size` ranks (spawn) from `spec` (its rank field is replaced per process) and wait until
    all are ready. Raises RuntimeError with the failing rank's traceback when one cannot start."""

    _next_seq = 0  # the sequence number of the last step sent (execute or launch)
    _last_sent: Optional[int] = None  # the last launch message sent (the ranks answer its predecessor on it)
    _drain_sent = False  # a drain for `_last_sent` was sent
    _inbox: Optional[list[dict]] = None  # `_inboxes`

    def __init__(self, spec: WorkerSpec, startup_timeout_s: float = 1800.0, diverged_timeout_s: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.diverged_timeout_s = diverged_timeout_s
        os.environ.update(WORKER_ENV)  # inherited by the spawned ranks before they import anything
        spec = dataclasses.replace(spec, master_port=spec.master_port or free_port(spec.master_addr))
        self.world_size = spec.world_size
        self._procs, self._conns = [], []
        self._closed = False
        for rank in range(spec.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(dataclasses.replace(spec, rank=rank), child_end, os.getpid()),
                               name=f"ladle-tp-rank{rank}", daemon=True)
            with main_module_left_alone():  # an unguarded user script is not re-run in the rank
                proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        atexit.register(self.shutdown)
        try:
            self.ranks: list[RankInfo] = [self._ready(r, startup_timeout_s) for r in range(spec.world_size)]
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(info.num_blocks for info in self.ranks)
        block = spec.cache_config.block_size
        for info in self.ranks:
            logger.info("rank %d (pid %d): weights %.3f GiB (%d bytes), KV cache %d tokens (%d blocks; the pool is "
                        "the minimum over ranks, %d blocks)", info.rank, info.pid, info.weight_bytes / 2**30,
                        info.weight_bytes, info.num_blocks * block, info.num_blocks, self.num_blocks)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _ready(self, rank: int, timeout_s: float) -> RankInfo:
        kind, payload = self._recv(rank, timeout_s)
        if kind != "ready":
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{payload}")
        return payload

    def _recv(self, rank: int, timeout_s: float | None = None):
        """The next message of `rank`; WorkerDied when its process exits first (or TimeoutError)."""
        conn, proc = self._conns[rank], self._procs[rank]
        ready = wait([conn, proc.sentinel], timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"tensor-parallel rank {rank} did not answer within {timeout_s} s")
        if conn in ready:
            try:
                return conn.recv()
            except (EOFError, OSError):
                pass
        proc.join(1.0)
        raise WorkerDied(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def execute(self, scheduler_output):
        """Broadcast one step to every rank; return rank 0's RunnerOutput (module doc for the errors)."""
        seq = self._next_seq = self._next_seq + 1
        self._broadcast(("execute", seq, scheduler_output))
        replies = self._collect("executed", seq)
        self._raise_errors(replies)
        return replies[0][1]

    def _broadcast(self, message: tuple) -> None:
        """Pickle `message` once and send the bytes to every rank; WorkerDied when a rank's pipe is gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError):
                raise WorkerDied(f"tensor-parallel rank {rank} (pid {self._procs[rank].pid}) is gone") from None

    # ---- asynchronous scheduling -------------------------------------------------------------------

    def launch(self, scheduler_output) -> int:
        """Broadcast one step to be launched on every rank; returns its handle (the step's sequence number) once every
        rank has queued it. Each rank then waits for the step launched before it and sends its results (the overlap:
        step N+1 is queued before any rank blocks on step N). A rank's launch error raises RuntimeError (the engine
        fails this step's requests), like a failed `ModelRunner.launch`; dead and diverged ranks as in `execute`."""
        seq = self._next_seq = self._next_seq + 1
        self._broadcast(("launch", seq, scheduler_output))
        self._last_sent, self._drain_sent = seq, False  # the ranks answer for the previous step on this message
        self._raise_errors(self._collect("launched", seq))
        return seq

    def wait(self, handle: int):
        """Rank 0's RunnerOutput of the launched step `handle`. When no step was launched after it (the engine drains
        or finishes), the ranks are told to answer without launching one. Replies of earlier steps the engine
        dropped (steps with no chunks, the step after a failed one) are discarded. Errors as in `execute`."""
        if handle == self._last_sent and not self._drain_sent:
            self._broadcast(("drain", handle))
            self._drain_sent = True
        try:
            replies = self._collect("result", handle)
        finally:
            for inbox in self._inboxes:
                for key in [k for k in inbox if k[1] <= handle and k[0] == "result"]:
                    del inbox[key]
        self._raise_errors(replies)
        return replies[0][1]

    @staticmethod
    def _raise_errors(replies: list) -> None:
        errors = [payload for kind, payload in replies if kind == "error"]
        if errors:
            raise RuntimeError("; ".join(errors))

    @property
    def _inboxes(self) -> list[dict]:
        """Per rank, the replies read but not yet taken: {(phase, seq): (kind, payload)}."""
        if self._inbox is None:
            self._inbox = [{} for _ in range(self.world_size)]
        return self._inbox

    def _collect(self, phase: str, seq: int) -> list:
        """Every rank's (kind, payload) of reply (phase, seq), in rank order. Everything a rank has sent is read as
        it arrives (later messages are kept in its inbox). Once a rank has raised (an error of this or a later step),
        the others get `diverged_timeout_s` to answer; one that does not is held in a collective the failed rank
        never joined, so the group is stopped and RankDiverged raised (the engine fails its requests, /health 503).
        A rank whose process exits raises WorkerDied."""
        key, inboxes, deadline = (phase, seq), self._inboxes, None
        while True:
            for rank in range(self.world_size):
                while self._conns[rank].poll():
                    message = self._recv(rank, 0)
                    inboxes[rank][(message[0], message[1])] = message[2:]
            pending = [r for r in range(self.world_size) if key not in inboxes[r]]
            if not pending:
                return [inboxes[r].pop(key) for r in range(self.world_size)]
            errors = [v[1] for inbox in inboxes for k, v in inbox.items() if v[0] == "error" and k[1] >= seq]
            if errors and deadline is None:
                deadline = time.monotonic() + self.diverged_timeout_s
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                         timeout=timeout)
            if not ready:
                self._stop_diverged(errors, pending)
            for rank in pending:
                if self._procs[rank].sentinel in ready and not self._conns[rank].poll():
                    self._recv(rank, 0)  # raises WorkerDied

    def _stop_diverged(self, errors: list[str], stuck: list[int]) -> None:
        self.shutdown()
        raise RankDiverged(f"{'; '.join(errors)}; rank(s) {sorted(stuck)} did not answer within "
                           f"{self.diverged_timeout_s:g} s (held in a collective the failed rank never "
                           "joined): the tensor-parallel group is stopped")

    def is_healthy(self) -> bool:
        """Every rank's process is alive (cheap: checked on each /health)."""
        return not self._closed and all(p.is_alive() for p in self._procs)

    def shutdown(self) -> None:
        """Stop every rank (idempotent): ask, then terminate, then kill what is left."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self._conns:
            conn.close()
