"""Per-head Gemma RMSNorm followed by partial NeoX RoPE, in one pass (MiniMax-M3's q/k and index-q/k prologue).

For each token t and head h of x [T, H, D], with w [D] the stored Gemma offset, r = rotary width, half = r / 2:
    n      = (x * rsqrt(mean(x^2) + eps) * (1 + w)).to(dtype)           float32 math, one rounding
    y[:half]  = rnd(rnd(n[:half]  * cos[:half])  + rnd(-n[half:r] * sin[:half]))
    y[half:r] = rnd(rnd(n[half:r] * cos[half:r]) + rnd( n[:half]  * sin[half:r]))
    y[r:]     = n[r:]                                                      (channels past the rotary width pass)
where rnd() rounds to x's dtype and cos/sin [T, r] are already in x's dtype: exactly the rounding points of the
torch composition `rotate_ref(rms_norm_ref(x, w, eps, weight_offset=1.0), cos, sin)` (`head_norm_rope_ref`; transformers
MiniMaxM3 q/k norm then apply_rotary_pos_emb, design/minimax_m3.md §3.4), whose elementwise bf16 ops compute in
float32 and round each result. Only the sum of squares may differ in order, so outputs agree to the last ulp
almost everywhere. RMSNorm: Zhang & Sennrich 2019; RoPE: Su et al. 2021 (RoFormer), NeoX rotate-half layout.

Why: the torch composition is ~14 kernels per tensor (cast, pow, mean, rsqrt, scale, cast, slice, neg, cat, mul, mul,
add, cat); an M3 MSA layer runs it on four tensors (q, k, index q, index k), which made small launches a large part
of a decode step on the TP4-rank proxy.
"""

from __future__ import annotations

import torch

from ladle.kernels._common import decide_triton, round_to, triton_ok, tl, triton
from ladle.kernels.rmsnorm import rms_norm_ref
from ladle.kernels.rope import rotate_ref
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

dispatch.register("head_norm_rope", "triton",
                  "cuda (or interpreter); x [T, H, D] unit last stride; cos/sin [T, r] contiguous, x's dtype; even r <= D")


@triton.jit
def _head_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, eps,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = ROT // 2
    PASS: tl.constexpr = HEAD_DIM - ROT
    dt = out_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    mh = offs_h[:, None] < NUM_HEADS
    mc = offs_c < HALF
    m = mh & mc[None, :]
    xrow = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
    x1 = tl.load(xrow + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + HALF + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)  # [BLOCK_H]
    if PASS > 0:
        offs_p = tl.arange(0, BLOCK_PASS)
        mp = mh & (offs_p[None, :] < PASS)
        x3 = tl.load(xrow + ROT + offs_p[None, :], mask=mp, other=0.0).to(tl.float32)
        ss += tl.sum(x3 * x3, 1)
    inv = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
    w1 = 1.0 + tl.load(w_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
    w2 = 1.0 + tl.load(w_ptr + HALF + offs_c, mask=mc, other=0.0).to(tl.float32)
    n1 = round_to(x1 * inv * w1[None, :], dt)
    n2 = round_to(x2 * inv * w2[None, :], dt)
    c1 = tl.load(cos_ptr + t * ROT + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * ROT + HALF + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * ROT + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * ROT + HALF + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    y1 = round_to(round_to(n1 * c1, dt) + round_to(-n2 * s1, dt), dt)
    y2 = round_to(round_to(n2 * c2, dt) + round_to(n1 * s2, dt), dt)
    orow = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh
    tl.store(orow + offs_c[None, :], y1.to(dt), mask=m)
    tl.store(orow + HALF + offs_c[None, :], y2.to(dt), mask=m)
    if PASS > 0:
        w3 = 1.0 + tl.load(w_ptr + ROT + offs_p, mask=offs_p < PASS, other=0.0).to(tl.float32)
        tl.store(orow + ROT + offs_p[None, :], round_to(x3 * inv * w3[None, :], dt).to(dt), mask=mp)


@timed_op
def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, use_triton: bool = True) -> torch.Tensor:
    """x [T, H, D] (any strides with a unit last stride, e.g. a view of a projection output), weight [D] (Gemma
    offset: the scale is 1 + weight), eps, cos/sin [T, r] in x's dtype with even r <= D.

    Returns a new contiguous [T, H, D] tensor in x's dtype (x is not modified). Triton when asked for (`use_triton`)
    and eligible (recorded as op "head_norm_rope"), else `head_norm_rope_ref`. Raises AssertionError on shape, dtype
    or stride mismatches.
    """
    assert x.dim() == 3 and x.stride(-1) == 1, f"x must be [T, H, D] with unit last stride, got {tuple(x.shape)}"
    T, H, D = x.shape
    r = cos.shape[-1]
    assert weight.shape == (D,), f"weight {tuple(weight.shape)} != [D={D}]"
    assert cos.shape == sin.shape == (T, r), f"cos/sin must be [T={T}, r], got {tuple(cos.shape)}/{tuple(sin.shape)}"
    assert r % 2 == 0 and 0 < r <= D, f"rotary width {r} must be even and in (0, {D}]"
    assert cos.dtype == sin.dtype == x.dtype, "cos/sin must be in x's dtype (the reference multiplies in that dtype)"
    reason = triton_ok(x, weight, cos, sin)
    if reason is None and not (cos.is_contiguous() and sin.is_contiguous()):
        reason = "cos/sin not contiguous"
    if not decide_triton("head_norm_rope", T, use_triton, reason):
        return head_norm_rope_ref(x, weight, eps, cos, sin)
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T > 0:
        _head_norm_rope_kernel[(T,)](
            x, weight, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1), eps,
            NUM_HEADS=H, HEAD_DIM=D, ROT=r, BLOCK_H=triton.next_power_of_2(H),
            BLOCK_HALF=triton.next_power_of_2(r // 2), BLOCK_PASS=triton.next_power_of_2(max(D - r, 1)),
            num_warps=4 if H * D >= 1024 else 1,
        )
    return out


def head_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference with the torch model's rounding points (module docstring); same contract: the Gemma
    RMSNorm reference (float32, one rounding) then THE rotation reference in x's dtype."""
    return rotate_ref(rms_norm_ref(x, weight, eps, weight_offset=1.0), cos, sin).contiguous()
