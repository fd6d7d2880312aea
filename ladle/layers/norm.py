"""RMSNorm layer (Llama's w and Gemma / MiniMax-M3's 1 + w) with the fused residual add and the per-head norm + RoPE.

Formula (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"):
    y = (weight + weight_offset) * (x / sqrt(mean(x^2) + eps))
The math lives in the ops: `ladle.kernels.rmsnorm.rms_norm` (fused residual add + norm) and
`ladle.kernels.head_norm_rope.head_norm_rope` (per-head norm + partial NeoX RoPE); each runs its Triton kernel when
the forward context's `backends.fused_norms` asks for it (the runner's choice: on CUDA for every model) and the
input is eligible, else its torch reference. Rounding points (kept bit-compatible with transformers):
weight_offset 0 (HF LlamaRMSNorm) casts the normalised row to the input dtype before the weight multiply;
weight_offset 1 (Gemma / MiniMax-M3) multiplies by (1 + w) in float32 and casts once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ladle.kernels.head_norm_rope import head_norm_rope
from ladle.kernels.rmsnorm import rms_norm, rms_norm_ref
from ladle.layers.backends import op_backends
from ladle.layers.linear import replicated_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension; `weight` [hidden_size] starts at the identity (1 - weight_offset).

    forward(x, residual=None):
      x        [T, hidden] (or [T, heads, hidden] for a per-head norm; residual must then be None), model dtype
      residual [T, hidden] model dtype or None
    Returns `y` when residual is None; otherwise `(y, x + residual)`, where y = norm(x + residual) and the second
    value is the new residual stream (the fused add-norm contract: the add happens once, here, rounded to x's dtype).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight_offset: float = 0.0,
                 dtype: Optional[torch.dtype] = None, device: "torch.device | str | None" = None) -> None:
        super().__init__()
        self.hidden_size, self.eps, self.weight_offset = hidden_size, eps, weight_offset
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - weight_offset, dtype=dtype, device=device),
                                   requires_grad=False)
        set_weight_loader(self.weight, replicated_weight_loader, None)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
        fused = op_backends().fused_norms
        if x.dim() != 2:  # per-head norm on a [T, heads, dim] view
            assert residual is None, "a per-head norm takes no residual"
            if not fused:
                return rms_norm_ref(x, self.weight, self.eps, weight_offset=self.weight_offset)
            flat = x.reshape(-1, x.shape[-1])
            return rms_norm(flat, self.weight, self.eps, weight_offset=self.weight_offset).view(x.shape)
        return rms_norm(x, self.weight, self.eps, residual=residual, weight_offset=self.weight_offset,
                        use_triton=fused)

    def add_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual step with an optional first residual: (norm(s), s) with s = x + residual, or s = x
        when residual is None (the first layer)."""
        if residual is None:
            return self(x), x
        return self(x, residual)

    def norm_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Per-head norm then partial NeoX RoPE (MiniMax-M3's q/k prologue): x [T, heads, dim] (row-strided views are
        fine), cos/sin [T, r] full-width in x's dtype (`RotaryEmbedding.cos_sin`) -> new [T, heads, dim].
        Gemma-style norms only (weight_offset 1: the op computes 1 + w)."""
        assert self.weight_offset == 1.0, "head_norm_rope implements the (1 + w) norm"
        return head_norm_rope(x, self.weight, self.eps, cos, sin, use_triton=op_backends().fused_norms)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, weight_offset={self.weight_offset}"

