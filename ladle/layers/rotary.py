"""Rotary position embedding (RoPE) with a precomputed cos/sin cache; full or partial rotary dims.

Formula (Su et al. 2021, "RoFormer", eq. 34): for a pair (x1, x2) of channels and inverse frequency
    inv_freq[i] = base ** (-2i / rotary_dim),   angle = position * inv_freq[i]
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
NeoX style (`is_neox_style=True`, what HF Llama/Qwen2 checkpoints use) pairs channel i with i + rotary_dim/2
(HF `rotate_half`); GPT-J style pairs channels 2i and 2i+1. With `rotary_dim < head_dim` (partial rotary,
e.g. `partial_rotary_factor` 0.5) only the first `rotary_dim` channels of each head rotate; the rest pass
through unchanged.

inv_freq is computed exactly as transformers does (int64 arange -> float32, `base ** (arange / dim)`) and
angles as float32 `position * inv_freq`, so float32 results match the reference bit for bit on the cache.

Scaling (`rope_scaling` / transformers-5 `rope_parameters`): "default", "linear" (inv_freq / factor) and
"llama3" (Llama 3.1 frequency-dependent scaling; formula from Meta's llama-models `apply_scaling`, also
transformers `_compute_llama3_parameters`). Other types raise ValueError.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

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
    """Applies RoPE to packed q and k.

    Args:
      head_dim: channels per head. rotary_dim: rotated channels per head (<= head_dim, even).
      max_position: cache length; positions must be < max_position (asserted on CPU only, to stay sync-free).
      base: rope_theta. scaling: rope scaling dict or None. is_neox_style: see module docstring.
    Buffer: cos_sin_cache [max_position, rotary_dim] float32 = cat(cos, sin) over the rotary_dim/2 frequencies.

    forward(positions [T] int64, q [T, Hq * head_dim], k [T, Hk * head_dim]) -> (q, k) rotated, same shapes and
    dtype (new tensors; inputs are not mutated). Rotation math runs in the input dtype with cos/sin cast to it,
    as transformers does.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        scaling: Optional[dict] = None,
        is_neox_style: bool = True,
        device: "torch.device | str | None" = None,
    ) -> None:
        super().__init__()
        assert rotary_dim <= head_dim and rotary_dim % 2 == 0, (rotary_dim, head_dim)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        self.base = base
        self.scaling = dict(scaling) if scaling else None
        self.register_buffer("cos_sin_cache", self._compute_cache(device), persistent=False)

    def _compute_cache(self, device: "torch.device | None") -> torch.Tensor:
        """[max_position, rotary_dim] float32: cat(cos, sin) of position * inv_freq."""
        inv_freq = compute_inv_freq(self.rotary_dim, self.base, self.scaling).to(device)  # computed on CPU
        positions = torch.arange(self.max_position, dtype=torch.int64, device=device).to(torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, rotary_dim // 2] float32
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, head_dim]; cos/sin [T, 1, rotary_dim // 2] in x's dtype."""
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        if rest.shape[-1] == 0:
            return out
        return torch.cat([out, rest], dim=-1)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device.type == "cpu" and positions.numel():
            assert int(positions.max()) < self.max_position, "position beyond the RoPE cache"
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(q.dtype)  # [T, rotary_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # each [T, 1, rotary_dim // 2]
        # HF multiplies by the full-width cos = cat(c, c) and rotate_half; the half-width form below computes
        # the same products and sums, so float results are identical.
        num_tokens = positions.shape[0]
        q_rot = self._rotate(q.view(num_tokens, -1, self.head_dim), cos, sin)
        k_rot = self._rotate(k.view(num_tokens, -1, self.head_dim), cos, sin)
        return q_rot.reshape(q.shape), k_rot.reshape(k.shape)
