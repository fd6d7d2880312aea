"""MiniMax-M3's own small layers: Gemma (1+w) float32 RMSNorm, partial NeoX RoPE, dense SwiGLU-OAI MLP.

They differ from the generic ladle/layers versions in semantics, so they live here (design/minimax_m3.md §3.2,
§3.4.4, §3.7; transformers MOD:153-169, 309-325, 387-405, 175-190).
"""

from __future__ import annotations

import torch
from torch import nn

from ladle.layers.moe import swigluoai_mlp
from ladle.layers.rotary import compute_inv_freq


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class GemmaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · (1 + w), computed in float32, cast back to x.dtype.

    `weight` [dim] is the stored offset (0 = identity scale). Normalises the last dim, so it serves the per-head
    q/k/index norms on [..., heads, head_dim] views too (one gamma shared by all heads).
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool):
        """Pre-norm residual step: s = x + residual (x itself when residual is None), rounded to x.dtype; returns
        (norm(s), s). fused: one kernel (ladle.kernels.rmsnorm with the (1 + w) offset, same rounding points);
        else the torch ops. x, residual [T, dim]."""
        if fused:
            from ladle.kernels.rmsnorm import rms_norm  # lazy: the torch path needs no Triton

            if residual is None:
                return rms_norm(x, self.weight, self.eps, weight_offset=1.0), x
            return rms_norm(x, self.weight, self.eps, residual=residual, weight_offset=1.0)
        s = x if residual is None else x + residual
        return self(s), s

    def norm_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
        """Per-head norm then partial RoPE: x [T, heads, dim] (row-strided views are fine), cos/sin [T, r] in
        x.dtype. fused: one kernel (ladle.kernels.head_norm_rope, same rounding points); else the torch ops."""
        if not fused:
            return PartialNeoxRope.apply(self(x), cos, sin)
        from ladle.kernels.head_norm_rope import head_norm_rope  # lazy: the torch path needs no Triton

        return head_norm_rope(x, self.weight, self.eps, cos, sin)


class PartialNeoxRope(nn.Module):
    """Rotate-half RoPE on the first `rotary_dim` channels of each head; the rest pass through.

    inv_freq_i = theta^(-2i / rotary_dim), i < rotary_dim/2; channel i pairs with i + rotary_dim/2.
    cos/sin are computed in float32 and cast to the activation dtype (as transformers does, MOD:320-325).
    """

    def __init__(self, rotary_dim: int, theta: float, device):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv = compute_inv_freq(rotary_dim, theta)  # shared formula (ladle/layers/rotary.py), no scaling
        self.register_buffer("inv_freq", inv.to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, rotary_dim] in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, d] with cos/sin [T, r] -> rotated copy of x (channels >= r unchanged)."""
        r = cos.shape[-1]
        c, s = cos[:, None, :], sin[:, None, :]
        x_rot, x_pass = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        return torch.cat((x_rot * c + rotated * s, x_pass), dim=-1)


class DenseMLP(nn.Module):
    """y = swigluoai(x·Wgᵀ, x·Wuᵀ)·Wdᵀ with `gate_up_proj` [2I, H] = cat(gate_proj, up_proj) (gate first)."""

    def __init__(self, hidden: int, inter: int, act: dict, dtype: torch.dtype, device):
        super().__init__()
        self.act = act
        self.gate_up_proj = _param(2 * inter, hidden, dtype=dtype, device=device)
        self.down_proj = _param(hidden, inter, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swigluoai_mlp(x, self.gate_up_proj, self.down_proj, **self.act)
