"""Fused MoE with FP8 w8a8 block-scaled expert weights (MiniMax-M3 swigluoai experts, shared expert as row E).

Same structure and math as ladle/kernels/fused_moe.py (align by expert, GEMM 1 with the swigluoai epilogue, GEMM 2
with the routed weight, combine over the k slots; shared helpers `moe_launch_plan`, `moe_tile_rows`,
`moe_tile_cols`, `store_swigluoai` and the combine op `moe_combine` come from there), with the block-wise FP8 mode of
kernels_and_limits.md §1.2:
  weights   w13 [E', 2I, H] float8_e4m3fn + w13_scale [E', 2I, ceil(H/128)] float32 (one scale per row per 128-group
            of K, ladle/kernels/fp8_gemm.py), w2 [E', H, I] fp8 + w2_scale [E', H, ceil(I/128)] float32; or MXFP8
            as released: uint8 E8M0 scales [E', 2I, H/32] / [E', H, I/32] (K steps of 32, as in fp8_gemm.py);
  GEMM 1    x quantized per token per 128-group at run time (op "fp8_act_quant"); per K step of 128
            acc += dot(a_q, w_q) * a_scale[:, None] * w_scale[None, :];
  GEMM 2    the intermediate [P, I] is quantized the same way (op "fp8_act_quant"), then the same K loop.
BLOCK_K is the weight group (128, or 32 for MXFP8); BLOCK_M / BLOCK_N come from the local shape (`select_config`:
decode vs prefill tiles, family "fp8" or "mxfp8").
The reference `fused_moe_fp8_ref` dequantizes both operands at the same points (x and the intermediate quantized
by `act_quant_ref`) and runs the per-expert math of `fused_moe_ref`, so it differs from the kernel only by
summation order (and by the intermediate's rounding to x.dtype).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ladle.kernels._common import decide_triton, interpreting, tl, triton, triton_ok
from ladle.kernels.fp8_gemm import fp8_dot_step, load_weight_scale, weight_group
from ladle.kernels.fp8_quant import FP8_DTYPE, act_quant, act_quant_ref, dequant_block_fp8
from ladle.kernels.fused_moe import (SWIGLU_ALPHA, SWIGLU_LIMIT, MoETileConfig, check_routing, moe_combine,
                                     moe_launch_plan, moe_tile_cols, moe_tile_rows, swigluoai_ref, store_swigluoai)
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "fused_moe_fp8"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); fp8 e4m3 expert weights + [rows, K/128] fp32 scales")


@triton.jit
def _fp8_gemm1_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, inter_ptr, sorted_ptr, expert_ptr, npp_ptr,
    numel, topk_cols, N_HALF, K, num_kb, num_akb, stride_we, stride_wse, alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E8M0: tl.constexpr, F32_DOT: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N_HALF, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    tok = (slot // topk_cols).to(tl.int64)
    offs_k = tl.arange(0, BK)
    rows_g = offs_n.to(tl.int64)
    rows_u = rows_g + N_HALF
    a_ptrs = a_ptr + tok[:, None] * K + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + rows_g[None, :] * K + offs_k[:, None]  # [BK, BN]
    u_ptrs = w_ptr + e * stride_we + rows_u[None, :] * K + offs_k[:, None]
    as_ptrs = as_ptr + tok * num_akb
    gs_ptrs = ws_ptr + e * stride_wse + rows_g * num_kb
    us_ptrs = ws_ptr + e * stride_wse + rows_u * num_kb
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, num_kb):
        k_ok = offs_k + kb * BK < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb * BK // 128, mask=row_ok, other=0.0)
        g = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        u = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc_g = fp8_dot_step(a, a_s, g, load_weight_scale(gs_ptrs + kb, n_ok, E8M0), acc_g, F32_DOT)
        acc_u = fp8_dot_step(a, a_s, u, load_weight_scale(us_ptrs + kb, n_ok, E8M0), acc_u, F32_DOT)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    store_swigluoai(inter_ptr, offs_m, offs_n, n_ok, N_HALF, acc_g, acc_u, alpha, limit)


@triton.jit
def _fp8_gemm2_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
    numel, N, K, num_kb, num_akb, stride_we, stride_wse,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E8M0: tl.constexpr, F32_DOT: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    offs_k = tl.arange(0, BK)
    rows = offs_m.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * K + offs_k[None, :]
    b_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]  # [BK, BN]
    as_ptrs = as_ptr + rows * num_akb
    bs_ptrs = ws_ptr + e * stride_wse + offs_n.to(tl.int64) * num_kb
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, num_kb):
        k_ok = offs_k + kb * BK < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb * BK // 128, mask=row_ok, other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = fp8_dot_step(a, a_s, b, load_weight_scale(bs_ptrs + kb, n_ok, E8M0), acc, F32_DOT)
        a_ptrs += BK
        b_ptrs += BK
    wt = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
    out = out_ptr + slot[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc * wt[:, None], mask=row_ok[:, None] & n_ok[None, :])


def _check(x, w13, w13_scale, w2, w2_scale) -> tuple[int, int, int, int]:
    """Assert the FP8 / MXFP8 expert tables against x [T, H] (module doc); returns (T, H, E', I)."""
    T, H = x.shape
    E, two_i, Hw = w13.shape
    I = two_i // 2
    g = weight_group(w13_scale)
    assert Hw == H and two_i == 2 * I and w2.shape == (E, H, I), f"w13 {tuple(w13.shape)} w2 {tuple(w2.shape)}"
    assert w13.dtype == w2.dtype == FP8_DTYPE and w13.is_contiguous() and w2.is_contiguous()
    assert w13_scale.shape == (E, 2 * I, triton.cdiv(H, g)) and w2_scale.shape == (E, H, triton.cdiv(I, g))
    assert w13_scale.dtype == w2_scale.dtype and w13_scale.is_contiguous() and w2_scale.is_contiguous()
    return T, H, E, I


def fused_moe_fp8_triton(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    config: Optional[MoETileConfig] = None,
) -> torch.Tensor:
    """x [T, H] float, w13/w2 fp8 with scales (module doc), topk_ids [T, k] int32 rows of the tables,
    topk_weights [T, k] fp32 -> [T, H] in x.dtype. No host sync; shapes fixed by (T, k, E', H, I)."""
    T, H, E, I = _check(x, w13, w13_scale, w2, w2_scale)
    k = check_routing(topk_ids, topk_weights, T)
    if T == 0:
        return torch.empty_like(x)
    g, e8m0 = weight_group(w13_scale), w13_scale.dtype == torch.uint8
    cfg, (bn1, bn2, _, _), (sorted_ids, expert_ids, npp) = moe_launch_plan(topk_ids, E, H, I, config, g,
                                                                           "mxfp8" if e8m0 else "fp8")
    bm, P, f32 = cfg.block_m, sorted_ids.numel(), interpreting()
    a_q, a_s = act_quant(x.contiguous(), use_triton=True)
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    _fp8_gemm1_kernel[((P // bm) * triton.cdiv(I, bn1),)](
        a_q, a_s, w13, w13_scale, inter, sorted_ids, expert_ids, npp, T * k, k, I, H, triton.cdiv(H, g),
        a_s.shape[1], w13.stride(0), w13_scale.stride(0), float(alpha), float(limit),
        BM=bm, BN=bn1, BK=g, E8M0=e8m0, F32_DOT=f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    i_q, i_s = act_quant(inter, use_triton=True)
    out_slots = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    _fp8_gemm2_kernel[((P // bm) * triton.cdiv(H, bn2),)](
        i_q, i_s, w2, w2_scale, out_slots, sorted_ids, expert_ids, npp, topk_weights.contiguous(), T * k, H, I,
        triton.cdiv(I, g), i_s.shape[1], w2.stride(0), w2_scale.stride(0),
        BM=bm, BN=bn2, BK=g, E8M0=e8m0, F32_DOT=f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return moe_combine(out_slots, T, k, x.dtype, use_triton=True)


def fused_moe_fp8_ref(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference (module doc): `w8a8_moe_ref` on the dequantized FP8 / MXFP8 expert tables."""
    return w8a8_moe_ref(x, lambda e: (dequant_block_fp8(w13[e], w13_scale[e], compute_dtype),
                                      dequant_block_fp8(w2[e], w2_scale[e], compute_dtype)),
                        topk_ids, topk_weights, alpha, limit, compute_dtype)


def w8a8_moe_ref(
    x: torch.Tensor, expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]], topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The FP8-activation MoE reference math (shared with ladle/kernels/fused_moe_mxfp4.py's W4A8 variant):
    x [T, H] quantized per token per 128-group (`act_quant_ref`) and dequantized; per expert e touched by topk_ids,
    `expert_weights(e)` gives its dequantized (w13 [2I, H], w2 [H, I]) in compute_dtype; the intermediate is
    rounded to x.dtype and quantized the same way before GEMM 2, as in the kernels. Returns [T, H] in x.dtype."""
    T, H = x.shape
    a_q, a_s = act_quant_ref(x)
    xc = dequant_block_fp8(a_q, a_s, compute_dtype)
    out = torch.zeros((T, H), dtype=compute_dtype, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13, w2 = expert_weights(e)
        i = w13.shape[0] // 2
        h = swigluoai_ref(xc[tok] @ w13[:i].T, xc[tok] @ w13[i:].T, alpha, limit).to(x.dtype)
        h_q, h_s = act_quant_ref(h)
        y = dequant_block_fp8(h_q, h_s, compute_dtype) @ w2.T
        out.index_add_(0, tok, y * topk_weights[tok, slot].to(compute_dtype)[:, None])
    return out.to(x.dtype)


@timed_op
def fused_moe_fp8(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    *, use_triton: bool = True,
) -> torch.Tensor:
    """Dispatching entry point (records op "fused_moe_fp8", bucket = tokens); the fallback is the float32
    reference."""
    if decide_triton(OP, x.shape[0], use_triton, triton_ok(x, w13)):
        return fused_moe_fp8_triton(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, alpha, limit)
    return fused_moe_fp8_ref(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, alpha, limit,
                             compute_dtype=torch.float32)
