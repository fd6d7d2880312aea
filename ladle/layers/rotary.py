"""Rotary position embedding (RoPE) with a precomputed cos/sin cache; full or partial rotary dims.

Formula (Su et al. 2021, "RoFormer", eq. 34): for a pair (x1, x2) of channels and inverse frequency
    inv_freq[i] = base ** (-2i / rotary_dim),   angle = position * inv_freq[i]
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
NeoX style (`is_neox_style=True`, what HF Llama/Qwen2 checkpoints use) pairs channel i with i + rotary_dim/2
(HF `rotate_half`); GPT-J style pairs channels 2i and 2i+1. With `rotary_dim < head_dim` (partial rotary,
e.g. `partial_rotary_factor` 0.5) only the first `rotary_dim` channels of each head rotate; the rest pass
through unchanged.

inv_freq is computed exactly as transformers does (int64 arange -> float32, `base ** (arange / dim)`) and the
cos | sin table by `ladle.kernels.rope.rope_cos_sin_cache` in its transformers mode (float32 angles
`position * inv_freq`), so the table matches the reference bit for bit. The rotation itself is the op
`ladle.kernels.rope.apply_rope` (Triton when `backends.fused_norms`, else `apply_rope_ref`, float32 math, one
rounding); MiniMax-M3 takes `cos_sin` rows and rotates inside `RMSNorm.norm_rope` (`head_norm_rope`).

Scaling (`rope_scaling` / transformers-5 `rope_parameters`): "default", "linear" (inv_freq / factor) and
"llama3" (Llama 3.1 frequency-dependent scaling; formula from Meta's llama-models `apply_scaling`, also
transformers `_compute_llama3_parameters`). Other types raise ValueError.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ladle.kernels.rope import apply_rope, cos_sin_rows, rope_cos_sin_cache
from ladle.layers.backends import op_backends

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(rotary_dim: int, base: float, scaling: Optional[dict] = None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] float32. Raises ValueError on an unsupported scaling type."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponent)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """RoPE over the first `rotary_dim` channels of each head (partial rotary when rotary_dim < head_dim).

    Args:
      head_dim: channels per head. rotary_dim: rotated channels per head (<= head_dim, even).
      max_position: table length; positions must be < max_position (asserted on CPU only, to stay sync-free).
      base: rope_theta. scaling: rope scaling dict or None. is_neox_style: see module docstring.
    Buffer: cos_sin_cache [max_position, rotary_dim] float32 = cat(cos, sin) over the rotary_dim/2 frequencies.
    """

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: Optional[dict] = None, is_neox_style: bool = True,
                 device: "torch.device | str | None" = None) -> None:
        super().__init__()
        assert rotary_dim <= head_dim and rotary_dim % 2 == 0, (rotary_dim, head_dim)
        self.head_dim, self.rotary_dim, self.max_position = head_dim, rotary_dim, max_position
        self.is_neox_style, self.base = is_neox_style, base
        self.scaling = dict(scaling) if scaling else None
        inv_freq = compute_inv_freq(rotary_dim, base, self.scaling)  # on the CPU, as transformers does
        cache = rope_cos_sin_cache(rotary_dim, max_position, base, device=device, inv_freq=inv_freq)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _check(self, positions: torch.Tensor) -> None:
        if positions.device.type == "cpu" and positions.numel():
            assert int(positions.max()) < self.max_position, "position beyond the RoPE cache"

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64, q [T, Hq * head_dim], k [T, Hk * head_dim] (column views of a qkv output are fine)
        -> (q, k) rotated, same shapes and dtype: new tensors, or q and k themselves rotated in place when
        `inplace` (the model's choice: no copy)."""
        self._check(positions)
        if not inplace:
            q, k = q.clone(), k.clone()
        t = positions.shape[0]
        qh = q.view(t, -1, self.head_dim)
        kh = k.view(t, -1, self.head_dim)
        apply_rope(qh, kh, positions, self.cos_sin_cache, self.rotary_dim, self.is_neox_style,
                   use_triton=op_backends().fused_norms)
        return q, k

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, rotary_dim] (full width, cat(c, c)) in `dtype`: float32
        table rows cast to the activation dtype, as transformers does (MiniMax-M3's `norm_rope` input)."""
        self._check(positions)
        cos, sin = cos_sin_rows(self.cos_sin_cache, positions)
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
                f"base={self.base}, neox={self.is_neox_style}")
