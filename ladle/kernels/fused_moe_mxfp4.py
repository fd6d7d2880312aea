"""Fused MoE with MXFP4 expert weights, weight-only (W4A16): E2M1 codes dequantised inside the K loop.

Format (design/minimax_m3.md §2.3, OCP MX): w13 packed uint8 [E', 2I, H/2] + w13_scale uint8 [E', 2I, H/32];
w2 packed uint8 [E', H, I/2] + w2_scale uint8 [E', H, I/32]. Two E2M1 codes per byte, low nibble = even element k,
high nibble = k + 1; code bits 0-2 = magnitude index into (0, 0.5, 1, 1.5, 2, 3, 4, 6), bit 3 = sign; one E8M0 byte
per 32 K elements, multiplier 2^(byte - 127). Activations stay in x.dtype (bf16 on the GPU): at decode sizes the
weight bytes set the time and a W4A16 path needs no activation-quant kernel (kernels_and_limits.md §1.3 "Low-batch
caveat", §1.5: vLLM's Hopper MXFP4 MoE is W4A16 too). Never `tl.dot_scaled` (no MX MMA on Hopper, §5).

Same structure as ladle/kernels/fused_moe.py (shared `moe_launch_plan`, `moe_tile_rows`, `store_swigluoai`):
GEMM 1 with the swigluoai epilogue into intermediate [P, I] (x dtype), GEMM 2 with the routed weight into per-slot
rows, combine over the k slots. Each K step of 32 loads, per weight column, 16 bytes (each byte read for its two
elements: `_mxfp4_tile`), decodes the codes, multiplies by the group's power of two and runs one tl.dot in x.dtype
(fp32 under the interpreter). Reference `fused_moe_mxfp4_ref`: dequantise (exact) and `fused_moe_ref`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import decide_triton, interpreting, tl, triton, triton_ok
from ladle.kernels.fp8_quant import MX_GROUP, dequant_mxfp4
from ladle.kernels.fused_moe import (SWIGLU_ALPHA, SWIGLU_LIMIT, MoETileConfig, fused_moe_ref, moe_launch_plan,
                                     moe_tile_cols, moe_tile_rows, store_swigluoai)
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "fused_moe_mxfp4"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); MXFP4 packed experts, x dtype activations")


@triton.jit
def _mxfp4_tile(w_base, rows, row_ok, s_base, kb, num_kb, HALF_K, BK: tl.constexpr):
    """Dequantised weight tile [BK, BN] float32 of K step kb (BK = 32 = one scale group): rows [BN] int64 of a
    [rows, K/2] packed table at w_base, E8M0 scales [rows, K/32] at s_base."""
    offs_k = tl.arange(0, BK)
    byte = tl.load(w_base + rows[None, :] * HALF_K + kb * (BK // 2) + offs_k[:, None] // 2,
                   mask=row_ok[None, :], other=0).to(tl.int32)
    code = (byte >> ((offs_k[:, None] % 2) * 4)) & 0xF
    mag_code = code & 7
    exp = mag_code >> 1
    man = (mag_code & 1).to(tl.float32)
    mag = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
    val = tl.where(code >= 8, -mag, mag)
    s = tl.load(s_base + rows * num_kb + kb, mask=row_ok, other=127).to(tl.float32)
    return val * tl.exp2(s - 127.0)[None, :]


@triton.jit
def _dot(a, w, acc, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
    return tl.dot(a, w.to(a.dtype), acc)


@triton.jit
def _mxfp4_gemm1_kernel(
    x_ptr, w_ptr, ws_ptr, inter_ptr, sorted_ptr, expert_ptr, npp_ptr,
    numel, topk_cols, N_HALF, K, stride_xm, stride_we, stride_wse, alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N_HALF, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    tok = (slot // topk_cols).to(tl.int64)
    rows_g = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BK)
    num_kb = K // BK
    w_base = w_ptr + e * stride_we
    s_base = ws_ptr + e * stride_wse
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, num_kb):
        a = tl.load(x_ptr + tok[:, None] * stride_xm + kb * BK + offs_k[None, :], mask=row_ok[:, None], other=0.0)
        g = _mxfp4_tile(w_base, rows_g, n_ok, s_base, kb, num_kb, K // 2, BK)
        u = _mxfp4_tile(w_base, rows_g + N_HALF, n_ok, s_base, kb, num_kb, K // 2, BK)
        acc_g = _dot(a, g, acc_g, F32_DOT)
        acc_u = _dot(a, u, acc_u, F32_DOT)
    store_swigluoai(inter_ptr, offs_m, offs_n, n_ok, N_HALF, acc_g, acc_u, alpha, limit)


@triton.jit
def _mxfp4_gemm2_kernel(
    a_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
    numel, N, K, stride_we, stride_wse,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    offs_k = tl.arange(0, BK)
    num_kb = K // BK
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, num_kb):
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * K + kb * BK + offs_k[None, :])
        b = _mxfp4_tile(w_ptr + e * stride_we, offs_n.to(tl.int64), n_ok, ws_ptr + e * stride_wse, kb, num_kb,
                        K // 2, BK)
        acc = _dot(a, b, acc, F32_DOT)
    wt = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
    out = out_ptr + slot[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc * wt[:, None], mask=row_ok[:, None] & n_ok[None, :])


def fused_moe_mxfp4_triton(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    config: Optional[MoETileConfig] = None,
) -> torch.Tensor:
    """x [T, H] float, w13 / w2 packed MXFP4 with E8M0 scales (module doc), topk_ids [T, k] int32,
    topk_weights [T, k] fp32 -> [T, H] in x.dtype. H and I must be multiples of 32."""
    T, H = x.shape
    E, two_i, half_h = w13.shape
    I = two_i // 2
    assert half_h * 2 == H and w2.shape == (E, H, I // 2) and H % MX_GROUP == 0 and I % MX_GROUP == 0
    assert w13.dtype == w2.dtype == w13_scale.dtype == w2_scale.dtype == torch.uint8
    assert w13_scale.shape == (E, two_i, H // MX_GROUP) and w2_scale.shape == (E, H, I // MX_GROUP)
    assert all(t.is_contiguous() for t in (w13, w2, w13_scale, w2_scale)) and x.stride(1) == 1
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32 and topk_ids.shape[0] == T
    k = topk_ids.shape[1]
    if T == 0:
        return torch.empty_like(x)
    cfg, (bn1, bn2, _, _), (sorted_ids, expert_ids, npp) = moe_launch_plan(topk_ids, E, H, I, config, MX_GROUP)
    bm, P, f32 = cfg.block_m, sorted_ids.numel(), interpreting() or x.dtype == torch.float32
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    _mxfp4_gemm1_kernel[((P // bm) * triton.cdiv(I, bn1),)](
        x, w13, w13_scale, inter, sorted_ids, expert_ids, npp, T * k, k, I, H, x.stride(0), w13.stride(0),
        w13_scale.stride(0), float(alpha), float(limit),
        BM=bm, BN=bn1, BK=MX_GROUP, F32_DOT=f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    out_slots = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    _mxfp4_gemm2_kernel[((P // bm) * triton.cdiv(H, bn2),)](
        inter, w2, w2_scale, out_slots, sorted_ids, expert_ids, npp, topk_weights.contiguous(), T * k, H, I,
        w2.stride(0), w2_scale.stride(0),
        BM=bm, BN=bn2, BK=MX_GROUP, F32_DOT=f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out_slots.view(T, k, H).sum(dim=1).to(x.dtype)


def fused_moe_mxfp4_ref(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference: the experts touched by topk_ids dequantised exactly, then `fused_moe_ref` in compute_dtype."""
    used = torch.unique(topk_ids.long())
    w13_d = torch.zeros((w13.shape[0], w13.shape[1], w13.shape[2] * 2), dtype=compute_dtype, device=x.device)
    w2_d = torch.zeros((w2.shape[0], w2.shape[1], w2.shape[2] * 2), dtype=compute_dtype, device=x.device)
    for e in used.tolist():
        w13_d[e] = dequant_mxfp4(w13[e], w13_scale[e], compute_dtype)
        w2_d[e] = dequant_mxfp4(w2[e], w2_scale[e], compute_dtype)
    return fused_moe_ref(x, w13_d, w2_d, topk_ids, topk_weights, alpha, limit, compute_dtype)


@timed_op
def fused_moe_mxfp4(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    *, use_triton: bool = True,
) -> torch.Tensor:
    """Dispatching entry point (records op "fused_moe_mxfp4", bucket = tokens); fallback: the float32 reference."""
    if decide_triton(OP, x.shape[0], use_triton, triton_ok(x, w13)):
        return fused_moe_mxfp4_triton(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, alpha, limit)
    return fused_moe_mxfp4_ref(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, alpha, limit,
                               compute_dtype=torch.float32)
