"""Starting and stopping the engine-core process (ARCHITECTURE.md "Processes"; the process side is
ladle/engine/core_process.py). Shared by the server's CoreProcessEngine (ladle/engine/core_client.py, asyncio) and the
offline LLM's CoreProcessDriver (ladle/engine/offline_core.py, blocking).

    spawn_core(engine_config) -> CoreProcess: two ZeroMQ sockets bound on ipc:// in a fresh temp dir (PUSH to the
    core, PULL from it), the core spawned with multiprocessing "spawn", blocked until its Ready (or its CoreDead:
    EngineError with the core's message). Nothing outlives a failed start.

The ipc dir (`<tmp>/ladle-core-*`: the sockets `in` and `out`, and `owners`: the pids of the API process and the core,
one per line) is removed by whichever side ends last: CoreProcess.close, the core on each of its exits, the core's
parent watch when the API process is gone. When both were killed, the next spawn_core removes it: a `ladle-core-*`
dir of this user whose `owners` names no live process. A dir without `owners` was not made by this code: kept.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import zmq

from ladle.engine import core_messages as msg
from ladle.engine.client import EngineError
from ladle.runner.worker import main_module_left_alone

IPC_DIR_PREFIX = "ladle-core-"
_OWNERS = "owners"


@dataclass
class CoreProcess:
    """A started engine core: the process, the ZeroMQ context and sockets, the ipc dir, the core's Ready."""

    proc: Any
    zctx: Any
    to_core: Any
    from_core: Any
    ipc_dir: str
    ready: msg.Ready

    def send(self, message: Any) -> None:
        """Non-blocking (SNDHWM 0: an unbounded queue)."""
        self.to_core.send(msg.encoder.encode(message), zmq.NOBLOCK)

    def join_or_kill(self, wait_s: float) -> None:
        """Ask the core to stop (if alive), wait up to `wait_s`, then kill it. Blocking."""
        if self.proc.is_alive():
            self.send(msg.Stop())
        self.proc.join(wait_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)

    def close(self) -> None:
        """Close the sockets and the context, remove the ipc dir. The process must be gone."""
        self.to_core.close(0)
        self.from_core.close(0)
        self.zctx.term()
        remove_ipc_dir(self.ipc_dir)


def spawn_core(engine_config: Any, startup_timeout_s: float = 3600.0,
               core_target: Optional[Callable[..., Any]] = None) -> CoreProcess:
    """Spawn the engine-core process and wait for its Ready. The core's arguments: engine_config, input address,
    output address, parent pid and the parent's logging setup (ladle/engine/core_process.logging_setup);
    `core_target` replaces `run_engine_core` with the same arguments (benchmarks put a fake core there). Removes
    stale ipc dirs first (module docstring).
    Raises EngineError when the build fails or the process exits first (nothing left running)."""
    remove_stale_ipc_dirs()
    ipc_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
    _write_owners(ipc_dir, [os.getpid()])
    zctx = zmq.Context()
    to_core, from_core = zctx.socket(zmq.PUSH), zctx.socket(zmq.PULL)
    to_core.setsockopt(zmq.SNDHWM, 0)
    to_core.setsockopt(zmq.LINGER, 0)
    to_core.bind(f"ipc://{ipc_dir}/in")
    from_core.bind(f"ipc://{ipc_dir}/out")
    from ladle.engine.core_process import logging_setup

    if core_target is None:
        from ladle.engine.core_process import run_engine_core as core_target

    # daemon=False: the core starts tensor-parallel worker processes of its own (a daemon may not have children)
    proc = mp.get_context("spawn").Process(
        target=core_target, name="ladle-engine-core", daemon=False,
        args=(engine_config, f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out", os.getpid(), logging_setup()))
    try:
        with main_module_left_alone(core_target.__module__ != "__main__"):
            proc.start()
        _write_owners(ipc_dir, [os.getpid(), proc.pid])
        ready = _wait_ready(proc, from_core, startup_timeout_s)
    except BaseException:  # a failed build, a signal while loading: no core outlives this
        if proc.is_alive():
            proc.kill()
        if proc.pid is not None:
            proc.join(5)
        to_core.close(0)
        from_core.close(0)
        zctx.term()
        remove_ipc_dir(ipc_dir)
        raise
    return CoreProcess(proc, zctx, to_core, from_core, ipc_dir, ready)


def _wait_ready(proc: Any, from_core: Any, timeout_s: float) -> msg.Ready:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if from_core.poll(200):
            message = msg.from_core_decoder.decode(from_core.recv())
            if isinstance(message, msg.Ready):
                return message
            if isinstance(message, msg.CoreDead):
                raise EngineError(message.message)
        elif not proc.is_alive():
            raise EngineError(f"the engine core process exited while starting (exit code {proc.exitcode})")
    raise EngineError(f"the engine core did not start within {timeout_s:.0f} s")


def remove_ipc_dir(ipc_dir: str) -> None:
    """Remove one core's ipc dir (sockets and `owners`); nothing if it is gone already."""
    shutil.rmtree(ipc_dir, ignore_errors=True)


def remove_stale_ipc_dirs(tmp_dir: Optional[str] = None) -> list[str]:
    """Remove the `ladle-core-*` dirs under `tmp_dir` (default: tempfile's) that are this user's and whose `owners`
    file names only dead processes (os.kill(pid, 0); a pid in use by another user counts as alive). Returns the
    removed paths."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(tmp_dir) if n.startswith(IPC_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(tmp_dir, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, _OWNERS)) as f:
                pids = [int(line) for line in f.read().split()]
        except (OSError, ValueError):  # not a dir, no owners file (not made by spawn_core): kept
            continue
        if pids and not any(_alive(pid) for pid in pids):
            remove_ipc_dir(path)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        return True
    return True


def _write_owners(ipc_dir: str, pids: list[int]) -> None:
    """Replace `owners` atomically (a concurrent remove_stale_ipc_dirs never reads half a file)."""
    tmp = os.path.join(ipc_dir, _OWNERS + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(f"{pid}\n" for pid in pids))
    os.replace(tmp, os.path.join(ipc_dir, _OWNERS))
