"""Rotary position embedding, NeoX (rotate-half) layout, full or partial, applied in place to q and k.

For the first `rotary_dim` channels of each head (the rest pass through, as in partial-rotary models such as
MiniMax-M3 with rotary_dim 64 of head_dim 128), with half = rotary_dim / 2, x1 = x[:half], x2 = x[half:rotary_dim]:
    x1' = x1 * cos - x2 * sin
    x2' = x2 * cos + x1 * sin
cos/sin come from `cos_sin_cache [max_position, rotary_dim]` float32: cos in the first half of a row, sin in the
second (`rope_cos_sin_cache` builds it: theta_i = base^(-2i / rotary_dim); Su et al. 2021, "RoFormer").
Math in float32, one rounding to the input dtype.

`rotate_ref(x, cos, sin)` is THE torch rotation (rotate-half NeoX, or GPT-J's interleaved pairs): `apply_rope_ref`
runs it in float32, `ladle.kernels.head_norm_rope.head_norm_rope_ref` in the activation dtype (MiniMax-M3's rounding
points), and the RotaryEmbedding layer (ladle/layers/rotary.py) reaches it through those two ops.
"""

from __future__ import annotations

import torch

from ladle.kernels._common import decide_triton, triton_ok, tl, triton
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

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


@timed_op
def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    rotary_dim: int | None = None,
    is_neox_style: bool = True,
    use_triton: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (views into a fused qkv are fine: unit last stride only).

    positions [T] int64 (each < cos_sin_cache.shape[0]); cos_sin_cache [max_position, rotary_dim] float32;
    rotary_dim defaults to cos_sin_cache.shape[1] and must be even and <= D. is_neox_style False pairs channels
    (2i, 2i+1) (GPT-J; reference only). Returns (q, k), the same tensors. Triton when asked for (`use_triton`) and
    eligible (recorded as op "rope"), else `apply_rope_ref` (also in place).
    """
    rot = cos_sin_cache.shape[1] if rotary_dim is None else rotary_dim
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q/k need a contiguous last dim"
    assert rot % 2 == 0 and rot <= q.shape[2] and cos_sin_cache.shape[1] == rot, f"bad rotary_dim {rot}"
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
    assert positions.shape == (q.shape[0],) and positions.dtype in (torch.int32, torch.int64)
    reason = triton_ok(q, k, positions, cos_sin_cache)
    if reason is None and not is_neox_style:
        reason = "GPT-J (interleaved) style"
    if not decide_triton("rope", q.shape[0], use_triton, reason):
        return apply_rope_ref(q, k, positions, cos_sin_cache, is_neox_style)
    if q.shape[0] > 0:
        _rope_kernel[(q.shape[0],)](
            q, k, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], ROT=rot,
            BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(rot // 2), num_warps=4,
        )
    return q, k


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, device=None,
                       inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """[max_position, rotary_dim] float32: cos(p * theta_i) | sin(p * theta_i).

    Two documented modes. inv_freq None: theta_i = base^(-2i/rotary_dim) and the angles in float64, rounded once
    (the most accurate table). inv_freq given ([rotary_dim / 2] float32, e.g. a scaled Llama-3 table): transformers'
    semantics, angles = float32(position) * inv_freq in float32, then cos/sin in float32, so a model matches its
    transformers oracle (its rotary embedding computes exactly these products)."""
    if inv_freq is None:
        inv64 = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))
        freqs = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv64[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().contiguous()
    assert inv_freq.shape == (rotary_dim // 2,) and inv_freq.dtype == torch.float32
    positions = torch.arange(max_position, dtype=torch.int64, device=device).to(torch.float32)
    freqs = torch.outer(positions, inv_freq.to(device))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = True) -> torch.Tensor:
    """THE torch RoPE rotation. x [T, H, D]; cos/sin [T, r] (full width: cos[:, i] == cos[:, i + r/2], as a
    cat(c, c) table gives) in the dtype the products are to be rounded in. Returns a new tensor: the first r
    channels of each head rotated, x1*c - x2*s | x2*c + x1*s (NeoX: x1, x2 the halves; GPT-J: even/odd channels),
    the rest passed through. Elementwise ops in the promoted dtype of x and cos/sin, each result rounded there."""
    r = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    if is_neox_style:
        half = r // 2
        rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
        out = x_rot * c + rotated * s
    else:  # interleaved pairs read c/s at the pair index (first half of the full-width rows)
        c2, s2 = c[..., : r // 2], s[..., : r // 2]
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack([x1 * c2 - x2 * s2, x2 * c2 + x1 * s2], dim=-1).flatten(-2)
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


def cos_sin_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width (cos, sin) rows [T, r] float32 for `positions` out of a [max_position, r] cos | sin table."""
    cos, sin = cos_sin_cache.index_select(0, positions.long()).chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def apply_rope_ref(q, k, positions, cos_sin_cache, is_neox_style: bool = True):
    """Plain-torch reference, in place, float32 math (same contract as `apply_rope`)."""
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_rows(cos_sin_cache, positions)
    for x in (q, k):
        x[..., :rot] = rotate_ref(x[..., :rot].float(), cos, sin, is_neox_style).to(x.dtype)
    return q, k
