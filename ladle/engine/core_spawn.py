"""Starting and stopping the engine-core process (ARCHITECTURE.md "Processes"; the process side is
ladle/engine/core_process.py). Shared by the server's CoreProcessEngine (ladle/engine/core_client.py, asyncio) and the
offline LLM's CoreProcessDriver (ladle/engine/offline_core.py, blocking).

    spawn_core(engine_config) -> CoreProcess: two ZeroMQ sockets bound on ipc:// in a fresh temp dir (PUSH to the
    core, PULL from it), the core spawned with multiprocessing "spawn", blocked until its Ready (or its CoreDead:
    EngineError with the core's message). Nothing outlives a failed start.
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
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def spawn_core(engine_config: Any, startup_timeout_s: float = 3600.0,
               core_target: Optional[Callable[..., Any]] = None) -> CoreProcess:
    """Spawn the engine-core process and wait for its Ready. `core_target` replaces `run_engine_core` (same
    arguments: engine_config, input address, output address, parent pid): benchmarks put a fake core there.
    Raises EngineError when the build fails or the process exits first (nothing left running)."""
    ipc_dir = tempfile.mkdtemp(prefix="ladle-core-")
    zctx = zmq.Context()
    to_core, from_core = zctx.socket(zmq.PUSH), zctx.socket(zmq.PULL)
    to_core.setsockopt(zmq.SNDHWM, 0)
    to_core.setsockopt(zmq.LINGER, 0)
    to_core.bind(f"ipc://{ipc_dir}/in")
    from_core.bind(f"ipc://{ipc_dir}/out")
    if core_target is None:
        from ladle.engine.core_process import run_engine_core as core_target

    # daemon=False: the core starts tensor-parallel worker processes of its own (a daemon may not have children)
    proc = mp.get_context("spawn").Process(
        target=core_target, name="ladle-engine-core", daemon=False,
        args=(engine_config, f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out", os.getpid()))
    try:
        with main_module_left_alone(core_target.__module__ != "__main__"):
            proc.start()
        ready = _wait_ready(proc, from_core, startup_timeout_s)
    except BaseException:  # a failed build, a signal while loading: no core outlives this
        if proc.is_alive():
            proc.kill()
        if proc.pid is not None:
            proc.join(5)
        to_core.close(0)
        from_core.close(0)
        zctx.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)
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
