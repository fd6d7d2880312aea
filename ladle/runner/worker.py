"""One tensor-parallel rank: a worker process that owns a ModelRunner over this rank's model shard.

`worker_main` is the process target (ladle/runner/executor.py starts one per rank with multiprocessing spawn):
set the worker environment (ladle/distributed WORKER_ENV), join the group, build the shard
(`load_model(..., tp=TPShard(rank, world, expert_parallel))`) and its ModelRunner, report
("ready", RankInfo), then serve the pipe (None = stop). Every message is (kind, seq, ...) and every reply is
(phase, seq, "ok", payload) or (phase, seq, "error", "rank r: Type: message"), the payload a RunnerOutput from
rank 0 and None from the others (`MultiprocExecutor._collect` takes them):
- synchronous steps (`MultiprocExecutor.execute`): ("execute", seq, SchedulerOutput) runs the step on this rank's
  ModelRunner and answers ("executed", seq, ...);
- asynchronous scheduling (`MultiprocExecutor.launch` / `wait`): ("launch", seq, SchedulerOutput) is launched and
  acknowledged ("launched", seq, "ok" | "error", None | message); then the step launched before it, if any, is
  waited for and answered ("result", seq, ...). ("drain", seq) answers the step in flight without launching one.
  Every rank samples identically (same seeds, same logits after the collectives), so each fills the next step's
  placeholders from its own sampled ids.
A startup failure is reported as ("startup_error", traceback text) so the console shows that rank's own message.

A worker dies with its parent: the kernel's parent-death signal (Linux prctl PR_SET_PDEATHSIG) and a watchdog
thread that sees the parent pid change; a closed pipe ends the loop too. It ignores SIGINT (Ctrl-C reaches the whole
process group; the engine decides).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ladle.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
from ladle.distributed.parallel_state import apply_worker_env, destroy_tensor_parallel, init_tensor_parallel

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs, picklable: the resolved component configs, the model source
    (ladle.models.loader.ModelSource), EOS ids, its place in the group and the rendezvous address."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    runner_config: RunnerConfig
    source: Any
    eos_token_ids: tuple[int, ...]
    rank: int
    world_size: int
    expert_parallel: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int = 0


@dataclass(frozen=True)
class RankInfo:
    """What a rank reports once ready: its weight bytes, KV blocks (already the minimum over ranks) and pid."""

    rank: int
    pid: int
    weight_bytes: int
    num_blocks: int


def die_with_parent(parent_pid: int, poll_s: float = 0.5, death_signal: int = signal.SIGKILL,
                    before_exit: Optional[Callable[[], None]] = None) -> None:
    """Make this process exit when `parent_pid` goes away: the kernel sends `death_signal` at the parent's death
    (PDEATHSIG on Linux), and a thread polling every `poll_s` seconds calls `before_exit` (if given), then exits with
    status 1. A process with cleanup to do passes a signal it handles (the engine core: SIGTERM, a stop)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, death_signal)
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                try:
                    if before_exit is not None:
                        before_exit()
                finally:
                    os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="ladle-parent-watch", daemon=True).start()


@contextlib.contextmanager
def main_module_left_alone(enabled: bool = True):
    """While a "spawn" child starts (a tensor-parallel rank, the engine-core process): hide `__main__`'s `__spec__`
    and `__file__`, which multiprocessing reads (in the parent, at Process.start) to decide whether the child
    imports the main module, so a user's script without an `if __name__ == "__main__":` guard is not re-run there;
    restored right after. The child's target must not live in `__main__`."""
    main = sys.modules.get("__main__")
    if not enabled or main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def build_rank_runner(spec: WorkerSpec):
    """Join the group and build this rank's ModelRunner; returns (runner, RankInfo)."""
    from ladle.models.loader import load_model
    from ladle.models.weights import TPShard
    from ladle.runner.model_runner import _DTYPES, ModelRunner

    mc = spec.model_config
    device = torch.device(mc.device)
    if device.type == "cuda":
        device = torch.device("cuda", spec.rank)
        torch.cuda.set_device(device)
        mc = dataclasses.replace(mc, device=str(device))
    else:  # CPU ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    init_tensor_parallel(spec.rank, spec.world_size, spec.master_addr, spec.master_port, device.type)
    model = load_model(mc, spec.source, _DTYPES[mc.dtype], device,
                       TPShard(spec.rank, spec.world_size, spec.expert_parallel))
    runner = ModelRunner(mc, spec.cache_config, spec.scheduler_config, spec.runner_config, model, spec.eos_token_ids)
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    return runner, RankInfo(spec.rank, os.getpid(), weights, runner.num_blocks)


def worker_main(spec: WorkerSpec, conn, parent_pid: int) -> None:
    """Process target of one rank (module doc for the messages)."""
    # Ctrl-C reaches the whole process group: the engine decides (the offline LLM aborts the call and generates
    # again on these ranks; `ladle serve` stops them with its shutdown), as the engine-core process does
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    apply_worker_env()
    try:
        runner, info = build_rank_runner(spec)
    except BaseException:  # noqa: BLE001 — reported to the engine, which names the rank on the console
        conn.send(("startup_error", traceback.format_exc()))
        sys.exit(1)
    conn.send(("ready", info))
    try:
        serve(runner, spec.rank, conn)
    finally:
        destroy_tensor_parallel()


def serve(runner, rank: int, conn) -> None:
    """Serve the messages that arrive on `conn` until None or a closed pipe (module doc for the protocol)."""
    in_flight = None  # asynchronous scheduling: (seq, LaunchedStep) launched and not yet answered
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "execute":
            _answer(conn, rank, "executed", message[1], runner.execute, message[2])
        else:
            in_flight = _serve_async(runner, rank, conn, message, in_flight)


def _answer(conn, rank: int, phase: str, seq: int, call, arg, share: bool = True) -> tuple[bool, Any]:
    """Run `call(arg)` and answer (phase, seq, "ok", its value on rank 0 when `share`, else None) or, when it raises
    (the engine fails that step's requests), (phase, seq, "error", "rank r: Type: message"). Returns (whether it
    succeeded, its value or None)."""
    try:
        value = call(arg)
        conn.send((phase, seq, "ok", value if share and rank == 0 else None))
        return True, value
    except Exception as exc:  # noqa: BLE001 — reported to the engine, the rank serves on
        conn.send((phase, seq, "error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        return False, None


def _serve_async(runner, rank: int, conn, message: tuple, in_flight):
    """One asynchronous-scheduling message: ("launch", seq, SchedulerOutput) launches the step and acknowledges it
    (so the engine learns of a launch failure at once, as with one rank), THEN waits for the step launched before it
    (the overlap: step N+1 is queued before this rank blocks on step N) and answers for that one; ("drain", seq)
    only waits for and answers the step in flight. Returns the step now in flight (seq, LaunchedStep) or None."""
    kind, seq = message[0], message[1]
    launched = None
    if kind == "launch":
        ok, step = _answer(conn, rank, "launched", seq, runner.launch, message[2], share=False)
        launched = (seq, step) if ok else None
    if in_flight is not None:  # a failed wait fails that step's requests (and the one after it)
        _answer(conn, rank, "result", in_flight[0], runner.wait, in_flight[1])
    return launched
