"""One tensor-parallel group per engine: torch.distributed with NCCL on CUDA and gloo on CPU.

Every rank is one worker process (ladle/runner/executor.py starts them); `init_tensor_parallel` joins the default
process group over TCP at `master_addr:master_port` (the executor picks a free port on 127.0.0.1). The layer kit
calls the two collectives below through `ladle.layers.linear.all_reduce_across_ranks` and
`ParallelLMHead.compute_logits`; with one rank (no group) both are the identity.

Every worker's environment gets `WORKER_ENV` before CUDA or NCCL initialise: NVLink SHARP (NVLS) multicast and the
symmetric-memory / NVSHMEM multicast paths stay off (the lent machines do not support multicast objects).
Each collective leaves a dispatch record (op "all_reduce" / "all_gather", path = the backend that ran).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ladle.observe import dispatch

WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_STATE: dict = {"world_size": 1, "rank": 0, "backend": None}


def apply_worker_env() -> None:
    """Set WORKER_ENV in this process's environment (call before the first CUDA / NCCL use)."""
    os.environ.update(WORKER_ENV)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it; a race with another binder is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_tensor_parallel(rank: int, world_size: int, master_addr: str, master_port: int, device_type: str,
                         timeout_s: float = 600.0) -> None:
    """Join the tensor-parallel group as `rank` of `world_size` (nccl when device_type is "cuda", else gloo).
    On CUDA the caller has already selected its device (torch.cuda.set_device(rank)). Raises RuntimeError when
    the rendezvous fails within `timeout_s`."""
    apply_worker_env()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if world_size > 1:
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    _STATE.update(world_size=world_size, rank=rank, backend=backend)


def destroy_tensor_parallel() -> None:
    """Leave the group (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.update(world_size=1, rank=0, backend=None)


def tp_world_size() -> int:
    """Ranks in this process's tensor-parallel group (1 when none was joined)."""
    return int(_STATE["world_size"])


def _check_group(tp_size: Optional[int], op: str) -> None:
    if tp_size is not None and tp_size != _STATE["world_size"]:
        raise RuntimeError(f"cannot {op}: a layer built for tp_size {tp_size} runs in a tensor-parallel group of "
                           f"{_STATE['world_size']} ranks (init_tensor_parallel was not called in this process?)")


def tensor_model_parallel_all_reduce(x: torch.Tensor, tp_size: Optional[int] = None) -> torch.Tensor:
    """Sum of `x` over the ranks (in place on `x`, which is returned): [*] any dtype the backend reduces.
    Identity with one rank. `tp_size`: what the caller was built for (checked against the group)."""
    _check_group(tp_size, "all-reduce")
    if _STATE["world_size"] == 1:
        return x
    dispatch.record("all_reduce", dispatch.tokens_bucket(x.shape[0]), configured=True, eligible=True, executed=True)
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1, tp_size: Optional[int] = None) -> torch.Tensor:
    """Concatenation along `dim` of every rank's `x` (same shape on every rank), rank order. Identity with one
    rank."""
    _check_group(tp_size, "all-gather")
    world = _STATE["world_size"]
    if world == 1:
        return x
    dispatch.record("all_gather", dispatch.tokens_bucket(x.shape[0]), configured=True, eligible=True, executed=True)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


def all_reduce_min_int(value: int, device: "torch.device | str" = "cpu") -> int:
    """The minimum of an integer over the ranks (KV capacity agreement); `value` with one rank."""
    if _STATE["world_size"] == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
