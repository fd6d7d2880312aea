"""Fused MoE with MXFP4 expert weights, dequantised inside the K loop: W4A16 (activations in x.dtype) or W4A8
(FP8 e4m3 activations).

Format (design/minimax_m3.md §2.3, OCP MX): w13 packed uint8 [E', 2I, H/2] + w13_scale uint8 [E', 2I, H/32];
w2 packed uint8 [E', H, I/2] + w2_scale uint8 [E', H, I/32]. Two E2M1 codes per byte, low nibble = even element k,
high nibble = k + 1; code bits 0-2 = magnitude index into (0, 0.5, 1, 1.5, 2, 3, 4, 6), bit 3 = sign; one E8M0 byte
per 32 K elements, multiplier 2^(byte - 127). Never `tl.dot_scaled` (no MX MMA on Hopper, kernels_and_limits.md §5).

K step (the inner loop; kernels_and_limits.md §5). The weight tables are read as int32 words (8 E2M1 codes, K
elements 8w .. 8w + 7 of word w, little endian: byte i holds elements 2i, 2i + 1); one step loads a [BK/8, BN] word
tile per weight slab (BK/2 contiguous bytes per row) and its E8M0 byte per word (word w is in 32-group w // 4).
  E2M1 -> float  (`_e2m1_pair`; no lookup, exp2 or int -> float conversion). For q = 0..3: t = word >> 4q;
                 p = ((t << 6) & 0x01C001C0) | ((t << 12) & 0x80008000) (2 shifts + 1 LOP3) puts the codes of
                 elements q and q + 4 (nibbles at bits 0 and 16 of t) into the bf16 bit layout of p's two 16-bit
                 halves: magnitude bits (2-bit exponent e, 1-bit mantissa m) at bits 6-8, sign at bit 15. Each half
                 read as a bf16 is 2^(e - 127) (1 + m/2) = E2M1 x 2^-126 for e >= 1, and the subnormal
                 m x 2^-127 = E2M1 x 2^-126 for e = 0 (OCP MX spec: E2M1 bias 1, e = 0 subnormal 0 / 0.5).
                 x 2^126 (exact; bf16 and fp32 multiplies keep subnormals) then x the group's 2^(byte - 127)
                 (built from the bits, `_e8m0_words`) is the exact dequantised weight: E2M1 x 2^k has <= 2
                 significant bits and every such value from 2^-128 up is a bf16, so bf16 arithmetic (dequant
                 "bf16", the default: packed HMUL2 on sm_90) gives the same values as float32 ("f32") and as the
                 K-step-32 kernel's exp2 (overflow to inf alike). Offline SASS (Triton 3.6 -> ptxas sm_90, GEMM 2
                 decode tile 16 x 64, the inner loop): 7.1 instructions per weight element in bf16, 9.1 in fp32,
                 39.6 for the K-step-32 kernel; the bf16 fused MoE runs 8.2 per (2-byte) element.
  dots           (`_mxfp4_dots`) element 8w + j sits in nibble j of word w, so instead of interleaving the nibbles
                 the activation tile is read at the matching columns (8w + j, a strided [BM, BK/8] load, L1/L2 hits):
                 acc += sum_j x[:, 8w + j] @ W_j with W_j [BK/8, BN]; 8 dots of K = BK/8 per step, scaled before
                 the dot, so BK covers several 32-groups (the previous kernel ran one K = 32 dot per group).
Variants (one kernel pair, constexpr FP8_ACT; op names for ladle.observe.dispatch):
  W4A16 "fused_moe_mxfp4"       activations stay in x.dtype (bf16 on the GPU): at decode sizes the weight bytes set the
                                time and no activation-quant kernel is needed (§1.3 "Low-batch caveat", §1.5: vLLM's
                                Hopper MXFP4 MoE is W4A16 too). BK = 128 (`mxfp4_block_k`).
  W4A8  "fused_moe_mxfp4_w4a8"  x and the intermediate quantized per token per 128-group (op "fp8_act_quant", as the
                                FP8 MoE, ladle/kernels/fused_moe_fp8.py); BK = 128 = the activation group. The e4m3
                                activations are upcast to bf16 (exact: e4m3 is a subset of bf16) and dotted with the
                                bf16-dequantised weights (exact, as W4A16); every product is exact in the fp32
                                accumulator, and the step's partial is multiplied by a_scale[:, None] once. fp8 x fp8
                                dots would need the weight scale applied per 32-group after the dot (E2M1 x 2^(s-127)
                                leaves e4m3's range), i.e. the K = 32 dots this layout removes.
Decode path: at <= 64 tokens W4A16 runs ladle/kernels/fused_moe_mxfp4_decode.py instead (swap AB, the dequantised
weight tile in the wgmma A registers; op "fused_moe_mxfp4_decode" in the dispatch record); `path` forces either.
Same structure as ladle/kernels/fused_moe.py (shared `moe_launch_plan`, `moe_tile_rows`, `store_swigluoai`, the
combine op `moe_combine`): GEMM 1 with the swigluoai epilogue into intermediate [P, I] (x dtype), GEMM 2 with the
routed weight into per-slot rows, combine over the k slots. Reference `fused_moe_mxfp4_ref`: dequantise (exact),
then `fused_moe_ref` (W4A16) or `w8a8_moe_ref` (W4A8, activations quantized at the kernel's points).
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import decide_triton, interpreting, tl, triton, triton_ok
from ladle.kernels.fp8_quant import MX_GROUP, act_quant, dequant_mxfp4
from ladle.kernels.fused_moe_fp8 import w8a8_moe_ref
from ladle.kernels.fused_moe import (SWIGLU_ALPHA, SWIGLU_LIMIT, MoETileConfig, check_routing, fused_moe_ref,
                                     moe_combine, moe_launch_plan, moe_tile_cols, moe_tile_rows, slot_dtype_for,
                                     store_slot_rows, store_swigluoai)
from ladle.kernels.fused_moe_mxfp4_decode import OP_DECODE, decode_ineligible, fused_moe_mxfp4_decode
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "fused_moe_mxfp4"
OP_W4A8 = "fused_moe_mxfp4_w4a8"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); MXFP4 packed experts, x dtype activations")
dispatch.register(OP_W4A8, "triton", "cuda (or cpu+TRITON_INTERPRET); MXFP4 packed experts, fp8 e4m3 activations "
                  "(per token per 128-group)")


_TWO_POW_126: tl.constexpr = tl.constexpr(8.507059173023462e37)  # 2^126 exactly (module doc, "E2M1 -> float")


@triton.jit
def _e8m0_words(s_base, rows, row_ok, offs_w, w_ok, num_groups, BF16: tl.constexpr):
    """Scales of a [NW, BN] tile of packed words, 2^(byte - 127) built from the bits (exact; byte 0 is the
    subnormal 2^-127, byte 255 gives inf as exp2 did), bf16 (BF16) or float32. Word w of a row lies in its
    32-group w // 4."""
    ok = w_ok[:, None] & row_ok[None, :]
    s = tl.load(s_base + rows[None, :] * num_groups + offs_w[:, None] // 4, mask=ok, other=127).to(tl.int32)
    if BF16:
        scale = tl.where(s == 0, 0x40, s << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        scale = tl.where(s == 0, 0x400000, s << 23).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _e2m1_pair(words, scale, q: tl.constexpr, BF16: tl.constexpr):
    """Elements q and q + 4 of each packed int32 word (bits 4q.. and 16 + 4q..; low nibble = even element),
    [NW, BN] each, times `scale` (module doc, "E2M1 -> float"): the two nibbles are placed at once into the bf16
    bit layout of the word's two halves; each half is value x 2^-126 (the 0.5 code is the subnormal 2^-127),
    multiplied by 2^126 and the scale. BF16: bf16 halves and bf16 multiplies (packed on sm_90), else float32."""
    t = words >> (4 * q)
    p = ((t << 6) & 0x01C001C0) | ((t << 12) & -2147450880)  # masks 0x01C001C0, 0x80008000: one LOP3
    if BF16:  # 2^126 as a bf16 tensor (bits 0x7E80): the interpreter has no bf16 scalar constants
        two_126 = tl.full([1, 1], 0x7E80, tl.int16).to(tl.bfloat16, bitcast=True)
        lo = p.to(tl.int16).to(tl.bfloat16, bitcast=True) * two_126
        hi = (p >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True) * two_126
    else:
        lo = (p << 16).to(tl.float32, bitcast=True) * _TWO_POW_126
        hi = (p & -65536).to(tl.float32, bitcast=True) * _TWO_POW_126
    return lo * scale, hi * scale


@triton.jit
def _mxfp4_dots(a_ptrs, a_ok, words, scale, acc,
                F32_DOT: tl.constexpr, FP8_ACT: tl.constexpr, BF16: tl.constexpr):
    """acc [BM, BN] fp32 + the K step of the packed word tile words [NW, BN] (NW words = 8 NW K elements):
    a_ptrs [BM, NW] points at element 8w of each word w; element 8w + j is dotted with nibble j of the word, so
    no interleave is needed: 8 dots of K = NW, each [BM, NW] @ [NW, BN]. The weight tile is dequantised with its
    32-group scale before the dot; W4A8 (FP8_ACT) upcasts the e4m3 activations to bf16 (exact)."""
    for q in tl.static_range(4):
        w_lo, w_hi = _e2m1_pair(words, scale, q, BF16)
        a_lo = tl.load(a_ptrs + q, mask=a_ok, other=0.0)
        a_hi = tl.load(a_ptrs + (q + 4), mask=a_ok, other=0.0)
        if F32_DOT:  # fp32 activations or the interpreter (whose bf16 tl.dot is wrong)
            acc = tl.dot(a_lo.to(tl.float32), w_lo.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(a_hi.to(tl.float32), w_hi.to(tl.float32), acc, input_precision="ieee")
        elif FP8_ACT:
            acc = tl.dot(a_lo.to(tl.bfloat16), w_lo.to(tl.bfloat16), acc)
            acc = tl.dot(a_hi.to(tl.bfloat16), w_hi.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(a_lo, w_lo.to(a_lo.dtype), acc)
            acc = tl.dot(a_hi, w_hi.to(a_hi.dtype), acc)
    return acc


@triton.jit
def _mxfp4_gemm1_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, inter_ptr, sorted_ptr, expert_ptr, npp_ptr,
    numel, topk_cols, N_HALF, K_WORDS, stride_xm, num_akb, stride_we, stride_wse, alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8_ACT: tl.constexpr, F32_DOT: tl.constexpr,
    BF16: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N_HALF, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    tok = (slot // topk_cols).to(tl.int64)
    NW: tl.constexpr = BK // 8
    offs_w = tl.arange(0, NW)
    rows_g = offs_n.to(tl.int64)
    rows_u = rows_g + N_HALF
    g_ptrs = w_ptr + e * stride_we + rows_g[None, :] * K_WORDS + offs_w[:, None]  # [NW, BN] packed words
    u_ptrs = w_ptr + e * stride_we + rows_u[None, :] * K_WORDS + offs_w[:, None]
    s_base = ws_ptr + e * stride_wse
    a_ptrs = x_ptr + tok[:, None] * stride_xm + 8 * offs_w[None, :]  # [BM, NW]: element 8w of word w
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K_WORDS, NW)):
        kw = kb * NW + offs_w
        w_ok = kw < K_WORDS
        g = tl.load(g_ptrs, mask=w_ok[:, None] & n_ok[None, :], other=0)
        u = tl.load(u_ptrs, mask=w_ok[:, None] & n_ok[None, :], other=0)
        g_s = _e8m0_words(s_base, rows_g, n_ok, kw, w_ok, K_WORDS // 4, BF16)
        u_s = _e8m0_words(s_base, rows_u, n_ok, kw, w_ok, K_WORDS // 4, BF16)
        a_ok = row_ok[:, None] & w_ok[None, :]
        if FP8_ACT:  # BK = 128 = the activation group: one scale per token per step
            a_s = tl.load(xs_ptr + tok * num_akb + kb, mask=row_ok, other=0.0)
            zero = tl.zeros([BM, BN], tl.float32)
            acc_g += _mxfp4_dots(a_ptrs, a_ok, g, g_s, zero, F32_DOT, True, BF16) * a_s[:, None]
            acc_u += _mxfp4_dots(a_ptrs, a_ok, u, u_s, zero, F32_DOT, True, BF16) * a_s[:, None]
        else:
            acc_g = _mxfp4_dots(a_ptrs, a_ok, g, g_s, acc_g, F32_DOT, False, BF16)
            acc_u = _mxfp4_dots(a_ptrs, a_ok, u, u_s, acc_u, F32_DOT, False, BF16)
        g_ptrs += NW
        u_ptrs += NW
        a_ptrs += BK
    store_swigluoai(inter_ptr, offs_m, offs_n, n_ok, N_HALF, acc_g, acc_u, alpha, limit)


@triton.jit
def _mxfp4_gemm2_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
    numel, N, K_WORDS, num_akb, stride_we, stride_wse,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8_ACT: tl.constexpr, F32_DOT: tl.constexpr,
    BF16: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    NW: tl.constexpr = BK // 8
    offs_w = tl.arange(0, NW)
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    b_ptrs = w_ptr + e * stride_we + cols[None, :] * K_WORDS + offs_w[:, None]  # [NW, BN] packed words
    s_base = ws_ptr + e * stride_wse
    a_ptrs = a_ptr + rows[:, None] * (8 * K_WORDS) + 8 * offs_w[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(0, tl.cdiv(K_WORDS, NW)):
        kw = kb * NW + offs_w
        w_ok = kw < K_WORDS
        b = tl.load(b_ptrs, mask=w_ok[:, None] & n_ok[None, :], other=0)
        b_s = _e8m0_words(s_base, cols, n_ok, kw, w_ok, K_WORDS // 4, BF16)
        if FP8_ACT:
            a_s = tl.load(as_ptr + rows * num_akb + kb)
            zero = tl.zeros([BM, BN], tl.float32)
            acc += _mxfp4_dots(a_ptrs, w_ok[None, :], b, b_s, zero, F32_DOT, True, BF16) * a_s[:, None]
        else:
            acc = _mxfp4_dots(a_ptrs, w_ok[None, :], b, b_s, acc, F32_DOT, False, BF16)
        b_ptrs += NW
        a_ptrs += BK
    wt = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
    out = out_ptr + slot[:, None].to(tl.int64) * N + offs_n[None, :]
    store_slot_rows(out, acc * wt[:, None], row_ok[:, None] & n_ok[None, :])


def mxfp4_block_k(fp8_activations: bool, block_k: Optional[int] = None) -> int:
    """K elements per step of the MXFP4 kernels: 128 (dots of K = BK / 8 = 16, the bf16 MMA's K; W4A8: its
    activation group, one a_scale per token per step). Offline ptxas for sm_90 (Triton 3.6, arguments specialized
    as launched, decode tiles 16 x 32 / 16 x 64, 4 warps, 3 stages): BK 128 uses 64-80 registers and 7.1 inner-loop
    instructions per weight element (W4A16, bf16 dequant), BK 256 104-160 registers and 7.5-7.7, so 256 is only
    the W4A16 A/B option (block_k) of benchmarks/gpu_mxfp4_ab.py."""
    if fp8_activations:
        assert block_k in (None, 128), "W4A8 steps K by its activation group (128)"
        return 128
    assert block_k in (None, 128, 256), f"block_k {block_k}: 128 or 256"
    return block_k or 128


def fused_moe_mxfp4_triton(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    config: Optional[MoETileConfig] = None, fp8_activations: bool = False, block_k: Optional[int] = None,
    dequant: str = "f32", path: Optional[str] = None, slot_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """x [T, H] float, w13 / w2 packed MXFP4 with E8M0 scales (module doc), topk_ids [T, k] int32,
    topk_weights [T, k] fp32 -> [T, H] in x.dtype. H and I must be multiples of 32. fp8_activations: W4A8 (x and
    the intermediate quantized per token per 128-group by op "fp8_act_quant"), else W4A16. block_k: K step
    (`mxfp4_block_k`; config.block_k is not used). dequant: "f32" (float32 dequantisation: the math the interpreter
    tests run) or "bf16" (`_e2m1_pair` in bf16 arithmetic, fewer instructions per element; it relies on the GPU
    keeping bf16 subnormals, unverified: fp32-dot launches, incl. the interpreter, always use "f32"): the A/B switch
    of benchmarks/gpu_mxfp4_ab.py. The default is "f32" until an H200 run shows the bf16 rows' error equal to the f32
    rows' (this kernel has not run on a GPU yet, 2026-12-01). path: "decode" (ladle/kernels/fused_moe_mxfp4_decode.py)
    or "wide" (this module's kernels); None: decode when its rule (`decode_ineligible`) passes and no wide-kernel
    option (config, block_k, dequant) is given, recorded as op "fused_moe_mxfp4_decode" in the dispatch record.
    slot_dtype: dtype of GEMM 2's per-slot rows, both paths (ladle/kernels/fused_moe.py `slot_dtype_for`; None:
    SLOT_DTYPE)."""
    T, H = x.shape
    E, two_i, half_h = w13.shape
    I = two_i // 2
    assert half_h * 2 == H and w2.shape == (E, H, I // 2) and H % MX_GROUP == 0 and I % MX_GROUP == 0
    assert w13.dtype == w2.dtype == w13_scale.dtype == w2_scale.dtype == torch.uint8
    assert w13_scale.shape == (E, two_i, H // MX_GROUP) and w2_scale.shape == (E, H, I // MX_GROUP)
    assert all(t.is_contiguous() for t in (w13, w2, w13_scale, w2_scale)) and x.stride(1) == 1
    k = check_routing(topk_ids, topk_weights, T)
    slots_dt = slot_dtype_for(x.dtype, T, slot_dtype)
    if T == 0:
        return torch.empty_like(x)
    if _use_decode(x, fp8_activations, path, config is None and block_k is None and dequant == "f32"):
        return fused_moe_mxfp4_decode(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, k, alpha, limit,
                                      slot_dtype=slots_dt)
    cfg, (bn1, bn2, _, _), (sorted_ids, expert_ids, npp) = moe_launch_plan(
        topk_ids, E, H, I, config, MX_GROUP, "w4a8" if fp8_activations else "mxfp4")
    bm, P = cfg.block_m, sorted_ids.numel()
    f32 = interpreting() or (x.dtype == torch.float32 and not fp8_activations)
    assert dequant in ("bf16", "f32"), dequant
    bf16 = dequant == "bf16" and not f32  # fp32 dots dequantise in fp32 (the interpreter's bf16 arithmetic is wrong)
    w13_words, w2_words = w13.view(torch.int32), w2.view(torch.int32)  # 8 E2M1 codes per word (little endian)
    a, a_s = act_quant(x.contiguous(), use_triton=True) if fp8_activations else (x, x)
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    _mxfp4_gemm1_kernel[((P // bm) * triton.cdiv(I, bn1),)](
        a, a_s, w13_words, w13_scale, inter, sorted_ids, expert_ids, npp, T * k, k, I, H // 8, a.stride(0),
        a_s.shape[1] if fp8_activations else 0, w13_words.stride(0), w13_scale.stride(0), float(alpha), float(limit),
        BM=bm, BN=bn1, BK=mxfp4_block_k(fp8_activations, block_k), FP8_ACT=fp8_activations, F32_DOT=f32,
        BF16=bf16, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    i_q, i_s = act_quant(inter, use_triton=True) if fp8_activations else (inter, inter)
    out_slots = torch.empty((T * k, H), dtype=slots_dt, device=x.device)
    _mxfp4_gemm2_kernel[((P // bm) * triton.cdiv(H, bn2),)](
        i_q, i_s, w2_words, w2_scale, out_slots, sorted_ids, expert_ids, npp, topk_weights.contiguous(), T * k, H,
        I // 8, i_s.shape[1] if fp8_activations else 0, w2_words.stride(0), w2_scale.stride(0),
        BM=bm, BN=bn2, BK=mxfp4_block_k(fp8_activations, block_k), FP8_ACT=fp8_activations, F32_DOT=f32,
        BF16=bf16, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return moe_combine(out_slots, T, k, x.dtype, use_triton=True)


def _use_decode(x: torch.Tensor, fp8_activations: bool, path: Optional[str], auto: bool) -> bool:
    """Path choice of `fused_moe_mxfp4_triton` from the local shape (see its doc)."""
    assert path in (None, "decode", "wide"), f"path {path!r}: 'decode' or 'wide'"
    reason = decode_ineligible(x, fp8_activations)
    if path is not None:
        assert path == "wide" or reason is None, f"decode path not eligible: {reason}"
        return path == "decode"
    if not auto:
        return False
    return dispatch.decide(OP_DECODE, dispatch.tokens_bucket(x.shape[0]), configured=True, ineligible_reason=reason)


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
