"""Decode path of the W4A16 MXFP4 fused MoE (op "fused_moe_mxfp4_decode"): "swap AB" with the dequantised weight
tile as the wgmma A operand in registers, one 32-group per MMA pair, the E8M0 scale applied to the fp32 group
partial. Same tables, routing and outputs as the wide-K-step kernels of ladle/kernels/fused_moe_mxfp4.py (format
there); chosen by `fused_moe_mxfp4_triton` at <= DECODE_MAX_TOKENS tokens (bf16 activations, or float32 under the
interpreter), which records the choice under this op name in ladle.observe.dispatch.

Why (offline sm_90 compiles, benchmarks/offline_sass_mxfp4.py: Triton 3.6 -> ptxas 13.0 for cuda:90 with the
launch's constexprs, cuobjdump of the cubin; "per element" = the inner loop's SASS count x threads / weight
elements per iteration; the memory-time budget at 4.2 TB/s over 132 SMs is ~3.5 per element).
  wide kernel (fused_moe_mxfp4.py; decode tiles GEMM 1 16 x 32, GEMM 2 16 x 64, BK 128): 9.1 per element with
      its default f32 dequant, 7.1 with dequant="bf16"; the TTGIR puts every dequantised tile through shared
      memory (GEMM 2: 9 local_alloc + local_load per step; STS 16 + LDSM 8 + BAR 8 per iteration): mma.sync
      wants both operands in its register layout, the bits are computed in a blocked layout. H200: 20% of copy
      bandwidth at M = 32 / 128 (benchmarks/results/round4/mxfp4_ab.log).
  swap AB on the wide kernel's words (out^T = W x^T, weights the A [64, K] of m64n16k16 wgmma): 8.7 -- still a
      shared-memory round trip. Triton (OptimizeDotOperands, MMAv3 hoisting) moves the A-operand layout
      conversion up to the load only when the chain from ONE load has no narrowing op (int32 word -> bf16 half
      `trunci` blocks it), no second load (a scale tile multiplied in blocks it: tried u8 -> i16 -> bf16 bits,
      uitofp, integer exponent add) and any inline asm in it is pure and unary.
  this kernel: bytes [BN, 16] (one 32-group of BN rows) -> pure unary inline PTX (pack 2: two bytes in, two bf16
      out, nibble J of each) -> wgmma A in registers (TTGIR: no local_alloc of a dequantised tile; the packed
      bytes are the only A-side local_load), at first two K = 16 dots per group (even / odd elements; one dot
      since session 9, "Waits" below), the fp32 partial x 2^(s - 127) added to the accumulator. BN 64, BT 16,
      4 warps, 3 stages, no spills (two dots):
          groups per iteration G     2     4 (default)  8
          GEMM 2 per element       6.3     5.8          5.4   (58 / 60 / 68 registers; 10 / 20 / 40 KB smem)
          GEMM 1 per element       5.6     5.1          4.9   (66 / 75 / 83 registers)
      BN 128 with 4 warps loses the hoist (convert_layout + STS again: 8.9 / 8.6); with 8 warps (one warpgroup
      per 64 rows) it keeps it: GEMM 2 5.4, GEMM 1 5.0 (G 4; an A/B row). Dequant per two elements: PRMT (shared by both
      nibbles) + LOP3 + IMAD + LOP3 + HMUL2 (`nibble_asm`: one multiply places magnitude and sign, 2.1 per
      element) + FFMA 0.5 per element (the group scale on the [64, 16] partial, as cheap as scaling the tile).
      The rest: the byte tile's LDS, the x tiles' cp.async, a wgmma wait per dot (the partial feeds the FFMA),
      descriptors, scale loads.
  Waits: every warp_group_dot gets a warp_group_dot_wait {pendings = 0} right after it (SASS: WARPGROUP.DEPBAR
      after each HGMMA, GEMM 2 G 2: 4 per iteration): Triton's WGMMA pipeliner keeps a dot async only when its
      result feeds the loop's yield alone; here the pair's second dot and the scale FFMA read it. The kernel
      now joins the two nibble tiles (join + permute + reshape, no data movement, hoist kept) into one K =
      32 dot whose two HGMMAs issue back to back: one wait per group. Per element, G 2 / 4 / 8: GEMM 2 5.84 / 5.33 /
      4.93, GEMM 1 5.36 / 4.80 / 4.63 (56 / 47 / 57 and 66 / 73 / 88 registers, same smem, no spills). Deferring
      the last group's FFMA to the next iteration (its dot then async) halves the waits again in the TTGIR, but
      ptxas serialised the wgmmas (C7514: accumulator registers read inside the pipeline stage) at G 2 / 4 when
      written for any G: not kept.
  Not reached: the 3.5 budget. A 16-bit packed tile (two bytes per element of the hoisted load) measured 4.3
      per element offline before its scale, but needs each dot inside one 32-group: a layout re-laid at load
      (halfword = the same byte of two groups) that every reader of the tables would have to follow; not done.
      Whether 5.8 is enough is for the H200 to say (the wide kernel's 7.1 ran at 20%, so the count is not the
      whole story): benchmarks/gpu_mxfp4_decode_ab.py.
Activations: row 16 J + c of group g's B tile is x[t, 32 g + 2 c + J] (c < 16); the launcher passes x
de-interleaved per 32-group ([even 16 | odd 16]; one small copy of x [T, H]) and GEMM 1 stores the intermediate in
the same order, so the B tile is 32 contiguous rows that the pipeliner streams with cp.async.
Exactness: each dequantised element is E2M1 exactly (bits x 2^-126 x 2^126 in bf16, subnormals kept: the H200 run
of the bf16 dequant matched f32, round4/mxfp4_ab.log); products and sums in the fp32 accumulator; the power-of-two
scale exact unless the partial over- or underflows float32. Against `fused_moe_mxfp4_ref`: summation order only.
The interpreter has no inline asm: there (ASM False) the same nibble is placed into float32 bits by Triton ops
(tests/quant/test_mxfp4_decode.py also replays the PTX bit steps in Python for every byte).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ladle.kernels._common import interpreting, tl, triton
from ladle.kernels.fp8_quant import MX_GROUP
from ladle.kernels.fused_moe import (MoETileConfig, moe_combine, moe_launch_plan, moe_tile_cols, moe_tile_rows,
                                     slot_dtype_for, store_slot_rows, store_swigluoai)
from ladle.observe import dispatch

OP_DECODE = "fused_moe_mxfp4_decode"
DECODE_MAX_TOKENS = 64  # decode sizes: ~1-2 rows per routed expert at top-4 over 128 experts
dispatch.register(OP_DECODE, "triton-swapab", f"W4A16 at <= {DECODE_MAX_TOKENS} tokens; bf16 (or float32) "
                  "activations; cuda sm_90+ (or cpu+TRITON_INTERPRET)")

# Nibble J of the bytes at bits 0-7 and 16-23: (mask keeping it, multiplier adding two shifted copies -- magnitude
# to bits 6-8 / 22-24, sign to 15 / 31 -- that do not overlap, so the product has no carries into the kept bits)
NIBBLE_MASK_MUL = ((0x000F000F, (1 << 6) + (1 << 12)), (0x00F000F0, (1 << 2) + (1 << 8)))
NIBBLE_KEEP = 0x81C081C0  # sign and magnitude bits of two bf16 halves
_TWO_POW_126: tl.constexpr = tl.constexpr(8.507059173023462e37)


@dataclass(frozen=True)
class DecodeTile:
    """block_t tokens (the wgmma N; the moe_align block), block_n weight rows (the wgmma M), groups 32-groups of K
    per loop iteration (clipped to divide the problem's group count). Each group is one K = 32 dot (module doc,
    "Waits")."""

    block_t: int = 16
    block_n: int = 64
    groups: int = 2
    num_warps: int = 4
    num_stages: int = 3


# H200, 2026-12-02 (benchmarks/gpu_mxfp4_decode_ab.py, results/round7/final/mxfp4_decode_ab.log; TP4-rank shapes,
# near-uniform routing): 2 groups per iteration 98 / 548 / 837 us at M = 1 / 32 / 128 (1.11x / 1.23x / 1.33x the
# wide kernel, 9-27% of copy bandwidth over the MXFP4 bytes), 4 groups 1.03x / 1.20x / 1.24x, 8 groups and 128 rows
# x 8 warps 0.6-1.0x; same relative error as the wide kernel (2.5e-3 vs float64). Session 9 (same script,
# results/round9/call2/mxfp4_decode_ab.log): one K = 32 dot per group (the only form since) 92 / 501 / 748
# us against 98 / 553 / 845 with two K = 16 dots (1.06x / 1.10x / 1.13x; G 4 and G 8 with K 32 slower than G 2),
# same rel_err. Still far from the FP8 kernel (317 / 518 us at M = 32 / 128 on twice the bytes): the goal of >= 60%
# of copy bandwidth is not reached (28-30%).
DECODE_TILE = DecodeTile()


def nibble_asm(j: int) -> str:
    """PTX of `_e2m1_nibble` (pack 2: $1 holds bytes b0 | b1 << 8, $0 gets bf16 of nibble j of b0 (low half) and
    of b1 (high half)): spread the bytes to bits 0 and 16 (PRMT), keep nibble j, place magnitude and sign with one
    multiply (NIBBLE_MASK_MUL), keep those bits: each half is then E2M1 x 2^-126 as a bf16 (the 0.5 code the
    subnormal 2^-127), x 2^126 (exact)."""
    mask, mul = NIBBLE_MASK_MUL[j]
    return ("{ .reg .b32 t, a; cvt.u32.u16 t, $1; prmt.b32 t, t, 0, 0x4140; "
            f"and.b32 a, t, {mask:#010x}; mul.lo.u32 a, a, {mul:#x}; and.b32 a, a, {NIBBLE_KEEP:#010x}; "
            "mov.b32 t, 0x7E807E80; mul.rn.bf16x2 $0, a, t; }")


_NIBBLE_PTX_LO: tl.constexpr = tl.constexpr(nibble_asm(0))
_NIBBLE_PTX_HI: tl.constexpr = tl.constexpr(nibble_asm(1))


@triton.jit
def _e2m1_nibble(b, J: tl.constexpr, ASM: tl.constexpr):
    """Packed bytes b (int8, any shape) -> the E2M1 value of nibble J (0: low = even element, 1: high = odd) of
    each, exact: bf16 from the inline PTX (ASM; pure unary, so the tile stays in the wgmma A registers) or float32
    from the same bit placement in Triton ops (the interpreter)."""
    if ASM:
        if J == 0:
            v = tl.inline_asm_elementwise(asm=_NIBBLE_PTX_LO, constraints="=r,h", args=[b], dtype=tl.bfloat16,
                                          is_pure=True, pack=2)
        else:
            v = tl.inline_asm_elementwise(asm=_NIBBLE_PTX_HI, constraints="=r,h", args=[b], dtype=tl.bfloat16,
                                          is_pure=True, pack=2)
    else:
        n = ((b.to(tl.int32) & 0xFF) >> (4 * J)) & 0xF
        bits = ((n & 7) << 22) | ((n & 8) << 28)  # magnitude into float32 bits 22-24, sign into bit 31
        v = bits.to(tl.float32, bitcast=True) * _TWO_POW_126
    return v


@triton.jit
def _group_dot(acc, w_ptrs, s_ptrs, n_ok, x, ASM: tl.constexpr, F32_DOT: tl.constexpr):
    """acc [BN, BT] fp32 + one 32-group: bytes w_ptrs [BN, 16], E8M0 bytes s_ptrs [BN], activations x [32, BT] (the
    group's de-interleaved rows: even elements, then odd). The two nibble tiles are joined into one [BN, 32] tile
    (column 16 j + c: nibble j of byte c, element 2 c + j, as x's rows) for one K = 32 dot. The partial is scaled by
    2^(s - 127) (exact; byte 0 the subnormal 2^-127, 255 inf as dequant_mxfp4)."""
    b = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
    s = tl.load(s_ptrs, mask=n_ok, other=127).to(tl.int32)
    lo = _e2m1_nibble(b, 0, ASM)
    v = tl.reshape(tl.permute(tl.join(lo, _e2m1_nibble(b, 1, ASM)), (0, 2, 1)), (lo.shape[0], 32))
    if F32_DOT:  # the interpreter or float32 activations
        part = tl.dot(v.to(tl.float32), x.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(v, x)
    scale = tl.maximum(s << 23, 0x400000).to(tl.float32, bitcast=True)  # byte 0: 2^-127 (bits 0x400000)
    return acc + part * scale[:, None]


@triton.jit
def _decode_gemm1_kernel(
    x_ptr, w_ptr, ws_ptr, inter_ptr, sorted_ptr, expert_ptr, npp_ptr,
    numel, topk_cols, N_HALF, K_BYTES, stride_xm, stride_we, stride_wse, alpha, limit,
    BT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr, F32_DOT: tl.constexpr,
):
    """inter[p, perm(n)] = swigluoai(gate, up) of sorted row p (module doc: intermediate de-interleaved per group)."""
    pid_t, offs_n, n_ok = moe_tile_cols(N_HALF, BN)
    if pid_t * BT >= tl.load(npp_ptr):
        return
    e, offs_t, slot, t_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_t, numel, BT)
    tok = (slot // topk_cols).to(tl.int64)
    offs_c = tl.arange(0, 16)
    rows_g = offs_n.to(tl.int64)
    g_ptrs = w_ptr + e * stride_we + rows_g[:, None] * K_BYTES + offs_c[None, :]  # [BN, 16] bytes of one group
    u_ptrs = g_ptrs + N_HALF * K_BYTES
    sg_ptrs = ws_ptr + e * stride_wse + rows_g * (K_BYTES // 16)
    su_ptrs = sg_ptrs + N_HALF * (K_BYTES // 16)
    x_ptrs = x_ptr + tok[None, :] * stride_xm + tl.arange(0, 32)[:, None]  # [32, BT] (de-interleaved x)
    acc_g = tl.zeros([BN, BT], tl.float32)
    acc_u = tl.zeros([BN, BT], tl.float32)
    for kb in range(0, K_BYTES // (16 * G)):
        for g in tl.static_range(G):
            xg = tl.load(x_ptrs + 32 * g, mask=t_ok[None, :], other=0.0)
            acc_g = _group_dot(acc_g, g_ptrs + 16 * g, sg_ptrs + g, n_ok, xg, ASM, F32_DOT)
            acc_u = _group_dot(acc_u, u_ptrs + 16 * g, su_ptrs + g, n_ok, xg, ASM, F32_DOT)
        g_ptrs += 16 * G
        u_ptrs += 16 * G
        sg_ptrs += G
        su_ptrs += G
        x_ptrs += 32 * G
    perm = (offs_n // 32) * 32 + (offs_n % 2) * 16 + (offs_n % 32) // 2  # column n of the de-interleaved rows
    store_swigluoai(inter_ptr, offs_t, perm, n_ok, N_HALF, tl.trans(acc_g), tl.trans(acc_u), alpha, limit)


@triton.jit
def _decode_gemm2_kernel(
    a_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
    numel, N, K_BYTES, stride_we, stride_wse,
    BT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr, F32_DOT: tl.constexpr,
):
    """out_slots[slot, n] = topk weight x (intermediate row @ w2[e] row n), intermediate de-interleaved."""
    pid_t, offs_n, n_ok = moe_tile_cols(N, BN)
    if pid_t * BT >= tl.load(npp_ptr):
        return
    e, offs_t, slot, t_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_t, numel, BT)
    offs_c = tl.arange(0, 16)
    rows = offs_n.to(tl.int64)
    w_ptrs = w_ptr + e * stride_we + rows[:, None] * K_BYTES + offs_c[None, :]
    s_ptrs = ws_ptr + e * stride_wse + rows * (K_BYTES // 16)
    a_ptrs = a_ptr + offs_t[None, :].to(tl.int64) * (2 * K_BYTES) + tl.arange(0, 32)[:, None]  # all P rows
    acc = tl.zeros([BN, BT], tl.float32)
    for kb in range(0, K_BYTES // (16 * G)):
        for g in tl.static_range(G):
            acc = _group_dot(acc, w_ptrs + 16 * g, s_ptrs + g, n_ok, tl.load(a_ptrs + 32 * g), ASM, F32_DOT)
        w_ptrs += 16 * G
        s_ptrs += G
        a_ptrs += 32 * G
    wt = tl.load(topk_w_ptr + slot, mask=t_ok, other=0.0)
    out = out_ptr + slot[None, :].to(tl.int64) * N + offs_n[:, None]
    store_slot_rows(out, acc * wt[None, :], t_ok[None, :] & n_ok[:, None])


def decode_ineligible(x: torch.Tensor, fp8_activations: bool) -> Optional[str]:
    """Rule of the decode path (the launcher's device rule already passed): None when it may run, else why not."""
    if fp8_activations:
        return "W4A8 (fp8 activations)"
    if x.shape[0] > DECODE_MAX_TOKENS:
        return f"{x.shape[0]} tokens > {DECODE_MAX_TOKENS}"
    if x.dtype not in (torch.bfloat16, torch.float32):
        return f"x {x.dtype} (the PTX dequant feeds bf16 MMAs; float32 runs fp32 dots)"
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (9, 0):
        return "needs sm_90 (mul.rn.bf16x2, wgmma)"
    return None


def deinterleave_groups(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> [T, K] with each 32-group reordered as its 16 even then its 16 odd elements (module doc)."""
    t, k = x.shape
    return x.reshape(t, k // MX_GROUP, MX_GROUP // 2, 2).transpose(2, 3).reshape(t, k)


def _groups_per_step(groups: int, num_groups: int) -> int:
    while num_groups % groups:
        groups //= 2
    return groups


def fused_moe_mxfp4_decode(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                           w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, k: int,
                           alpha: float, limit: float, tile: DecodeTile = DECODE_TILE,
                           slot_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The decode launcher (arguments checked by `fused_moe_mxfp4_triton`): x [T, H] bf16 (float32 under the
    interpreter), packed tables as stored -> [T, H] in x.dtype. slot_dtype: dtype of GEMM 2's per-slot rows
    (ladle/kernels/fused_moe.py `slot_dtype_for`; None: SLOT_DTYPE)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    slots_dt = slot_dtype_for(x.dtype, T, slot_dtype)
    cfg = MoETileConfig(tile.block_t, tile.block_n, tile.block_n, MX_GROUP * tile.groups, tile.num_warps,
                        tile.num_stages)
    _, _, (sorted_ids, expert_ids, npp) = moe_launch_plan(topk_ids, E, H, I, cfg, MX_GROUP, "mxfp4")
    P = sorted_ids.numel()
    f32 = interpreting() or x.dtype == torch.float32
    launch = dict(BT=tile.block_t, BN=tile.block_n, ASM=not interpreting(), F32_DOT=f32,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    x_de = deinterleave_groups(x)
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    _decode_gemm1_kernel[((P // tile.block_t) * triton.cdiv(I, tile.block_n),)](
        x_de, w13, w13_scale, inter, sorted_ids, expert_ids, npp, T * k, k, I, H // 2, x_de.stride(0),
        w13.stride(0), w13_scale.stride(0), float(alpha), float(limit),
        G=_groups_per_step(tile.groups, H // MX_GROUP), **launch)
    out_slots = torch.empty((T * k, H), dtype=slots_dt, device=x.device)
    _decode_gemm2_kernel[((P // tile.block_t) * triton.cdiv(H, tile.block_n),)](
        inter, w2, w2_scale, out_slots, sorted_ids, expert_ids, npp, topk_weights.contiguous(), T * k, H, I // 2,
        w2.stride(0), w2_scale.stride(0), G=_groups_per_step(tile.groups, I // MX_GROUP), **launch)
    return moe_combine(out_slots, T, k, x.dtype, use_triton=True)
