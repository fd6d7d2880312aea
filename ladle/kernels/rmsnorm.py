"""RMSNorm with optional fused residual add (one pass over the row).

    residual_out = x + residual                      (rounded to the input dtype, as the unfused model does)
    out          = w' * (residual_out * rsqrt(mean(residual_out^2) + eps)).to(dtype)
    w'           = weight + weight_offset            (weight_offset=1.0 for Gemma-style norms)

Rounding follows transformers so the fast path is bit-close to the reference model: LlamaRMSNorm (offset 0)
normalises in float32, casts to the input dtype, then multiplies by the weight; Gemma-style norms (offset 1)
multiply by (1 + w) in float32 and cast once. Source: Zhang & Sennrich 2019, "Root Mean Square
Layer Normalization"; vLLM's `fused_add_rms_norm` for the fused-residual interface.
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import decide_triton, triton_ok, tl, triton
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

dispatch.register("rmsnorm", "triton", "cuda (or interpreter); x [T, H] unit last stride; hidden <= 65536")


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride, res_stride, out_stride, res_out_stride, eps,
    weight_offset, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ROUND_NORMED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded like the unfused add
        tl.store(res_out_ptr + row * res_out_stride + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = xf * inv
    if ROUND_NORMED:
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + weight_offset
    tl.store(out_ptr + row * out_stride + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@timed_op
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    weight_offset: float = 0.0,
    use_triton: bool = True,
):
    """x [T, H] (unit last stride), weight [H], residual [T, H] or None.

    Returns out [T, H] (x's dtype) when residual is None, else (out, residual_out) with residual_out = x +
    residual. Inputs are not mutated. Triton when asked for (`use_triton`) and eligible (recorded as op
    "rmsnorm"), else `rms_norm_ref`.
    """
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, H] with unit last stride, got {tuple(x.shape)}"
    assert weight.shape == (x.shape[1],), f"weight {tuple(weight.shape)} != [H={x.shape[1]}]"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    tensors = (x, weight) if residual is None else (x, weight, residual)
    reason = triton_ok(*tensors)
    if reason is None and x.shape[1] > 65536:
        reason = "hidden > 65536"
    if not decide_triton("rmsnorm", x.shape[0], use_triton, reason):
        return rms_norm_ref(x, weight, eps, residual, weight_offset)
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    num_tokens, hidden = x.shape
    if num_tokens > 0:
        block = triton.next_power_of_2(hidden)
        res = residual if residual is not None else x
        _rmsnorm_kernel[(num_tokens,)](
            x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0), eps,
            weight_offset, HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            ROUND_NORMED=weight_offset == 0.0,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, res_out)


def rms_norm_ref(x, weight, eps, residual=None, weight_offset: float = 0.0):
    """Plain-torch reference with the same rounding points (module docstring): two documented rounding modes, chosen
    by the offset — weight_offset 0.0 (HF LlamaRMSNorm) casts the normalised row to x's dtype before the weight
    multiply; any other offset (Gemma / MiniMax-M3, 1 + w) multiplies in float32 and casts once.
    x [..., H] (any leading dims: per-head norms pass [T, heads, D]), weight [H]; returns like `rms_norm`."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset == 0.0:
        normed = normed.to(x.dtype).float()
    out = ((weight.float() + weight_offset) * normed).to(x.dtype)
    return out if residual is None else (out, x)
