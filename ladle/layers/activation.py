"""Gated activations on a packed [gate | up] projection output (the merged gate_up GEMM's result).

silu_and_mul: the SwiGLU gate of Llama-family MLPs (Shazeer 2020, "GLU Variants Improve Transformer"):
    out = silu(gate) * up,   silu(x) = x * sigmoid(x)
swigluoai_and_mul: MiniMax-M3's clamped SwiGLU (GPT-OSS style), whose one home is
`ladle.kernels.fused_moe.swigluoai_ref` (the fused MoE kernel computes it in its epilogue).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ladle.kernels.fused_moe import SWIGLU_ALPHA, SWIGLU_LIMIT, swigluoai_ref


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] (gate first, then up), any float dtype -> [..., I] same dtype."""
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} is not even"
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def swigluoai_and_mul(x: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """x [..., 2 * I] (gate first, then up) -> swigluoai(gate, up) [..., I], same dtype."""
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} is not even"
    gate, up = x.chunk(2, dim=-1)
    return swigluoai_ref(gate, up, alpha, limit)
