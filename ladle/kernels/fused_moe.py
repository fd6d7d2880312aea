"""Fused MoE for MiniMax-M3: align by expert -> grouped GEMM w13 with the swigluoai epilogue -> grouped GEMM w2 with
the routed weight -> combine over the k slots.

Math (design/minimax_m3.md §3.6, §3.8), per token t and slot i with expert e = topk_ids[t, i], weight w:
    g = x_t @ w13[e, :I]^T,  u = x_t @ w13[e, I:]^T          (w13 = [gate rows; up rows], NOT interleaved)
    h = (clamp(u, -limit, limit) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))   alpha 1.702, limit 7.0
    out_t = sum_i w * (h @ w2[e]^T)
The shared expert is just expert #E of a table of E+1 experts, with weight 1.0 from the router (moe_router.py).

Kernels (kernels_and_limits.md §1.1, vLLM fused_moe structure, written from that description):
  moe_align (moe_align.py), then
  `_gemm1_kernel`  1-D grid over (max_padded/BM) x cdiv(I, BN) tiles, N fastest; each program reads its tile's
                   expert id, gathers x rows by sorted_token_ids // k (no permuted copy), streams the matching
                   gate and up weight slabs into two fp32 accumulators and stores swigluoai(g, u) to
                   intermediate [max_padded, I] (x dtype);
  `_gemm2_kernel`  same tiling over (max_padded/BM) x cdiv(H, BN): intermediate @ w2[e]^T, x routed weight,
                   stored to per-slot rows out_slots[T*k, H] in the slot dtype (`store_slot_rows`; `slot_dtype_for`:
                   float32 at decode sizes, x's 16-bit dtype from SLOT_HALF_FROM_TOKENS tokens, rounded to
                   nearest even: half the bytes written and read back, vLLM's practice);
  `_moe_combine_kernel`  out[t] = sum over the k slot rows t*k .. t*k+k-1 of out_slots, fp32 in slot order,
                   cast to x.dtype in the same pass (op "moe_combine", `moe_combine`; shared by the FP8 and MXFP4
                   launchers). No atomics: gemm2's tiles run in expert order, so a token's k slots land in different
                   programs; the per-slot rows keep the result deterministic.
Tiles past num_tokens_post_padded exit at once; all grids depend on shapes only (CUDA-graph capturable).
Tile config from the local shape (`select_config`): M = tokens in the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ladle.kernels._common import (MAX_TOKENS, decide_triton, interpreting, round_to, tile_row, triton_ok, tl,
                                   triton)
from ladle.kernels.moe_align import moe_align_triton
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "fused_moe"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); bf16/fp16/fp32 weights = x dtype")
OP_COMBINE = "moe_combine"
dispatch.register(OP_COMBINE, "triton", "cuda (or cpu+TRITON_INTERPRET); out_slots [T*k, H] fp32/bf16/fp16 "
                  "contiguous")

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


@dataclass(frozen=True)
class MoETileConfig:
    """One tile configuration for both GEMMs (BN1 is the width of EACH of the gate/up halves)."""

    block_m: int
    block_n1: int
    block_n2: int
    block_k: int
    num_warps: int
    num_stages: int


_MOE_DECODE = MoETileConfig(16, 32, 64, 128, 4, 4)
_MOE_PREFILL = MoETileConfig(128, 128, 256, 64, 8, 3)  # best of the H200 sweep at M=8192 (gpu_m3_suite, bf16)
_MOE_DEFAULT = ((16, _MOE_DECODE), (64, _MOE_DECODE), (256, _MOE_DECODE), (MAX_TOKENS, _MOE_PREFILL))

# Tile table per kernel family, in the bucket layout of ladle/kernels/_common.py (`tile_row`: the first bucket
# with num_tokens <= bound wins). Families: "bf16" (fused_moe.py), "fp8" / "mxfp8" (fused_moe_fp8.py, 128-group
# fp32 / E8M0 32-group scales), "mxfp4" / "w4a8" (fused_moe_mxfp4.py, bf16 / FP8 activations). block_k is ignored
# by the FP8 and MXFP4 kernels (their K step is the weight's scale group). benchmarks/gpu_fp8_tiles.py measures
# these on the H200 and prints replacement entries.
# Measured on the H200, 2026-12-01: benchmarks/gpu_fp8_tiles.py (results: benchmarks/results/round3/fp8_tiles.*),
# the best of 10 configs per (format, M) by summed time over the TP4-rank shapes, each checked against the reference.
MOE_TILES: dict[str, tuple[tuple[int, MoETileConfig], ...]] = {
    "bf16": _MOE_DEFAULT,  # not re-swept (only its current tile was timed)
    "fp8": ((16, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=4)),
            (64, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=4)),
            (256, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=5)),
            (MAX_TOKENS, MoETileConfig(block_m=64, block_n1=64, block_n2=128, block_k=64, num_warps=4, num_stages=3))),
    # fp32 scales equal over 128-row blocks (FP8_MOE_OPTIONS "fp8_block" in fused_moe_fp8.py: block_scales frees
    # ~50 registers, so the prefill tile runs 8 warps at 2 CTAs per SM; H200 A/B of 2026-12-02 there). Prefill
    # stages 3 -> 4 with GEMM 2 over 4 column tiles (round 10 call 4, results/round10/call4/n_tiles_ab.log): op
    # 1.08x at M = 8192 and 1.13x at 2048 in one run. Above 8192 tokens 128-row tiles (BM 128, same BN, warps,
    # stages and options; round 14, results/round14/call1 and call3 fp8_moe_prefill.log): the op 1.09-1.10x at
    # M = 32768 and 1.03x at 16384, equal or 0.97x at 8192. They pay only with MoE calls above 8192 tokens, so they
    # came in with MOE_CHUNK_TOKENS 16384 (ladle/layers/moe.py; served: results/round15/README.md).
    "fp8_block": ((16, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=4)),
                  (64, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=4)),
                  (256, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=5)),
                  (8192, MoETileConfig(block_m=64, block_n1=64, block_n2=128, block_k=64, num_warps=8, num_stages=4)),
                  (MAX_TOKENS, MoETileConfig(block_m=128, block_n1=64, block_n2=128, block_k=64, num_warps=8,
                                             num_stages=4))),
    "mxfp8": ((16, MoETileConfig(block_m=16, block_n1=32, block_n2=128, block_k=128, num_warps=4, num_stages=6)),
              (64, MoETileConfig(block_m=16, block_n1=64, block_n2=128, block_k=128, num_warps=4, num_stages=6)),
              (256, MoETileConfig(block_m=32, block_n1=64, block_n2=128, block_k=128, num_warps=4, num_stages=6)),
              (MAX_TOKENS, MoETileConfig(block_m=64, block_n1=128, block_n2=128, block_k=64, num_warps=4, num_stages=5))),
    "mxfp4": ((16, MoETileConfig(block_m=16, block_n1=16, block_n2=64, block_k=128, num_warps=4, num_stages=4)),
              (64, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=3)),
              (256, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=4)),
              (MAX_TOKENS, MoETileConfig(block_m=128, block_n1=64, block_n2=256, block_k=64, num_warps=8, num_stages=3))),
    "w4a8": ((16, MoETileConfig(block_m=16, block_n1=16, block_n2=64, block_k=128, num_warps=4, num_stages=4)),
             (64, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=5)),
             (256, MoETileConfig(block_m=16, block_n1=32, block_n2=64, block_k=128, num_warps=4, num_stages=5)),
             (MAX_TOKENS, MoETileConfig(block_m=128, block_n1=64, block_n2=128, block_k=64, num_warps=8, num_stages=3))),
}


def select_config(num_tokens: int, kernel: str = "bf16") -> MoETileConfig:
    """The local shape decides the tile (issue 6): decode sizes (<= 256 tokens) stream weights with the smallest
    MMA M tile and narrow N tiles for enough CTAs; prefill sizes use larger M tiles for weight reuse. `kernel`
    names the family's row of MOE_TILES."""
    return tile_row(MOE_TILES[kernel], num_tokens)[1]


@triton.jit
def moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM: tl.constexpr):
    """Rows of M tile `pid_m` of the aligned order: (expert id int64, offs_m [BM] positions in sorted order,
    slot [BM] = token * k + i (>= numel for padding), row_ok [BM])."""
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(sorted_ptr + offs_m)
    return e, offs_m, slot, slot < numel


@triton.jit
def moe_tile_cols(N, BN: tl.constexpr):
    """This program's tile of a 1-D grid over (M tiles) x cdiv(N, BN), N fastest: (pid_m, offs_n [BN], n_ok)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    offs_n = (pid % num_n) * BN + tl.arange(0, BN)
    return pid // num_n, offs_n, offs_n < N


@triton.jit
def swigluoai_tile(acc_g, acc_u, alpha, limit):
    """swigluoai on fp32 tiles (same formula as `swigluoai_ref`)."""
    gate = tl.minimum(acc_g, limit)
    up = tl.minimum(tl.maximum(acc_u, -limit), limit)
    return (up + 1.0) * gate * tl.sigmoid(alpha * gate)


@triton.jit
def store_swigluoai(inter_ptr, offs_m, offs_n, n_ok, N_HALF, acc_g, acc_u, alpha, limit):
    """GEMM 1 epilogue: swigluoai of the fp32 gate / up tiles stored to intermediate rows offs_m ([P, N_HALF])."""
    h = swigluoai_tile(acc_g, acc_u, alpha, limit)
    out = inter_ptr + offs_m[:, None].to(tl.int64) * N_HALF + offs_n[None, :]
    tl.store(out, h.to(inter_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def store_slot_rows(ptrs, acc, mask):
    """GEMM 2 epilogue: the fp32 tile acc (routed weight applied) stored at ptrs (rows of out_slots) in their dtype,
    rounded to nearest even by `round_to` (the interpreter's truncating cast too); float32 rows store acc as is."""
    dt = ptrs.dtype.element_ty
    tl.store(ptrs, round_to(acc, dt).to(dt), mask=mask)


@triton.jit
def _gemm1_kernel(
    x_ptr, w_ptr, inter_ptr, sorted_ptr, expert_ptr, npp_ptr,
    numel, topk_cols, N_HALF, K,
    stride_xm, stride_we, stride_wn, alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N_HALF, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    tok = (slot // topk_cols).to(tl.int64)
    offs_k = tl.arange(0, BK)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + N_HALF * stride_wn
    acc_g = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if F32_DOT:  # fp32 weights or the interpreter (whose bf16 tl.dot is wrong)
            acc_g = tl.dot(a.to(tl.float32), g.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(a.to(tl.float32), u.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    store_swigluoai(inter_ptr, offs_m, offs_n, n_ok, N_HALF, acc_g, acc_u, alpha, limit)


@triton.jit
def _gemm2_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
    numel, N, K, stride_we, stride_wn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    b_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if F32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    wt = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
    out = out_ptr + slot[:, None].to(tl.int64) * N + offs_n[None, :]
    store_slot_rows(out, acc * wt[:, None], row_ok[:, None] & n_ok[None, :])


def moe_launch_plan(topk_ids: torch.Tensor, num_experts: int, H: int, I: int,
                    config: Optional[MoETileConfig] = None, block_k: Optional[int] = None, kernel: str = "bf16"):
    """Shared host half of the fused MoE launchers: (tile config from the local shape and the kernel family's
    MOE_TILES row, (BN1, BN2, BK1, BK2) clipped to the problem, moe_align outputs (sorted_ids, expert_ids,
    num_tokens_post_padded)). block_k forces BK (FP8: the 128 scale group)."""
    cfg = config or select_config(topk_ids.shape[0], kernel)
    bk = block_k or cfg.block_k
    tiles = (min(cfg.block_n1, triton.next_power_of_2(I)), min(cfg.block_n2, triton.next_power_of_2(H)),
             block_k or min(bk, triton.next_power_of_2(H)), block_k or min(bk, triton.next_power_of_2(I)))
    return cfg, tiles, moe_align_triton(topk_ids, num_experts, cfg.block_m)


def check_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int) -> int:
    """Assert the routing inputs of the fused MoE launchers: topk_ids [T, k] int32 (rows of the expert tables) and
    topk_weights [T, k] float32, T = num_tokens. Returns k."""
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    return topk_ids.shape[1]


def fused_moe_ineligible(x: torch.Tensor, w13: torch.Tensor) -> Optional[str]:
    """Eligibility rule of the Triton path: None when it may run, else the reason."""
    reason = triton_ok(x, w13)
    if reason:
        return reason
    if x.dtype != w13.dtype:
        return f"x {x.dtype} != weights {w13.dtype}"
    return None


def fused_moe_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E', 2*I, H] rows = [gate (I); up (I)]
    w2: torch.Tensor,  # [E', H, I]
    topk_ids: torch.Tensor,  # [T, k] int32 in [0, E')
    topk_weights: torch.Tensor,  # [T, k] fp32
    alpha: float = SWIGLU_ALPHA,
    limit: float = SWIGLU_LIMIT,
    config: Optional[MoETileConfig] = None,
    slot_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Triton fused MoE. Returns [T, H] in x.dtype. slot_dtype: dtype of GEMM 2's per-slot rows (`slot_dtype_for`;
    None: the module default SLOT_DTYPE). No host sync; shapes fixed by (T, k, E', H, I)."""
    T, H = x.shape
    E, two_i, Hw = w13.shape
    I = two_i // 2
    assert Hw == H and two_i == 2 * I, f"w13 {tuple(w13.shape)} vs x {tuple(x.shape)}"
    assert w2.shape == (E, H, I), f"w2 must be [E, H, I] = {(E, H, I)}, got {tuple(w2.shape)}"
    assert x.dtype == w13.dtype == w2.dtype
    assert x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    k = check_routing(topk_ids, topk_weights, T)
    slots_dt = slot_dtype_for(x.dtype, T, slot_dtype)
    if T == 0:
        return torch.empty_like(x)
    cfg, (bn1, bn2, bk1, bk2), (sorted_ids, expert_ids, npp) = moe_launch_plan(topk_ids, E, H, I, config)
    bm, P = cfg.block_m, sorted_ids.numel()
    f32 = x.dtype == torch.float32 or interpreting()
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    _gemm1_kernel[((P // bm) * triton.cdiv(I, bn1),)](
        x, w13, inter, sorted_ids, expert_ids, npp, T * k, k, I, H,
        x.stride(0), w13.stride(0), w13.stride(1), float(alpha), float(limit),
        BM=bm, BN=bn1, BK=bk1, EVEN_K=H % bk1 == 0, F32_DOT=f32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    out_slots = torch.empty((T * k, H), dtype=slots_dt, device=x.device)
    _gemm2_kernel[((P // bm) * triton.cdiv(H, bn2),)](
        inter, w2, out_slots, sorted_ids, expert_ids, npp, topk_weights.contiguous(), T * k, H, I,
        w2.stride(0), w2.stride(1),
        BM=bm, BN=bn2, BK=bk2, EVEN_K=I % bk2 == 0, F32_DOT=f32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return moe_combine(out_slots, T, k, x.dtype, use_triton=True)


# dtype of GEMM 2's per-slot rows out_slots [T*k, H] when a fused MoE launcher's slot_dtype is None (one rule for
# the bf16, FP8 and MXFP4 launchers; `slot_dtype_for`): float32 rows (each slot's fp32 accumulator stored as is) below
# SLOT_HALF_FROM_TOKENS tokens, SLOT_DTYPE from there, where a 16-bit SLOT_DTYPE stands for x's own 16-bit dtype
# (each slot rounded once to nearest even; vLLM stores its slot rows in the activation dtype and sums them in
# `moe_sum`); float32 x keeps float32 rows. H200, round 10 call 1 (benchmarks/gpu_fp8_moe_prefill_ab.py, served FP8
# tile, TP4-rank shapes; benchmarks/results/round10/call1/slots_ab.log): bf16 rows make the op 1.08x faster at
# M = 8192 (combine 269 -> 153 us, GEMM 2 1.03x) and 1.05x at 2048, but only 1.01x at M = 32, where the relative
# error against float64 grows from 5.2e-5 to 2.7e-3 (at 8192: 4.5e-3 -> 4.8e-3, the activation quantization
# dominates). So decode sizes (the tile tables' decode buckets, <= 256 tokens) keep float32 rows.
SLOT_DTYPE: torch.dtype = torch.bfloat16
SLOT_HALF_FROM_TOKENS = 257
_HALF_DTYPES = (torch.bfloat16, torch.float16)
SLOT_DTYPES = (torch.float32,) + _HALF_DTYPES  # what `moe_combine` reads


def slot_dtype_for(x_dtype: torch.dtype, num_tokens: int, slot_dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """dtype of out_slots for num_tokens tokens of activations of x_dtype. slot_dtype None: float32 below
    SLOT_HALF_FROM_TOKENS tokens, else SLOT_DTYPE, where a 16-bit value stands for x's own 16-bit dtype (float32 rows
    for other x). Given: torch.float32, or x_dtype when that is bf16 / fp16; anything else raises ValueError naming
    those."""
    half_x = x_dtype in _HALF_DTYPES
    if slot_dtype is None:
        half = half_x and SLOT_DTYPE in _HALF_DTYPES and num_tokens >= SLOT_HALF_FROM_TOKENS
        return x_dtype if half else torch.float32
    if slot_dtype == torch.float32 or (half_x and slot_dtype == x_dtype):
        return slot_dtype
    offers = "torch.float32" + (f" or {x_dtype} (x's dtype)" if half_x else " (x is not bf16 / fp16)")
    raise ValueError(f"slot_dtype {slot_dtype} with x {x_dtype}: ladle offers None (float32 below "
                     f"{SLOT_HALF_FROM_TOKENS} tokens, else SLOT_DTYPE), {offers}")


@triton.jit
def _moe_combine_kernel(slots_ptr, pos_ptr, wt_ptr, out_ptr, T, H, K: tl.constexpr, BT: tl.constexpr,
                        BH: tl.constexpr, GATHER: tl.constexpr):
    """Program (token block, H block): out[t, h] = (((s[t*K] + s[t*K+1]) + ...) + s[t*K+K-1])[h], fp32 (16-bit slots
    upcast exactly on load), rounded to out's dtype by `round_to` (round to nearest even, under the interpreter
    too). GATHER: slot i of token t is row pos[t*K+i] of the rows, times its routed weight wt[t*K+i] (fp32), i.e.
    s[t*K+i] = wt[t*K+i] * rows[pos[t*K+i]]. The K loads of a tile are unrolled (K constexpr) so they are all in
    flight at once."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    t_ok = offs_t < T
    ok = t_ok[:, None] & (offs_h < H)[None, :]
    flat = offs_t.to(tl.int64) * K
    for i in tl.static_range(K):
        if GATHER:
            row = tl.load(pos_ptr + flat + i, mask=t_ok, other=0).to(tl.int64)
            wt = tl.load(wt_ptr + flat + i, mask=t_ok, other=0.0)
            s = tl.load(slots_ptr + row[:, None] * H + offs_h[None, :], mask=ok, other=0.0,
                        eviction_policy="evict_first").to(tl.float32) * wt[:, None]
        else:
            s = tl.load(slots_ptr + (flat + i)[:, None] * H + offs_h[None, :], mask=ok, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
        if i == 0:
            acc = s
        else:
            acc += s
    out = out_ptr + offs_t.to(tl.int64)[:, None] * H + offs_h[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(out, round_to(acc, dt).to(dt), mask=ok)


def combine_tile(num_tokens: int) -> tuple[int, int, int]:
    """(BT tokens, BH columns, num_warps) per program of `_moe_combine_kernel`: 1 x 1024, 4 warps up to 256 tokens
    (decode: enough programs for the SMs); 2 x 512, 8 warps above (prefill). H200 sweep (session 6, call 8,
    benchmarks/results/round6/scripts/g8_combine_sweep.py; T = 8192, k = 5, H = 6144, fp32 -> bf16): 2 x 512 / 8
    warps 284 us (3.9 TB/s over the bytes read + written), the first choice 4 x 1024 / 4 warps 498 us."""
    return (1, 1024, 4) if num_tokens <= 256 else (2, 512, 8)


def moe_combine_triton(out_slots: torch.Tensor, num_tokens: int, k: int, out_dtype: torch.dtype,
                       block_t: Optional[int] = None, block_h: Optional[int] = None,
                       positions: Optional[torch.Tensor] = None,
                       weights: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out_slots [T*k, H] float32, bfloat16 or float16 contiguous (row t*k + i: slot i of token t) -> [T, H] in
    out_dtype, one pass; written into `out` when given ([T, H] contiguous, out_dtype: e.g. a row range of the
    caller's output, so a chunked MoE needs no copy) and returned. Each slot is upcast to fp32 (exact) and the
    slots are summed in the fixed order ((s0 + s1) + s2) + ... in fp32 (no FMA, no atomics), then rounded once to
    out_dtype (round to nearest even), so the result is deterministic and bitwise equal to that sequential fp32
    loop done in torch on out_slots.float().
    16-bit slots: GEMM 2 rounded each slot once to the slot dtype (nearest even, unit roundoff u_s = 2^-8 bf16,
    2^-11 fp16: |r_i - s_i| <= u_s |s_i|; fp16 also adds <= 2^-25 absolute below 2^-14 and overflows past 65504),
    so against the exact slots s_i the sum before the final rounding is within (u_s + (k-1) 2^-24 (1 + u_s)) S,
    S = sum_i |s_i|; float32 slots: (k-1) 2^-24 S. Against `moe_combine_ref` (torch's sum, whose pairing of the
    slots depends on device and shape: on the CPU it is this sequential order for some shapes, not for others):
    equal values (torch.equal; a zero's sign may differ, torch starts from +0) for k <= 2, else equal up to fp32
    summation order, |diff| <= 2 (k-1) 2^-24 sum_i |slot i as stored| before the one rounding to out_dtype.
    Gathered form (positions and weights both given): out_slots is [R, H] rows in any order (GEMM 2's aligned rows,
    R >= T*k), positions [T*k] int32 the row of each slot (`aligned_positions`) and weights [T, k] fp32 the routed
    weights: slot t*k + i is weights[t, i] * float(out_slots[positions[t*k + i]]) (one fp32 product, then the same
    sequential sum; the product adds one fp32 rounding per slot, none where the GPU compiler fuses it into the add
    as an FMA, so the "no FMA" above holds for the plain form only).
    block_t / block_h override `combine_tile`. No host sync: CUDA-graph capturable."""
    T, H = num_tokens, out_slots.shape[1]
    gather = positions is not None
    assert gather == (weights is not None), "positions and weights go together"
    assert out_slots.dtype in SLOT_DTYPES and out_slots.is_contiguous() and out_slots.dim() == 2
    if gather:
        assert positions.shape == (T * k,) and positions.dtype == torch.int32 and weights.shape == (T, k)
        assert weights.dtype == torch.float32 and out_slots.shape[0] >= T * k
    else:
        assert out_slots.shape == (T * k, H)
    if out is None:
        out = torch.empty((T, H), dtype=out_dtype, device=out_slots.device)
    assert out.shape == (T, H) and out.dtype == out_dtype and out.is_contiguous(), (out.shape, out.dtype)
    if T == 0:
        return out
    bt, bh, warps = combine_tile(T)
    bt, bh = block_t or bt, block_h or bh
    pos, wt = (positions, weights.contiguous()) if gather else (out_slots, out_slots)  # unused pointers when not
    _moe_combine_kernel[(triton.cdiv(T, bt), triton.cdiv(H, bh))](out_slots, pos, wt, out, T, H, K=k, BT=bt, BH=bh,
                                                                   GATHER=gather, num_warps=warps)
    return out


def moe_combine_ref(out_slots: torch.Tensor, num_tokens: int, k: int, out_dtype: torch.dtype,
                    positions: Optional[torch.Tensor] = None, weights: Optional[torch.Tensor] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference: out_slots [T*k, H] float32 / bf16 / fp16 -> [T, H] =
    out_slots.float().view(T, k, H).sum(dim=1).to(out_dtype) (16-bit slots upcast first: an fp32 sum, as the
    kernel; the pairing of torch's sum as in `moe_combine_triton`'s doc). Gathered form (positions, weights): the
    slots are weights[t, i] * out_slots[positions[t*k + i]].float() (`moe_combine_triton`). `out`: copied into
    and returned, as the kernel's."""
    if positions is not None:
        slots = out_slots[positions.long()].float() * weights.float().reshape(-1, 1)
    else:
        slots = out_slots.float()
    return into(out, slots.view(num_tokens, k, out_slots.shape[1]).sum(dim=1).to(out_dtype))


def into(out: Optional[torch.Tensor], result: torch.Tensor) -> torch.Tensor:
    """`result`, or `out` with result copied into it when the caller gave one (the `out=` of the MoE ops whose path
    computes a fresh tensor: the torch references, and the kernels that do not write into it)."""
    return result if out is None else out.copy_(result)


def aligned_positions(sorted_ids: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of moe_align's sorted_token_ids: positions [numel] int32, positions[sorted_ids[p]] = p for every
    aligned row p holding a pair (the padding rows' sentinel numel lands in a spare entry that is dropped). Every
    pair has exactly one row, so each entry is written once: deterministic, no host sync."""
    pos = torch.empty(numel + 1, dtype=torch.int32, device=sorted_ids.device)
    rows = torch.arange(sorted_ids.numel(), dtype=torch.int32, device=sorted_ids.device)
    return pos.scatter_(0, sorted_ids.long(), rows)[:numel]


def moe_combine(out_slots: torch.Tensor, num_tokens: int, k: int, out_dtype: torch.dtype, *,
                use_triton: bool, positions: Optional[torch.Tensor] = None,
                weights: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dispatching entry point of the combine over the k slots (records op "moe_combine", bucket = tokens); the
    fused MoE launchers call it with use_triton=True. positions / weights: the gathered form (`moe_combine_triton`);
    out: the [T, H] tensor to write (`moe_combine_triton`). Fallback: `moe_combine_ref`."""
    reason: Optional[str] = triton_ok(out_slots)
    if reason is None and not out_slots.is_contiguous():
        reason = "out_slots not contiguous"
    if decide_triton(OP_COMBINE, num_tokens, use_triton, reason):
        return moe_combine_triton(out_slots, num_tokens, k, out_dtype, positions=positions, weights=weights, out=out)
    return moe_combine_ref(out_slots, num_tokens, k, out_dtype, positions, weights, out)


def swigluoai_ref(gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLU_ALPHA,
                  limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit) (design/minimax_m3.md §3.6)."""
    g = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1.0) * g * torch.sigmoid(alpha * g)


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT, compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference: per expert, dense math in `compute_dtype` (float64 for tests), result in x.dtype."""
    T, H = x.shape
    I = w13.shape[1] // 2
    xc = x.to(compute_dtype)
    out = torch.zeros((T, H), dtype=compute_dtype, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w = w13[e].to(compute_dtype)
        h = swigluoai_ref(xc[tok] @ w[:I].T, xc[tok] @ w[I:].T, alpha, limit)
        y = h @ w2[e].to(compute_dtype).T
        out.index_add_(0, tok, y * topk_weights[tok, slot].to(compute_dtype)[:, None])
    return out.to(x.dtype)


@timed_op
def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT, *, use_triton: bool = True,
) -> torch.Tensor:
    """Dispatching entry point (records op "fused_moe"); the fallback is the float32 reference."""
    reason = fused_moe_ineligible(x, w13)
    run_fast = decide_triton(OP, x.shape[0], use_triton, reason)
    if run_fast:
        return fused_moe_triton(x, w13, w2, topk_ids, topk_weights, alpha, limit)
    return fused_moe_ref(x, w13, w2, topk_ids, topk_weights, alpha, limit, compute_dtype=torch.float32)
