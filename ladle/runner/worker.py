"""One tensor-parallel rank: a worker process that owns a ModelRunner over this rank's model shard.

`worker_main` is the process target (ladle/runner/executor.py starts one per rank with multiprocessing spawn):
set the worker environment (ladle/distributed WORKER_ENV), join the group, build the shard
(`load_model(..., tp=TPShard(rank, world, expert_parallel))`) and its ModelRunner, report
("ready", RankInfo), then serve the pipe: each message is one pickled SchedulerOutput (None = stop); the reply is
("ok", RunnerOutput from rank 0, None from the others) or ("error", "rank r: Type: message"). A startup failure is
reported as ("startup_error", traceback text) so the console shows that rank's own message.

A worker dies with its parent: the kernel's parent-death signal (Linux prctl PR_SET_PDEATHSIG) and a watchdog
thread that sees the parent pid change; a closed pipe ends the loop too.
"""

from __future__ import annotations

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
from typing import Any

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


def die_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Make this process exit when `parent_pid` goes away (PDEATHSIG on Linux, plus a polling thread)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="ladle-parent-watch", daemon=True).start()


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
    """Execute the SchedulerOutputs that arrive on `conn` until None or a closed pipe."""
    while True:
        try:
            scheduler_output = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if scheduler_output is None:
            return
        try:
            out = runner.execute(scheduler_output)
            conn.send(("ok", out if rank == 0 else None))
        except Exception as exc:  # noqa: BLE001 — the engine fails this step's requests
            conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
