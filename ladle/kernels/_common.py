"""Helpers shared by the kernel launchers: where Triton may run, and cache-shape checks."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ladle.config import env_flag


def interpreting() -> bool:
    """True when Triton runs under its CPU interpreter (TRITON_INTERPRET=1; set by tests/conftest.py on CPU CI)."""
    return env_flag("TRITON_INTERPRET", "0") not in ("", "0")


_CPU_INTERPRETER_ALLOWED = [True]


@contextlib.contextmanager
def cpu_interpreter(allowed: bool = True) -> Iterator[None]:
    """Inside this block, CPU tensors may (allowed=True) or may not (False) run Triton kernels under
    TRITON_INTERPRET=1. Default outside any block: allowed. tests/conftest.py sets TRITON_INTERPRET=1 for the
    whole CPU pytest process, so CPU code that wants the fast torch references (e.g. a whole-model CPU test) can
    wrap itself in `cpu_interpreter(False)`; the runner's attn_backend="torch" on CPU already avoids kernels."""
    _CPU_INTERPRETER_ALLOWED.append(allowed)
    try:
        yield
    finally:
        _CPU_INTERPRETER_ALLOWED.pop()


def triton_ok(*tensors: torch.Tensor) -> Optional[str]:
    """Device part of every Triton eligibility rule: all tensors on one CUDA device, or all on the CPU while the
    Triton interpreter is on and allowed (`cpu_interpreter`). Returns None when eligible, else the reason."""
    devices = {t.device.type for t in tensors}
    if devices == {"cuda"}:
        return None
    if devices == {"cpu"} and interpreting() and _CPU_INTERPRETER_ALLOWED[-1]:
        return None
    return f"device {sorted(devices)} (needs cuda, or cpu with TRITON_INTERPRET=1 and cpu_interpreter allowed)"


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Assert the fixed KV layout: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, K and V alike."""
    assert key_cache.dim() == 4, f"key_cache must be [num_blocks, block_size, Hkv, D], got {tuple(key_cache.shape)}"
    assert key_cache.shape == value_cache.shape, f"K {tuple(key_cache.shape)} != V {tuple(value_cache.shape)}"
    assert key_cache.dtype == value_cache.dtype
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "KV caches must be contiguous"
