"""Gated activations (plain torch).

SiLU-and-mul is the SwiGLU gate of Llama-family MLPs (Shazeer 2020, "GLU Variants Improve Transformer"):
    out = silu(gate) * up,   silu(x) = x * sigmoid(x)
with gate and up packed side by side in one tensor (the merged gate_up projection's output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] (gate first, then up), any float dtype -> [..., I] same dtype."""
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} is not even"
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
