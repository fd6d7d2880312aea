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
K loop (options `Fp8MoEOptions`, table FP8_MOE_OPTIONS by local M, `select_options`). Triton 3.6 on sm_90 makes a
wgmma whose result is scaled before the add synchronous (a wait for 0 pending right after it; only a dot chained
into its own loop-carried accumulator stays in flight), so every K step is issue -> wait -> promote; the options
change how much work each such step carries and how many CTAs share an SM to hide the waits:
  gu_dot    GEMM 1 as one [BK, 2*BN1] dot per step instead of a gate and an up dot: the weight tile's column 2j is
            gate row n_j and 2j + 1 up row I + n_j, gathered by the load's row pointers (the stored w13 layout is
            unchanged, so loaders and reference need nothing); the epilogue splits the [BM, 2*BN1] accumulator
            with reshape [BM, BN1, 2] + split (a register-local split of the MMA layout's column pairs);
  k_unroll  2 K steps per loop iteration (half the loop's barriers; an odd tail loads zeros; each dot still waits
            at once, the rule above holds inside the unrolled body too);
  max_regs  Triton's maxnreg: the round-3 prefill kernel compiles to 255 registers per thread (ptxas, sm_90a),
            which allows 2 CTAs of 4 warps per SM (1 of 8 warps: why BM 128 / 8 warps lost the round-3 sweep);
  block_scales  one gate and one up weight scale per K step (row 0 of the tile's 128-row blocks, two scalar loads)
            instead of a [BN] vector of scales per step: the per-column scale pointers and the loads staged ahead
            cost about 60 registers per thread. Exact only when the row-expanded scales are equal over each 128-row
            block (128x128-block checkpoints and `quantize_fp8_rows`; not MXFP8, refused there) and the tiles do not
            cross a block (BN1, BN2 dividing 128, I a multiple of 128; refused otherwise). The FP8 MoE quant method
            (ladle/quant/fp8_moe.py) checks `block_scales_uniform` on its tables once and passes block_uniform,
            which selects the "fp8_block" rows of MOE_TILES / FP8_MOE_OPTIONS.
            ptxas (sm_90a, offline) for BM 64 / 8 warps / 3 stages: GEMM 1 gate+up 168 -> 120 registers, GEMM 2
            (BN2 128) 172 -> 124, so 2 CTAs (16 warps) per SM instead of 1 (as of round 9). Session 13
            (benchmarks/fp8_moe_sm90_resources.py): the served GEMM 2 (BN2 128, 4 stages, 4 column tiles, bf16
            slot rows) had grown to 238 registers, 1 CTA per SM, while GEMM 1 kept 120 and 2; its epilogue now
            loads the tile's slots and routed weights after the K loop (`_store_gemm2_tile`): 128 registers, no
            spills, 2 CTAs per SM. H200, round 14 (benchmarks/gpu_fp8_moe_prefill_ab.py): GEMM 2 1,199 -> 1,099-1,160
            us at M = 8192 and 4,195 -> ~3,950 at 32768 (round 12's run on another machine), so occupancy was not
            what holds it at about half of GEMM 1's rate (results/round14/README.md).
EVEN_K (K a multiple of BK * k_unroll, true for M3) drops the K masks of the loads.
Gluon GEMM 2 (gemm2_gluon, `_fp8_gemm2_gluon_kernel`, sm_90 only): Gluon (triton.experimental.gluon, Triton's
explicit-layout dialect) exposes the wgmma wait count, so its K loop keeps one wgmma in flight while the previous
K step is promoted, and its operands come by TMA into a ring of shared-memory slots (no per-step address
arithmetic: the cost that held the Triton GEMM 2 at about half of GEMM 1's rate, results/round15/README.md). Its
rows are bitwise the Triton aligned loop's on the H200 (round 16); that loop runs wherever Gluon cannot (the CPU
interpreter, other GPUs; with the 128-row tile it spills there). A Gluon GEMM 1 of the same structure ran no faster
than the Triton GEMM 1 (round 16, call 2) and is not kept.
The reference `fused_moe_fp8_ref` dequantizes both operands at the same points (x and the intermediate quantized
by `act_quant_ref`) and runs the per-expert math of `fused_moe_ref`, so it differs from the kernel only by
summation order (and by the intermediate's rounding to x.dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from ladle.kernels._common import MAX_TOKENS, decide_triton, interpreting, round_to, tile_row, tl, triton, triton_ok
from ladle.kernels.fp8_gemm import fp8_dot, fp8_dot_step, load_weight_scale, weight_group
from ladle.kernels.fp8_quant import FP8_DTYPE, act_quant, act_quant_ref, dequant_block_fp8
from ladle.kernels.fused_moe import (SWIGLU_ALPHA, SWIGLU_LIMIT, MoETileConfig, aligned_positions, check_routing,
                                     into, moe_combine, moe_launch_plan, moe_tile_cols, moe_tile_rows, slot_dtype_for,
                                     store_slot_rows, store_swigluoai, swigluoai_ref)
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

try:  # Gluon (Triton's explicit-layout dialect, triton.experimental.gluon in Triton 3.6): the sm_90 GEMM 2 below
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # pragma: no cover - Triton without Gluon, or no Triton: the Triton loops run instead
    HAS_GLUON = False

OP = "fused_moe_fp8"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); fp8 e4m3 expert weights + [rows, K/128] fp32 scales")
GLUON_OP = "fp8_moe_gemm2_gluon"
dispatch.register(GLUON_OP, "gluon", "Fp8MoEOptions.gemm2_gluon on an sm_90 CUDA device (not the interpreter), "
                                     "Triton with Gluon, BM 64 or 128, I a multiple of 128, H a multiple of BN2 x "
                                     "column tiles")


@dataclass(frozen=True)
class Fp8MoEOptions:
    """K-loop and launch options of both FP8 GEMMs (module doc "K loop"): gu_dot runs GEMM 1's gate and up tiles as
    one [BK, 2*BN1] dot (weight columns interleaved gate / up per output column); k_unroll (1 or 2) K steps per loop
    iteration; max_regs caps the registers per thread (Triton's `maxnreg`, None: the compiler's choice) so that
    more CTAs fit on an SM; block_scales: the caller states that the row-expanded fp32 weight scales are equal over
    every 128-row block (128x128-block checkpoints, `quantize_fp8_rows`), so a tile reads one gate and one up scale
    per K step instead of a scale per column (module doc; refused for E8M0 scales and tiles that cross a block);
    gemm2_n_tiles: GEMM 2 programs own that many consecutive BN2-wide column tiles of one row tile and walk them in
    one flattened (tile, K step) loop, storing each tile when its last K step is done (round 10: GEMM 2 has only
    I/128 = 6 K steps at one TP4 rank, so each program's pipeline fill is a large part of its life; k_unroll 1);
    gemm2_aligned (with block_scales, k_unroll 1): GEMM 2 writes its rows in the aligned order (row p of the
    [P, H] output is aligned row p, routed weight not applied) through a block pointer, so its epilogue loads
    neither slots nor routed weights, and its K loop offsets one hoisted weight-pointer tile by a scalar;
    `moe_combine` then gathers each slot's row and applies its weight (`aligned_positions`);
    gemm2_gluon (with gemm2_aligned): on an sm_90 GPU those aligned rows come from the Gluon kernel
    `_fp8_gemm2_gluon_kernel` (TMA operand ring, one wgmma in flight during the promotion; op GLUON_OP records
    configured / eligible / executed); elsewhere (CPU interpreter, other GPUs) from the Triton loop, the same math.
    (Round 16 also measured, and did not keep: a Gluon GEMM 1 of the same structure, commit 8842ee4; the Gluon GEMM 2
    at 64-row tiles under the 128-row plan, commit a1d4b30; results/round16/README.md.)"""

    gu_dot: bool = False
    k_unroll: int = 1
    max_regs: Optional[int] = None
    block_scales: bool = False
    gemm2_n_tiles: int = 1
    gemm2_aligned: bool = False
    gemm2_gluon: bool = False

    def __post_init__(self):
        if self.k_unroll not in (1, 2):
            raise ValueError(f"k_unroll {self.k_unroll}: ladle offers 1 or 2")
        if self.gemm2_n_tiles not in (1, 2, 4, 8) or (self.gemm2_n_tiles > 1 and self.k_unroll != 1):
            raise ValueError(f"gemm2_n_tiles {self.gemm2_n_tiles} with k_unroll {self.k_unroll}: ladle offers 1, 2, "
                             "4 or 8 column tiles per program (more than 1 with k_unroll 1 only)")
        if self.gemm2_aligned and (not self.block_scales or self.k_unroll != 1):
            raise ValueError(f"gemm2_aligned needs block_scales (one weight scale per K step) and k_unroll 1 (got "
                             f"block_scales={self.block_scales}, k_unroll {self.k_unroll}); ladle offers "
                             "gemm2_aligned=False otherwise")
        if self.gemm2_gluon and not self.gemm2_aligned:
            raise ValueError("gemm2_gluon writes aligned rows: it needs gemm2_aligned=True; ladle offers "
                             "gemm2_gluon=False otherwise")
        if self.max_regs is not None and not (64 <= self.max_regs <= 255 and self.max_regs % 8 == 0):
            raise ValueError(f"max_regs {self.max_regs}: ladle offers None or a multiple of 8 in 64 .. 255")


# Options per weight family and M bucket, in the layout of ladle/kernels/_common.py (`tile_row`), next to the
# MOE_TILES rows of the same family (ladle/kernels/fused_moe.py). "fp8_block": fp32 scales equal over every 128-row
# block (`block_scales_uniform`), so block_scales may run; "fp8": per-row fp32 scales; "mxfp8": E8M0 (round-3 loop).
# H200, 2026-12-02 (benchmarks/gpu_fp8_moe_prefill_ab.py, results/round7/kernels/call3_fp8_moe_prefill_ab.log; TP4
# rank of M3, near-uniform routing): at M = 8192 gu+block with 8 warps 1.35x the round-3 loop (GEMM 1 1.54x, GEMM 2
# 0.97x), gu alone (4 warps, 3 stages) 1.14x; at M = 2048 1.33x / 1.09x; at M = 32 (decode tile) 1.07x / 1.02x.
# Round 10 call 4 (same script, results/round10/call4/n_tiles_ab.log, one run): GEMM 2 over 4 column tiles per
# program 1.11x / 1.16x at M = 8192 / 2048 (GEMM 2 alone), with 4 stages the op 1.08x / 1.13x; at M = 32 0.98x, so
# decode sizes keep one tile. Measured on block-uniform scales only: the "fp8" rows are unchanged. Round 15
# (results/round15/call3/fp8_moe_prefill.log, one run): GEMM 2 into aligned rows (gemm2_aligned) at M = 8192 GEMM 2
# 990.5 against 1,098.6 us (1.11x), the op with its gathering combine 2,411.8 against 2,470.6 (1.02x; call 2's probe
# of the same loop 1.31x / 1.07x). Above 8192 tokens (the 128-row tile) aligned rows gained 1.00-1.01x with GEMM 2
# at 64-row tiles under the 128-row plan, and a 128-row aligned GEMM 2 compiles to 255 registers with spills
# (benchmarks/fp8_moe_sm90_resources.py), so that bucket kept slot rows. Round 16 (results/round16/call1, one run,
# rows bitwise equal to the Triton loop's): the Gluon GEMM 2 (gemm2_gluon) at M = 8192 645.2 against 1,093.0 us
# (1.69x; the op 2,089.5 against 2,419.4, 1.16x); above 8192 with the 128-row tile 1,331.3 / 2,451.9 against
# 2,035.0 / 3,707.0 us at M = 16384 / 32768 (the op 1.14x / 1.16x), where the Triton aligned loop would spill: both
# buckets take it (off sm_90 the Triton aligned loop computes the same rows). Not kept (call 4,
# results/round16/call4, one run; the option was `gemm2_block_m`, commit a1d4b30): under the 128-row plan the Gluon
# GEMM 2 at 64-row tiles ran GEMM 2 alone at 1,146.0 / 2,213.8 against 1,339.6 / 2,455.4 us at M = 16384 / 32768
# (1.17x / 1.11x; rows equal to the Triton loop's in the GPU test), but the op at 3,999.5 / 7,644.8 against 3,938.8 /
# 7,653.0 us (0.98x / 1.00x; GEMM 1, the same kernel in both rows, moved +74 / +52 us): no gain shown where it
# counts, and no served run.
FP8_MOE_OPTIONS: dict[str, tuple[tuple[int, Fp8MoEOptions], ...]] = {
    "fp8": ((MAX_TOKENS, Fp8MoEOptions(gu_dot=True)),),
    "fp8_block": ((256, Fp8MoEOptions(gu_dot=True, block_scales=True)),
                  (MAX_TOKENS, Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=4, gemm2_aligned=True,
                                             gemm2_gluon=True))),
    "mxfp8": ((MAX_TOKENS, Fp8MoEOptions()),),
}


@triton.jit
def _act_step(a_ptrs, as_ptrs, kb, row_ok, offs_k, K, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """K step kb of the activation tile: (a [BM, BK] fp8, a_s [BM] fp32; 128-wide groups). Past K: zeros."""
    if EVEN_K:
        a = tl.load(a_ptrs + kb * BK, mask=row_ok[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb * BK // 128, mask=row_ok, other=0.0)
    else:
        k_ok = offs_k + kb * BK < K
        a = tl.load(a_ptrs + kb * BK, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb * BK // 128, mask=row_ok & (kb * BK < K), other=0.0)
    return a, a_s


@triton.jit
def _weight_scale(ws_ptrs, blk_g, blk_u, up_col, kb, col_ok, K, BK: tl.constexpr, EVEN_K: tl.constexpr,
                  E8M0: tl.constexpr, BLOCK_SCALES: tl.constexpr):
    """Weight scales [cols] fp32 of K step kb: per row from ws_ptrs [cols] + kb, or (BLOCK_SCALES: the row-expanded
    scales are equal over each 128-row block and the tile lies in one gate and one up block) two scalars, read at
    row 0 of the tile's gate block (blk_g + kb) and of its up block (blk_u + kb), placed by up_col [cols].
    Past K: 0, or 1 for E8M0."""
    if BLOCK_SCALES:
        in_k = kb * BK < K
        w_s = tl.where(up_col, tl.load(blk_u + kb, mask=in_k, other=0.0), tl.load(blk_g + kb, mask=in_k, other=0.0))
    elif EVEN_K:
        w_s = load_weight_scale(ws_ptrs + kb, col_ok, E8M0)
    else:
        w_s = load_weight_scale(ws_ptrs + kb, col_ok & (kb * BK < K), E8M0)
    return w_s


@triton.jit
def _weight_step(a, a_s, w_ptrs, w_s, kb, col_ok, offs_k, K, acc, BK: tl.constexpr, EVEN_K: tl.constexpr,
                 F32_DOT: tl.constexpr):
    """acc + one promoted K step (fp8_dot_step) of a against the weight tile w_ptrs [BK, cols] at step kb with its
    scales w_s [cols]. Past K (an odd tail of k_unroll 2) the tile loads as zeros and adds nothing."""
    if EVEN_K:
        w = tl.load(w_ptrs + kb * BK, mask=col_ok[None, :], other=0.0)
    else:
        w = tl.load(w_ptrs + kb * BK, mask=col_ok[None, :] & (offs_k + kb * BK < K)[:, None], other=0.0)
    return fp8_dot_step(a, a_s, w, w_s, acc, F32_DOT)


@triton.jit
def _fp8_gemm1_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, inter_ptr, sorted_ptr, expert_ptr, npp_ptr,
    numel, topk_cols, N_HALF, K, num_kb, num_akb, stride_we, stride_wse, alpha, limit,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E8M0: tl.constexpr, F32_DOT: tl.constexpr,
    GU_DOT: tl.constexpr, K_UNROLL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_SCALES: tl.constexpr,
):
    pid_m, offs_n, n_ok = moe_tile_cols(N_HALF, BN)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, slot, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)
    tok = (slot // topk_cols).to(tl.int64)
    offs_k = tl.arange(0, BK)
    if GU_DOT:  # weight column 2j: gate row offs_n[j], 2j + 1: up row N_HALF + offs_n[j]
        n_j = tl.reshape(tl.join(offs_n, offs_n), [2 * BN])
        up_col = tl.arange(0, 2 * BN) % 2 == 1
        rows = n_j.to(tl.int64) + up_col.to(tl.int64) * N_HALF
        cols_ok = n_j < N_HALF
    else:  # gate rows; the up tile is N_HALF rows further
        up_col = tl.arange(0, BN) < 0
        rows = offs_n.to(tl.int64)
        cols_ok = n_ok
    a_ptrs = a_ptr + tok[:, None] * K + offs_k[None, :]
    as_ptrs = as_ptr + tok * num_akb
    w_ptrs = w_ptr + e * stride_we + rows[None, :] * K + offs_k[:, None]  # [BK, BN or 2 BN]
    ws_ptrs = ws_ptr + e * stride_wse + rows * num_kb
    up, up_s = N_HALF.to(tl.int64) * K, N_HALF.to(tl.int64) * num_kb
    blk = ws_ptr + e * stride_wse + (tl.min(offs_n, 0) // 128 * 128).to(tl.int64) * num_kb  # its block's row 0
    acc = tl.zeros([BM, 2 * BN if GU_DOT else BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for kb0 in range(0, num_kb, K_UNROLL):
        for j in tl.static_range(K_UNROLL):
            kb = kb0 + j
            a, a_s = _act_step(a_ptrs, as_ptrs, kb, row_ok, offs_k, K, BK, EVEN_K)
            w_s = _weight_scale(ws_ptrs, blk, blk + up_s, up_col, kb, cols_ok, K, BK, EVEN_K, E8M0, BLOCK_SCALES)
            acc = _weight_step(a, a_s, w_ptrs, w_s, kb, cols_ok, offs_k, K, acc, BK, EVEN_K, F32_DOT)
            if not GU_DOT:
                u_s = _weight_scale(ws_ptrs + up_s, blk + up_s, blk, up_col, kb, cols_ok, K, BK, EVEN_K, E8M0,
                                    BLOCK_SCALES)
                acc_u = _weight_step(a, a_s, w_ptrs + up, u_s, kb, cols_ok, offs_k, K, acc_u, BK, EVEN_K, F32_DOT)
    if GU_DOT:
        acc_g, acc_u = tl.split(tl.reshape(acc, [BM, BN, 2]))
    else:
        acc_g = acc
    store_swigluoai(inter_ptr, offs_m, offs_n, n_ok, N_HALF, acc_g, acc_u, alpha, limit)


@triton.jit
def _store_gemm2_tile(acc, out_ptr, sorted_ptr, topk_w_ptr, offs_m, offs_n, n_ok, numel, N):
    """GEMM 2 epilogue of one [BM, BN] tile: out_slots rows of the tile's slots = routed weight x acc. The slots and
    routed weights are loaded here, after the K loop, not before it: held across the loop, the row-shaped pointers
    and weights cost GEMM 2 about 110 registers per thread (sm_90a ptxas, served prefill tile BM 64 / BN2 128 / 8
    warps / 4 stages / 4 column tiles: 238 registers, 1 CTA per SM; loaded here: 128, no spills, 2 CTAs per SM, as
    GEMM 1 runs; benchmarks/fp8_moe_sm90_resources.py)."""
    slot = tl.load(sorted_ptr + offs_m)
    row_ok = slot < numel
    wt = tl.load(topk_w_ptr + slot, mask=row_ok, other=0.0)
    store_slot_rows(out_ptr + slot[:, None].to(tl.int64) * N + offs_n[None, :], acc * wt[:, None],
                    row_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemm2_aligned_rows(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, expert_ptr, npp_ptr, N, K, num_kb, num_akb,
                        stride_we, stride_wse, P, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        F32_DOT: tl.constexpr, N_TILES: tl.constexpr, EVEN_N: tl.constexpr):
    """GEMM 2 with aligned output rows (Fp8MoEOptions.gemm2_aligned): program (row tile of BM aligned rows, N_TILES
    consecutive BN-wide column tiles): out [P, N] rows of the tile = intermediate rows @ w2[e]^T, no routed weight.
    Block scales only (one weight scale per K step: row 0 of the tile's 128-row block), K a multiple of BK. The
    activation rows are read unmasked: every aligned row < P exists, padding rows are GEMM 1's zeros and are never
    combined. The weight tile's pointers are built once; a K step adds a scalar offset (t * BN * K + kb * BK)."""
    pid_m, offs_w, _ = moe_tile_cols(N, BN * N_TILES)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * num_akb
    n0 = tl.min(offs_w, 0)  # first column of the program's first tile
    b_base = w_ptr + e * stride_we + (n0 + tl.arange(0, BN))[None, :].to(tl.int64) * K + offs_k[:, None]  # [BK, BN]
    s_base = ws_ptr + e * stride_wse + (n0 // 128 * 128).to(tl.int64) * num_kb
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BM, BN], tl.float32)
    for it in range(0, N_TILES * num_kb):  # flattened (column tile, K step), K fastest
        t = it // num_kb
        kb = it - t * num_kb
        a = tl.load(a_ptrs + kb * BK)
        a_s = tl.load(as_ptrs + kb)
        if EVEN_N:
            w = tl.load(b_base + (t * (BN * K) + kb * BK))
        else:
            w = tl.load(b_base + (t * (BN * K) + kb * BK), mask=(n0 + t * BN + tl.arange(0, BN) < N)[None, :],
                        other=0.0)
        w_s = tl.load(s_base + (t * BN) // 128 * 128 * num_kb + kb)
        acc = acc + fp8_dot(a, w, F32_DOT) * (a_s * w_s)[:, None]
        if kb == num_kb - 1:
            rows = tl.make_block_ptr(out_ptr, shape=(P, N), strides=(N, 1), offsets=(pid_m * BM, n0 + t * BN),
                                     block_shape=(BM, BN), order=(1, 0))
            if EVEN_N:
                tl.store(rows, round_to(acc, dt).to(dt))
            else:
                tl.store(rows, round_to(acc, dt).to(dt), boundary_check=(1,))
            acc = tl.zeros([BM, BN], tl.float32)


@triton.jit
def _fp8_gemm2_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
    numel, N, K, num_kb, num_akb, stride_we, stride_wse, P,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E8M0: tl.constexpr, F32_DOT: tl.constexpr,
    K_UNROLL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, N_TILES: tl.constexpr,
    ALIGNED: tl.constexpr, EVEN_N: tl.constexpr,
):
    """Program (row tile, N_TILES consecutive BN-wide column tiles): out_slots rows of the tile's slots = routed
    weight x (intermediate rows @ w2[e]^T) per column tile (Fp8MoEOptions.gemm2_n_tiles); ALIGNED: the aligned
    rows instead (`_gemm2_aligned_rows`)."""
    if ALIGNED:
        _gemm2_aligned_rows(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, expert_ptr, npp_ptr, N, K, num_kb, num_akb,
                            stride_we, stride_wse, P, BM, BN, BK, F32_DOT, N_TILES, EVEN_N)
    else:
        _gemm2_slot_rows(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
                         numel, N, K, num_kb, num_akb, stride_we, stride_wse, BM, BN, BK, E8M0, F32_DOT, K_UNROLL,
                         EVEN_K, BLOCK_SCALES, N_TILES)


@triton.jit
def _gemm2_slot_rows(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
    numel, N, K, num_kb, num_akb, stride_we, stride_wse,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E8M0: tl.constexpr, F32_DOT: tl.constexpr,
    K_UNROLL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, N_TILES: tl.constexpr,
):
    """GEMM 2 into slot rows: out_slots rows of the tile's slots = routed weight x (intermediate rows @ w2[e]^T)."""
    pid_m, offs_w, _ = moe_tile_cols(N, BN * N_TILES)
    if pid_m * BM >= tl.load(npp_ptr):
        return
    e, offs_m, _, row_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_m, numel, BM)  # slots: at the store
    offs_k = tl.arange(0, BK)
    rows = offs_m.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * K + offs_k[None, :]
    as_ptrs = as_ptr + rows * num_akb
    up_col = tl.arange(0, BN) < 0
    n0 = tl.min(offs_w, 0)  # first column of the program's first tile
    acc = tl.zeros([BM, BN], tl.float32)
    if N_TILES == 1:
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < N
        b_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]  # [BK, BN]
        bs_ptrs = ws_ptr + e * stride_wse + offs_n.to(tl.int64) * num_kb
        blk = ws_ptr + e * stride_wse + (n0 // 128 * 128).to(tl.int64) * num_kb  # its block's row 0
        for kb0 in range(0, num_kb, K_UNROLL):
            for j in tl.static_range(K_UNROLL):
                a, a_s = _act_step(a_ptrs, as_ptrs, kb0 + j, row_ok, offs_k, K, BK, EVEN_K)
                w_s = _weight_scale(bs_ptrs, blk, blk, up_col, kb0 + j, n_ok, K, BK, EVEN_K, E8M0, BLOCK_SCALES)
                acc = _weight_step(a, a_s, b_ptrs, w_s, kb0 + j, n_ok, offs_k, K, acc, BK, EVEN_K, F32_DOT)
        _store_gemm2_tile(acc, out_ptr, sorted_ptr, topk_w_ptr, offs_m, offs_n, n_ok, numel, N)
    else:
        for it in range(0, N_TILES * num_kb):  # flattened (column tile, K step), K fastest
            t = it // num_kb
            kb = it - t * num_kb
            n_t = n0 + t * BN
            offs_n = n_t + tl.arange(0, BN)
            n_ok = offs_n < N
            b_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
            bs_ptrs = ws_ptr + e * stride_wse + offs_n.to(tl.int64) * num_kb
            blk = ws_ptr + e * stride_wse + (n_t // 128 * 128).to(tl.int64) * num_kb
            a, a_s = _act_step(a_ptrs, as_ptrs, kb, row_ok, offs_k, K, BK, EVEN_K)
            w_s = _weight_scale(bs_ptrs, blk, blk, up_col, kb, n_ok, K, BK, EVEN_K, E8M0, BLOCK_SCALES)
            acc = _weight_step(a, a_s, b_ptrs, w_s, kb, n_ok, offs_k, K, acc, BK, EVEN_K, F32_DOT)
            if kb == num_kb - 1:
                _store_gemm2_tile(acc, out_ptr, sorted_ptr, topk_w_ptr, offs_m, offs_n, n_ok, numel, N)
                acc = tl.zeros([BM, BN], tl.float32)


if HAS_GLUON:

    @gluon.jit
    def _fp8_gemm2_gluon_kernel(a_desc, b_desc, out_desc, as_ptr, ws_ptr, expert_ptr, npp_ptr, N, num_kb,
                                num_akb, stride_wse, N_TILES: gl.constexpr, STAGES: gl.constexpr,
                                num_warps: gl.constexpr):
        """GEMM 2 into aligned rows on sm_90 (Fp8MoEOptions.gemm2_gluon): the math of `_gemm2_aligned_rows`, with
        the operands brought by TMA into a ring of STAGES shared-memory slots and one wgmma kept in flight while the
        previous K step is promoted. Program (row tile of BM aligned rows, N_TILES consecutive BN-wide column tiles,
        N fastest as `moe_tile_cols`); its steps j = (column tile t, K step kb), kb fastest.
        a_desc: the quantized intermediate [P, I] fp8, block [BM, BK]; b_desc: w2 viewed [E' * N, I] fp8, block
        [BN, BK]; out_desc: the aligned rows [P, N] (bf16 / fp16 / fp32), block [BM, BN]; as_ptr [P, num_akb] fp32
        activation scales; ws_ptr the row-expanded fp32 weight scales [E', N, num_kb] (block-uniform: row 0 of
        each 128-row block is read). Needs I a multiple of BK = 128 and N a multiple of BN * N_TILES (the launcher
        checks). Step j: wgmma j is issued into a fresh accumulator (use_acc=False), then `warpgroup_mma_wait(1)`
        retires wgmma j-1, whose tile is promoted acc += part * (a_s[:, None] * w_s) on the CUDA cores while wgmma
        j runs; slot (j-1) % STAGES is then free (with 8 warps after a CTA barrier: a warpgroup's wait covers only
        its own wgmma) and TMA brings step j-1+STAGES into it. A finished column tile
        goes out through shared memory by a TMA store that overlaps the next tile's steps."""
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BN, 32])
        pid = gl.program_id(0)
        num_n = gl.cdiv(N, BN * N_TILES)
        pid_m = pid // num_n
        n0 = (pid % num_n) * (BN * N_TILES)
        if pid_m * BM < gl.load(npp_ptr):
            e = gl.load(expert_ptr + pid_m)
            m0 = pid_m * BM
            b_row0 = e * N + n0
            a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
            b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
            c_smem = gl.allocate_shared_memory(out_desc.dtype, [BM, BN], out_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(STAGES):
                mbarrier.init(ready.index(s), count=1)
            nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
            steps = N_TILES * num_kb
            for j in gl.static_range(STAGES):  # prologue: steps 0 .. STAGES-1
                t = j // num_kb
                kb = j - t * num_kb
                mbarrier.expect(ready.index(j), nbytes, pred=j < steps)
                tma.async_copy_global_to_shared(a_desc, [m0, kb * BK], ready.index(j), a_smem.index(j), j < steps)
                tma.async_copy_global_to_shared(b_desc, [b_row0 + t * BN, kb * BK], ready.index(j), b_smem.index(j),
                                                j < steps)
            rows = m0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
            as_rows = as_ptr + rows.to(gl.int64) * num_akb
            ws_e = ws_ptr + e.to(gl.int64) * stride_wse
            zero = gl.zeros([BM, BN], gl.float32, layout=mma)  # each wgmma's own accumulator (use_acc=False)
            acc = gl.zeros([BM, BN], gl.float32, layout=mma)
            mbarrier.wait(ready.index(0), 0)
            prev = warpgroup_mma(a_smem.index(0), b_smem.index(0).permute((1, 0)), zero, use_acc=False,
                                 is_async=True)
            s_prev = gl.load(as_rows) * gl.load(ws_e + (n0 // 128 * 128) * num_kb)
            for j in range(1, steps):
                slot = j % STAGES
                mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
                cur = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                t = j // num_kb
                kb = j - t * num_kb
                s_cur = gl.load(as_rows + kb) * gl.load(ws_e + ((n0 + t * BN) // 128 * 128) * num_kb + kb)
                part = warpgroup_mma_wait(1, deps=[prev])  # step j-1 done, step j in flight
                acc = acc + part * s_prev[:, None]
                if kb == 0:  # step j-1 closed column tile t-1
                    tma.store_wait(0)
                    c_smem.store(acc.to(out_desc.dtype))
                    fence_async_shared()
                    tma.async_copy_shared_to_global(out_desc, [m0, n0 + (t - 1) * BN], c_smem)
                    acc = gl.zeros([BM, BN], gl.float32, layout=mma)
                if num_warps > 4:  # each warpgroup retired only its own wgmma j-1: all must have, before TMA
                    gl.thread_barrier()
                nxt = j - 1 + STAGES  # into the slot wgmma j-1 has released
                t_n = nxt // num_kb
                kb_n = nxt - t_n * num_kb
                free = (j - 1) % STAGES
                mbarrier.expect(ready.index(free), nbytes, pred=nxt < steps)
                tma.async_copy_global_to_shared(a_desc, [m0, kb_n * BK], ready.index(free), a_smem.index(free),
                                                nxt < steps)
                tma.async_copy_global_to_shared(b_desc, [b_row0 + t_n * BN, kb_n * BK], ready.index(free),
                                                b_smem.index(free), nxt < steps)
                prev = cur
                s_prev = s_cur
            part = warpgroup_mma_wait(0, deps=[prev])
            acc = acc + part * s_prev[:, None]
            tma.store_wait(0)
            c_smem.store(acc.to(out_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [m0, n0 + (N_TILES - 1) * BN], c_smem)
            tma.store_wait(0)
            for s in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(s))


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


def select_options(num_tokens: int, family: str = "fp8") -> Fp8MoEOptions:
    """The K-loop / launch options of `family`'s bucket holding num_tokens (FP8_MOE_OPTIONS)."""
    return tile_row(FP8_MOE_OPTIONS[family], num_tokens)[1]


def block_scales_uniform(w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> bool:
    """True when both expert tables' fp32 row-expanded scales ([E', rows, K groups]) are equal over every 128-row
    block (what 128x128-block checkpoints and `quantize_fp8_rows` give when the rank's rows start on a block): the
    condition of Fp8MoEOptions.block_scales. A host sync: call once per layer (its quant method keeps the answer)."""
    if w13_scale.dtype != torch.float32:
        return False
    for s in (w13_scale, w2_scale):
        e, rows, g = s.shape
        if rows % 128:
            return False
        blocks = s.view(e, rows // 128, 128, g)
        if not bool((blocks == blocks[:, :, :1]).all()):
            return False
    return True


class Fp8MoEPlan(NamedTuple):
    """Host plan of one launch (`fp8_moe_plan`): tile and options, the clipped BN1 / BN2, the weight group g (128, or
    32 for E8M0 scales), moe_align's (sorted_ids, expert_ids, num_tokens_post_padded), T tokens, k slots and the
    dtype of GEMM 2's slot rows (`slot_dtype_for`)."""

    cfg: MoETileConfig
    opt: Fp8MoEOptions
    bn1: int
    bn2: int
    g: int
    e8m0: bool
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    npp: torch.Tensor
    T: int
    k: int
    slot_dtype: torch.dtype


def fp8_moe_plan(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, config: Optional[MoETileConfig] = None,
                 options: Optional[Fp8MoEOptions] = None, block_uniform: bool = False,
                 slot_dtype: Optional[torch.dtype] = None) -> Fp8MoEPlan:
    """Check the tables and routes (module doc), pick tile / options from the local T and the weight family unless
    given, align by expert. block_uniform: the caller knows `block_scales_uniform` holds (family "fp8_block").
    slot_dtype: as `fused_moe_fp8_triton`. T must be > 0."""
    T, H, E, I = _check(x, w13, w13_scale, w2, w2_scale)
    k = check_routing(topk_ids, topk_weights, T)
    slots_dt = slot_dtype_for(x.dtype, T, slot_dtype)
    g, e8m0 = weight_group(w13_scale), w13_scale.dtype == torch.uint8
    family = "mxfp8" if e8m0 else ("fp8_block" if block_uniform and I % 128 == 0 else "fp8")
    cfg, (bn1, bn2, _, _), align = moe_launch_plan(topk_ids, E, H, I, config, g, family)
    opt = options or select_options(T, family)
    if opt.block_scales and (e8m0 or 128 % bn1 or 128 % bn2 or I % 128):
        raise ValueError(f"block_scales needs fp32 128-group scales, BN1 {bn1} and BN2 {bn2} dividing 128 and I {I} a "
                         f"multiple of 128 (got {'E8M0' if e8m0 else 'fp32'} scales); ladle offers block_scales=False")
    return Fp8MoEPlan(cfg, opt, bn1, bn2, g, e8m0, *align, T, k, slots_dt)


def fp8_moe_gemm1(plan: Fp8MoEPlan, a_q: torch.Tensor, a_s: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                  alpha: float, limit: float, out_dtype: torch.dtype) -> torch.Tensor:
    """GEMM 1 + swigluoai: a_q [T, H] fp8 / a_s [T, H/128] fp32 (op "fp8_act_quant" of x) -> intermediate [P, I]
    in out_dtype, P = plan.sorted_ids.numel() rows in aligned order."""
    (cfg, opt, bn1, _, g, e8m0, sorted_ids, expert_ids, npp, T, k, _), (H, I) = plan, (w13.shape[2], w13.shape[1] // 2)
    bm, P = cfg.block_m, sorted_ids.numel()
    inter = torch.empty((P, I), dtype=out_dtype, device=a_q.device)
    _fp8_gemm1_kernel[((P // bm) * triton.cdiv(I, bn1),)](
        a_q, a_s, w13, w13_scale, inter, sorted_ids, expert_ids, npp, T * k, k, I, H, triton.cdiv(H, g),
        a_s.shape[1], w13.stride(0), w13_scale.stride(0), float(alpha), float(limit),
        BM=bm, BN=bn1, BK=g, E8M0=e8m0, F32_DOT=interpreting(), GU_DOT=opt.gu_dot, K_UNROLL=opt.k_unroll,
        EVEN_K=H % (g * opt.k_unroll) == 0, BLOCK_SCALES=opt.block_scales,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=opt.max_regs)
    return inter


def gluon_gemm2_reason(i_q: torch.Tensor, g: int, bm: int, H: int, I: int, n_cols: int) -> Optional[str]:
    """Why `_fp8_gemm2_gluon_kernel` cannot run here (None: it can): it needs Triton with Gluon, an sm_90 CUDA device
    outside the interpreter, 128-wide K groups with I a multiple of them, BM 64 or 128 (one warpgroup of 4 warps per
    64 rows) and H a multiple of the program's n_cols columns (BN2 x column tiles)."""
    if not HAS_GLUON:
        return "triton without gluon"
    if i_q.device.type != "cuda" or interpreting():
        return "not a cuda device (gluon does not run under the interpreter)"
    if torch.cuda.get_device_capability(i_q.device) != (9, 0):
        return f"compute capability {torch.cuda.get_device_capability(i_q.device)} (needs sm_90)"
    if g != 128 or I % 128 or bm not in (64, 128) or H % n_cols:
        return f"shape: group {g}, I {I}, BM {bm}, H {H} with {n_cols} columns per program"
    return None


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32} if HAS_GLUON else {}


def _nvmma(block: list, dtype):
    """The NVMMA shared layout Gluon's TMA and wgmma take for a block of `dtype` (128-byte swizzle for fp8 x 128)."""
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


def compile_gemm2_gluon_sm90(bm: int, bn2: int, n_tiles: int, stages: int, out_dtype: torch.dtype = torch.bfloat16):
    """Compile `_fp8_gemm2_gluon_kernel` for sm_90a without a GPU (Triton's ptxas): the CPU test's check that the
    kernel builds and keeps one wgmma in flight, and benchmarks/fp8_moe_sm90_resources.py's register / shared-memory
    table. Works with TRITON_INTERPRET=1 set, but not in a process where a kernel has already run under the
    interpreter (that leaves Triton's language patched), so the CPU test compiles in a fresh subprocess. Returns
    Triton's compiled kernel (asm["ptx"], metadata.shared)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    g, fp8 = 128, gl.float8e4nv
    a = TensorDescriptor.from_tensor(torch.empty(bm, g, dtype=FP8_DTYPE), [bm, g], _nvmma([bm, g], fp8))
    b = TensorDescriptor.from_tensor(torch.empty(bn2, g, dtype=FP8_DTYPE), [bn2, g], _nvmma([bn2, g], fp8))
    o = TensorDescriptor.from_tensor(torch.empty(bm, bn2, dtype=out_dtype), [bm, bn2],
                                     _nvmma([bm, bn2], _GL_DTYPES[out_dtype]))
    f32, i32 = torch.empty(1), torch.empty(1, dtype=torch.int32)
    fn = _fp8_gemm2_gluon_kernel
    sig = {n: mangle_type(v) for n, v in zip(fn.arg_names, (a, b, o, f32, f32, i32, i32, 1, 1, 1, 1))}
    consts = {"N_TILES": n_tiles, "STAGES": stages, "num_warps": bm // 16}
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(GluonASTSource(fn, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": bm // 16})


def fp8_moe_gemm2(plan: Fp8MoEPlan, i_q: torch.Tensor, i_s: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                  topk_weights: torch.Tensor) -> torch.Tensor:
    """GEMM 2 x routed weight: i_q [P, I] fp8 / i_s [P, I/128] fp32 (the quantized intermediate) -> out_slots
    [T*k, H] in plan.slot_dtype (row t*k + i: slot i of token t; `moe_combine` sums them). With
    plan.opt.gemm2_aligned: the aligned rows [P, H] instead, routed weight not applied (`fp8_moe_combine`)."""
    (cfg, opt, _, bn2, g, e8m0, sorted_ids, expert_ids, npp, T, k, slots_dt), (H, I) = plan, (w2.shape[1], w2.shape[2])
    bm, P = cfg.block_m, sorted_ids.numel()
    out = torch.empty((P if opt.gemm2_aligned else T * k, H), dtype=slots_dt, device=i_q.device)
    n_cols = bn2 * opt.gemm2_n_tiles
    if opt.gemm2_gluon and dispatch.decide(GLUON_OP, dispatch.tokens_bucket(T), configured=True,
                                           ineligible_reason=gluon_gemm2_reason(i_q, g, bm, H, I, n_cols)):
        a_desc = TensorDescriptor.from_tensor(i_q, [bm, g], _nvmma([bm, g], gl.float8e4nv))
        b_desc = TensorDescriptor.from_tensor(w2.view(-1, I), [bn2, g], _nvmma([bn2, g], gl.float8e4nv))
        o_desc = TensorDescriptor.from_tensor(out, [bm, bn2], _nvmma([bm, bn2], _GL_DTYPES[slots_dt]))
        _fp8_gemm2_gluon_kernel[((P // bm) * (H // n_cols),)](
            a_desc, b_desc, o_desc, i_s, w2_scale, expert_ids, npp, H, I // g, i_s.shape[1], w2_scale.stride(0),
            N_TILES=opt.gemm2_n_tiles, STAGES=cfg.num_stages, num_warps=bm // 16)
        return out
    _fp8_gemm2_kernel[((P // bm) * triton.cdiv(H, bn2 * opt.gemm2_n_tiles),)](
        i_q, i_s, w2, w2_scale, out, sorted_ids, expert_ids, npp, topk_weights.contiguous(), T * k, H, I,
        triton.cdiv(I, g), i_s.shape[1], w2.stride(0), w2_scale.stride(0), P,
        BM=bm, BN=bn2, BK=g, E8M0=e8m0, F32_DOT=interpreting(), K_UNROLL=opt.k_unroll,
        EVEN_K=I % (g * opt.k_unroll) == 0, BLOCK_SCALES=opt.block_scales, N_TILES=opt.gemm2_n_tiles,
        ALIGNED=opt.gemm2_aligned, EVEN_N=H % (bn2 * opt.gemm2_n_tiles) == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=opt.max_regs)
    return out


def fp8_moe_combine(plan: Fp8MoEPlan, gemm2_out: torch.Tensor, topk_weights: torch.Tensor,
                    out_dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`moe_combine` of GEMM 2's output (`fp8_moe_gemm2`): the slot rows, or with plan.opt.gemm2_aligned the
    aligned rows gathered by `aligned_positions` and weighted by topk_weights [T, k] fp32 -> [T, H] in out_dtype,
    written into `out` when given (`moe_combine_triton`)."""
    if plan.opt.gemm2_aligned:
        return moe_combine(gemm2_out, plan.T, plan.k, out_dtype, use_triton=True,
                           positions=aligned_positions(plan.sorted_ids, plan.T * plan.k), weights=topk_weights,
                           out=out)
    return moe_combine(gemm2_out, plan.T, plan.k, out_dtype, use_triton=True, out=out)


def fused_moe_fp8_triton(
    x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT,
    config: Optional[MoETileConfig] = None, options: Optional[Fp8MoEOptions] = None, block_uniform: bool = False,
    slot_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """x [T, H] float, w13/w2 fp8 with scales (module doc), topk_ids [T, k] int32 rows of the tables,
    topk_weights [T, k] fp32 -> [T, H] in x.dtype. config / options override the tile and option tables;
    block_uniform: `block_scales_uniform(w13_scale, w2_scale)` is known to hold (the "fp8_block" rows).
    slot_dtype: dtype of GEMM 2's per-slot rows (ladle/kernels/fused_moe.py `slot_dtype_for`; None: SLOT_DTYPE).
    out: [T, H] contiguous in x.dtype that the combine writes (FusedMoE passes its chunk's rows), returned.
    Each stage's input is released once the next stage has it: the quantized x after GEMM 1, the bf16
    intermediate after its quantization, the quantized intermediate after GEMM 2. So the combine (the op's peak,
    beside GEMM 2's [P, H] rows) no longer holds them: at a 16384-token chunk of one TP4 rank of M3 (H 6144, I 768,
    P <= 98.3K aligned rows) 100.7 + 151.0 + 75.5 MB by the byte count (not measured on a GPU), and with `out`
    the combine's own [T, H] result (201 MB there) is not allocated either. No host sync; shapes fixed by
    (T, k, E', H, I)."""
    if x.shape[0] == 0:
        _check(x, w13, w13_scale, w2, w2_scale)
        check_routing(topk_ids, topk_weights, 0)
        slot_dtype_for(x.dtype, 0, slot_dtype)
        return into(out, torch.empty_like(x))
    plan = fp8_moe_plan(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, config, options, block_uniform,
                        slot_dtype)
    inter = fp8_moe_gemm1(plan, *act_quant(x.contiguous(), use_triton=True), w13, w13_scale, alpha, limit, x.dtype)
    i_q, i_s = act_quant(inter, use_triton=True)
    del inter
    rows = fp8_moe_gemm2(plan, i_q, i_s, w2, w2_scale, topk_weights)
    del i_q, i_s
    return fp8_moe_combine(plan, rows, topk_weights, x.dtype, out)


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
    *, use_triton: bool = True, block_uniform: bool = False, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dispatching entry point (records op "fused_moe_fp8", bucket = tokens); the fallback is the float32
    reference. block_uniform, out: as `fused_moe_fp8_triton` (the fallback copies into out)."""
    if decide_triton(OP, x.shape[0], use_triton, triton_ok(x, w13)):
        return fused_moe_fp8_triton(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, alpha, limit,
                                    block_uniform=block_uniform, out=out)
    return into(out, fused_moe_fp8_ref(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, alpha, limit,
                                       compute_dtype=torch.float32))
