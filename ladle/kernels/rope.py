"""Rotary position embedding, NeoX (rotate-half) layout, full or partial, applied in place to q and k.

For the first `rotary_dim` channels of each head (the rest pass through, as in partial-rotary models such as
MiniMax-M3 with rotary_dim 64 of head_dim 128), with half = rotary_dim / 2, x1 = x[:half], x2 = x[half:rotary_dim]:
    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin
cos/sin come from `cos_sin_cache [max_position, rotary_dim]` float32: cos in the first half of a row, sin in the
second (`rope_cos_sin_cache` builds it: theta_i = base^(-2i / rotary_dim); Su et al. 2021, "RoFormer").
Math in float32, one rounding to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ladle.kernels._common import decide_triton, triton_ok
from ladle.observe import dispatch

dispatch.register("rope", "triton", "cuda (or interpreter); q/k [T, H, D] unit last stride; even rotary_dim <= D")


@triton.jit
def _rotate_heads(x_ptr, row, stride_t, stride_h, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_c[None, :] < HALF)
    base = x_ptr + row * stride_t + offs_h[:, None] * stride_h + offs_c[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(base, y1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, y2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, ROT: tl.constexpr,
                 BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)
    mask_c = offs_c < ROT // 2
    cos = tl.load(cache_ptr + pos * ROT + offs_c, mask=mask_c, other=0.0)
    sin = tl.load(cache_ptr + pos * ROT + ROT // 2 + offs_c, mask=mask_c, other=0.0)
    _rotate_heads(q_ptr, row, q_stride_t, q_stride_h, cos, sin, NUM_Q_HEADS, ROT // 2, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, row, k_stride_t, k_stride_h, cos, sin, NUM_K_HEADS, ROT // 2, BLOCK_KH, BLOCK_HALF)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (views into a fused qkv are fine: unit last stride only).

    positions [T] int64 (each < cos_sin_cache.shape[0]); cos_sin_cache [max_position, rotary_dim] float32;
    rotary_dim defaults to cos_sin_cache.shape[1] and must be even and <= D. Returns (q, k), the same tensors.
    Triton when eligible (recorded as op "rope"), else `apply_rope_ref` (also in place).
    """
    rot = cos_sin_cache.shape[1] if rotary_dim is None else rotary_dim
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q/k need a contiguous last dim"
    assert rot % 2 == 0 and rot <= q.shape[2] and cos_sin_cache.shape[1] == rot, f"bad rotary_dim {rot}"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
    assert positions.shape == (q.shape[0],) and positions.dtype in (torch.int32, torch.int64)
    reason = triton_ok(q, k, positions, cos_sin_cache)
    if not decide_triton("rope", q.shape[0], True, reason):
        return apply_rope_ref(q, k, positions, cos_sin_cache)
    if q.shape[0] > 0:
        _rope_kernel[(q.shape[0],)](
            q, k, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], ROT=rot,
            BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(rot // 2), num_warps=4,
        )
    return q, k


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, device=None) -> torch.Tensor:
    """[max_position, rotary_dim] float32: cos(p * theta_i) | sin(p * theta_i), theta_i = base^(-2i/rotary_dim).
    (Plain RoPE; scaled variants such as Llama-3 rope_scaling adjust inv_freq before this outer product.)"""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))
    freqs = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().contiguous()


def apply_rope_ref(q, k, positions, cos_sin_cache):
    """Plain-torch reference, in place, float32 math (same contract as `apply_rope`)."""
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    cs = cos_sin_cache[positions.long()]  # [T, rot]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        x1 = x[..., :half].float()
        x2 = x[..., half:rot].float()
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        x[..., :half] = y1.to(x.dtype)
        x[..., half:rot] = y2.to(x.dtype)
    return q, k
