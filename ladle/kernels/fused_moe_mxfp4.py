"""Fused MoE with MXFP4 expert weights, dequantised inside the K loop: W4A16 (activations in x.dtype) or W4A8
(FP8 e4m3 activations).

Format (design/minimax_m3.md §2.3, OCP MX): w13 packed uint8 [E', 2I, H/2] + w13_scale uint8 [E', 2I, H/32];
w2 packed uint8 [E', H, I/2] + w2_scale uint8 [E', H, I/32]. Two E2M1 codes per byte, low nibble = even element k,
high nibble = k + 1; code bits 0-2 = magnitude index into (0, 0.5, 1, 1.5, 2, 3, 4, 6), bit 3 = sign; one E8M0 byte
per 32 K elements, multiplier 2^(byte - 127). Never `tl.dot_scaled` (no MX MMA on Hopper, kernels_and_limits.md §5).

Variants (one kernel pair, constexpr FP8_ACT; op names for ladle.observe.dispatch):
  W4A16 "fused_moe_mxfp4"       activations stay in x.dtype (bf16 on the GPU): at decode sizes the weight bytes set the
                                time and no activation-quant kernel is needed (§1.3 "Low-batch caveat", §1.5: vLLM's
                                Hopper MXFP4 MoE is W4A16 too). Each K step of 32 dequantises the tile (E2M1 value x
                                the group's power of two) and runs one tl.dot in x.dtype (fp32 under the interpreter).
  W4A8  "fused_moe_mxfp4_w4a8"  x and the intermediate quantized per token per 128-group (op "fp8_act_quant", as the
                                FP8 MoE, ladle/kernels/fused_moe_fp8.py); each K step of 32 converts the E2M1 values to
                                fp8 e4m3 (exact: every E2M1 value is an e4m3 value) and runs one fp8 x fp8 tl.dot with
                                fp32 accumulation, then acc += part x a_scale[:, None] x 2^(e - 127)[None, :]
                                (`fp8_dot_step`, the block-FP8 promotion of §1.2 at the MX group).
Same structure as ladle/kernels/fused_moe.py (shared `moe_launch_plan`, `moe_tile_rows`, `store_swigluoai`):
GEMM 1 with the swigluoai epilogue into intermediate [P, I] (x dtype), GEMM 2 with the routed weight into per-slot
rows, combine over the k slots. Reference `fused_moe_mxfp4_ref`: dequantise (exact), then `fused_moe_ref` (W4A16)
or `w8a8_moe_ref` (W4A8, activations quantized at the kernel's points).
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import decide_triton, interpreting, tl, triton, triton_ok
from ladle.kernels.fp8_gemm import fp8_dot_step, load_weight_scale
from ladle.kernels.fp8_quant import MX_GROUP, act_quant, dequant_mxfp4
from ladle.kernels.fused_moe_fp8 import w8a8_moe_ref
from ladle.kernels.fused_moe import (SWIGLU_ALPHA, SWIGLU_LIMIT, MoETileConfig, fused_moe_ref, moe_launch_plan,
                                     moe_tile_cols, moe_tile_rows, store_swigluoai)
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "fused_moe_mxfp4"
OP_W4A8 = "fused_moe_mxfp4_w4a8"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); MXFP4 packed experts, x dtype activations")
dispatch.register(OP_W4A8, "triton", "cuda (or cpu+TRITON_INTERPRET); MXFP4 packed experts, fp8 e4m3 activations "
                  "(per token per 128-group)")


@triton.jit
def _e2m1_tile(w_base, rows, row_ok, kb, HALF_K, BK: tl.constexpr):
    """E2M1 values (unscaled, exact) [BK, BN] float32 of K step kb (BK = 32 = one scale group): rows [BN] int64 of a
    [rows, K/2] packed table at w_base; each byte is read for its two elements (low nibble = even k)."""
    offs_k = tl.arange(0, BK)
    byte = tl.load(w_base + rows[None, :] * HALF_K + kb * (BK // 2) + offs_k[:, None] // 2,
                   mask=row_ok[None, :], other=0).to(tl.int32)
    code = (byte >> ((offs_k[:, None] % 2) * 4)) & 0xF
    mag_code = code & 7
    exp = mag_code >> 1
    man = (mag_code & 1).to(tl.float32)
    mag = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _mxfp4_step(a, a_s, w_base, rows, row_ok, s_base, kb, num_kb, HALF_K, acc,
                BK: tl.constexpr, FP8_ACT: tl.constexpr, F32_DOT: tl.constexpr):
    """One K step of 32 (one E8M0 group per weight row): acc [BM, BN] fp32 + a [BM, BK] @ W[rows, step].T.
    W4A16: the tile is dequantised (E2M1 x 2^(e - 127)) and multiplied in a.dtype (fp32 under the interpreter).
    W4A8 (FP8_ACT): a is fp8 with its per-token 128-group scales a_s [BM]; the E2M1 values become fp8 e4m3 exactly
    (every E2M1 value is an e4m3 value) and `fp8_dot_step` applies a_s x the group's 2^(e - 127) after the fp8 dot."""
    w = _e2m1_tile(w_base, rows, row_ok, kb, HALF_K, BK)
    w_s = load_weight_scale(s_base + rows * num_kb + kb, row_ok, True)
    if FP8_ACT:
        if not F32_DOT:
            w = w.to(tl.float8e4nv)
        acc = fp8_dot_step(a, a_s, w, w_s, acc, F32_DOT)
    else:
        w = w * w_s[None, :]
        if F32_DOT:
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    return acc


@triton.jit
def _mxfp4_gemm1_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, inter_ptr, sorted_ptr, expert_ptr, npp_ptr,
    numel, topk_cols, N_HALF, K, stride_xm, num_akb, stride_we, stride_wse, alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8_ACT: tl.constexpr, F32_DOT: tl.constexpr,
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
        if FP8_ACT:
            a_s = tl.load(xs_ptr + tok * num_akb + kb * BK // 128, mask=row_ok, other=0.0)
        else:
            a_s = tl.zeros([BM], tl.float32)  # unused by the W4A16 step
        acc_g = _mxfp4_step(a, a_s, w_base, rows_g, n_ok, s_base, kb, num_kb, K // 2, acc_g, BK, FP8_ACT, F32_DOT)
        acc_u = _mxfp4_step(a, a_s, w_base, rows_g + N_HALF, n_ok, s_base, kb, num_kb, K // 2, acc_u, BK, FP8_ACT,
                            F32_DOT)
    store_swigluoai(inter_ptr, offs_m, offs_n, n_ok, N_HALF, acc_g, acc_u, alpha, limit)


@triton.jit
def _mxfp4_gemm2_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
    numel, N, K, num_akb, stride_we, stride_wse,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8_ACT: tl.constexpr, F32_DOT: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    offs_k = tl.arange(0, BK)
    rows = offs_m.to(tl.int64)
    num_kb = K // BK
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, num_kb):
        a = tl.load(a_ptr + rows[:, None] * K + kb * BK + offs_k[None, :])
        if FP8_ACT:
            a_s = tl.load(as_ptr + rows * num_akb + kb * BK // 128)
        else:
            a_s = tl.zeros([BM], tl.float32)  # unused by the W4A16 step
        acc = _mxfp4_step(a, a_s, w_ptr + e * stride_we, offs_n.to(tl.int64), n_ok, ws_ptr + e * stride_wse, kb,
                          num_kb, K // 2, acc, BK, FP8_ACT, F32_DOT)
    wt = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
    out = out_ptr + slot[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc * wt[:, None], mask=row_ok[:, None] & n_ok[None, :])


def fused_moe_mxfp4_triton(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    config: Optional[MoETileConfig] = None, fp8_activations: bool = False,
) -> torch.Tensor:
    """x [T, H] float, w13 / w2 packed MXFP4 with E8M0 scales (module doc), topk_ids [T, k] int32,
    topk_weights [T, k] fp32 -> [T, H] in x.dtype. H and I must be multiples of 32. fp8_activations: W4A8 (x and
    the intermediate quantized per token per 128-group by op "fp8_act_quant"), else W4A16."""
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
    cfg, (bn1, bn2, _, _), (sorted_ids, expert_ids, npp) = moe_launch_plan(
        topk_ids, E, H, I, config, MX_GROUP, "w4a8" if fp8_activations else "mxfp4")
    bm, P = cfg.block_m, sorted_ids.numel()
    f32 = interpreting() or (x.dtype == torch.float32 and not fp8_activations)
    a, a_s = act_quant(x.contiguous(), use_triton=True) if fp8_activations else (x, x)
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    _mxfp4_gemm1_kernel[((P // bm) * triton.cdiv(I, bn1),)](
        a, a_s, w13, w13_scale, inter, sorted_ids, expert_ids, npp, T * k, k, I, H, a.stride(0),
        a_s.shape[1] if fp8_activations else 0, w13.stride(0), w13_scale.stride(0), float(alpha), float(limit),
        BM=bm, BN=bn1, BK=MX_GROUP, FP8_ACT=fp8_activations, F32_DOT=f32, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    i_q, i_s = act_quant(inter, use_triton=True) if fp8_activations else (inter, inter)
    out_slots = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    _mxfp4_gemm2_kernel[((P // bm) * triton.cdiv(H, bn2),)](
        i_q, i_s, w2, w2_scale, out_slots, sorted_ids, expert_ids, npp, topk_weights.contiguous(), T * k, H, I,
        i_s.shape[1] if fp8_activations else 0, w2.stride(0), w2_scale.stride(0),
        BM=bm, BN=bn2, BK=MX_GROUP, FP8_ACT=fp8_activations, F32_DOT=f32, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out_slots.view(T, k, H).sum(dim=1).to(x.dtype)


def fused_moe_mxfp4_ref(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    compute_dtype: torch.dtype = torch.float64, fp8_activations: bool = False,
) -> torch.Tensor:
    """Reference: the experts touched by topk_ids dequantised exactly, then `fused_moe_ref` in compute_dtype
    (W4A16), or with fp8_activations the W8A8 reference math of ladle/kernels/fused_moe_fp8.py (x and the
    intermediate quantized by `act_quant_ref` at the kernel's points) on the same dequantised weights."""
    if fp8_activations:
        return w8a8_moe_ref(x, lambda e: (dequant_mxfp4(w13[e], w13_scale[e], compute_dtype),
                                          dequant_mxfp4(w2[e], w2_scale[e], compute_dtype)),
                            topk_ids, topk_weights, alpha, limit, compute_dtype)
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
    *, use_triton: bool = True, fp8_activations: bool = False,
) -> torch.Tensor:
    """Dispatching entry point (records op "fused_moe_mxfp4" for W4A16 or "fused_moe_mxfp4_w4a8" for FP8
    activations, bucket = tokens); fallback: the float32 reference of the same variant."""
    op = OP_W4A8 if fp8_activations else OP
    if decide_triton(op, x.shape[0], use_triton, triton_ok(x, w13)):
        return fused_moe_mxfp4_triton(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, alpha, limit,
                                      fp8_activations=fp8_activations)
    return fused_moe_mxfp4_ref(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, alpha, limit,
                               compute_dtype=torch.float32, fp8_activations=fp8_activations)
