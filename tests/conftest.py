"""Root test configuration (minimal; owned by the kernels area, see docs/TEAM_PLAN.md).

Without CUDA, Triton kernels run under Triton's CPU interpreter. The interpreter is chosen when a kernel module is
*imported* (at `@triton.jit` decoration), and CI runs `pytest tests` in one process, so the switch must be set here,
before any test module imports ladle.kernels. With CUDA present nothing changes.
"""

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is someone else's failure
        return False


HAS_CUDA = _cuda_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` when CUDA is unavailable."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
