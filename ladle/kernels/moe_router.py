"""MiniMax-M3 MoE router: fp32-accurate logits, sigmoid, biased choice, top-k, renormalise, scale, shared-expert
column.

Math (design/minimax_m3.md §3.8):
    logits = x.float() @ W.float()^T                        [T, E] fp32
    sig    = sigmoid(logits)
    choice = sig + e_score_correction_bias                  (selection only)
    ids    = top-k of choice (ties: the LOWER expert id wins)
    w      = sig[ids] / sum(sig[ids]) * routed_scaling_factor
With `shared_expert=True` a column k is appended with id E (the shared expert packed as expert #E of the fused
MoE table) and weight exactly 1.0 — never renormalised, never scaled (kernels_and_limits.md §1.6).

Paths, by the local token count T (`router_precision` / `router_path`; the dispatch record names the one that ran):
  T <  ROUTER_KERNEL_MIN_TOKENS (128): ROUTER_SMALL_T_PRECISION, today None: "torch logits" — `router_logits`
      (cuBLAS IEEE fp32 GEMM, TF32 off, on an fp32 copy of x), then `route_from_logits` (`_router_topk_kernel`, the
      routing epilogue); a precision there runs, up to SMALL_T_MAX_TOKENS (64), "triton small-t <precision>"
      (`moe_router_small_t`: `_router_small_t_kernel`, ONE launch of expert blocks x K splits whose arrival counters
      let the last split of each block sum its partials and the last block route, instead of the cuBLAS GEMM, its
      split-K reduce, the x copy and the epilogue launch), above 64 the kernel below ("triton logits <precision>");
  T >= 128: "triton logits <ROUTER_LARGE_T_PRECISION>", today "tf32x2w" (tf32x3 for a float32 x) —
      `moe_router_kernel`, x read in its own dtype, tensor-core dot, routing fused.
The kernel's products (PRECISIONS; `precision=` of `moe_router_triton` / `moe_router_kernel` forces one at any T):
  "tf32x3"  tl.dot input_precision "tf32x3" (Triton splits both operands: three tensor-core dots);
  "tf32x2w" a bf16/fp16 x is exact in TF32, so only W is split, in the kernel (`_tf32_split`): w_hi = W with its 13
            low mantissa bits cleared (a TF32 value), w_lo = W - w_hi (exact in fp32), two "tf32" dots x w_hi^T and
            x w_lo^T into two fp32 accumulators (one accumulator chained through both dots made Triton 3.6 alternate
            two wgmma layouts and convert it through shared memory every K step), both added to the logits in fp32
            after every TF32X2W_PROMOTE_K of K (the tensor core's TF32 accumulation is coarse over long chains).
            A float32 x runs "tf32x3" (its low part is not zero);
  "ieee"    fp32 FMA dot (exact-rounded fp32 products, as cuBLAS SGEMM): meant for small T, split K.
The switches are module constants (ROUTER_KERNEL_MIN_TOKENS, ROUTER_LARGE_T_PRECISION, ROUTER_SMALL_T_PRECISION),
set by the H200 A/B benchmarks/gpu_moe_router_ab.py ("kernel tf32x2w" at every T, "kernel ieee" at T <= 128).
Measured on the H200 at one TP4 rank of M3 (H 6144, E 128, top-4 + shared, bf16 x; CUDA-graph us per call; torch
logits vs Triton logits kernel; benchmarks/results/round7/kernels/call3_moe_router_ab.log): T=1 13.1 vs 22.1,
T=32 20.6 vs 26.3, T=128 25.4 vs 23.6, T=8192 411.0 vs 370.4 (split K 2/4/8 there: 385/380/388, no better).
Session 9 (benchmarks/results/round9/, H200): "tf32x2w" with one tensor-core accumulation chain over K = 6144 ran
188.7 us at T=8192 but with logit rel err 1.4e-5 (4 of 8192 tokens routed unlike float64); the probe
(round9/scripts/tf32_probe.py) showed the error is the tensor core's TF32 accumulation, not the split (the same with
W's residual zero, 8x smaller with 768-long chains). With chains of TF32X2W_PROMOTE_K = 512 added in fp32
(call 6): 196.3 us against tf32x3's 376.9 (1.92x) at T=8192, 19.4 against 23.5 us at T=128, logit rel err 1.2e-6
(tf32x3 2.7e-7, torch's fp32 SGEMM 7.0e-7), ids equal to float64's for all 8192 tokens: the default from 128 tokens
since. "ieee" split K at T=1/32/128: 34.8 / 65.7 / 53.1 us against torch's 12.7 / 20.2 / 25.0, and fewer splits
(8 / 16 / 32) no better than torch: torch logits stay below 128 tokens. (A split-K sum that loaded four splits per
step made T=128 slower, 39.3 us against 23.6: reverted.)

Kernels. `_router_logits_kernel`, grid (cdiv(T, BLOCK_T), SPLITS): each program multiplies a [BLOCK_T, BLOCK_K] tile
of x, loaded in its own dtype (bf16/fp16/fp32) and widened to fp32 in registers — no fp32 copy of x in memory — by
the [E_P2, BLOCK_K] tile of W (fp32 as the layer stores it), accumulating [BLOCK_T, E_P2] fp32 logits over its K
range with `tl.dot` at the precision above. With SPLITS = 1 (enough row tiles to fill the GPU: T > ~4K at H200's 132
SMs) the same program runs the routing epilogue `_route_rows` on the logit tile in registers and writes ids/weights.
With SPLITS > 1 (fewer row tiles, e.g. 48 splits at T = 128: K is split over programs to read W in parallel) each
program writes its fp32 partial logits to a [SPLITS, T, E] buffer and `_router_topk_kernel` (grid cdiv(T, 4) up
to 256 tokens, else cdiv(T, 16): `epilogue_tiles`) sums the partials, up to 16 splits per load, in a fixed order
(atomic-free, deterministic) and runs `_route_rows`. (It summed one split per loop step until session 11: at T = 32
two programs walked 96 dependent loads, most of the split-K launch's time.) E_P2 = next power of two >= max(E,
16); experts E..E_P2-1 are masked (zero weights, -inf choice). The path and launch rules (`router_path`,
`router_launch`) depend only on T, H, E and the device's SM count: no host sync, CUDA-graph capturable. Under the
CPU interpreter the kernel's dot is exact fp32 ("ieee"), so CPU tests check the math.

Accuracy contract. Logits: on the Triton path each product x_k W_ek carries <~ 2^-21 relative error ("tf32x3" drops
the residual x residual term and rounds the residual products to TF32; "tf32x2w": x and w_hi are exact in TF32, and
w_lo (|w_lo| < 2^-10 |W|, at most 13 significant bits) loses at most its 2 lowest bits when the tensor core takes it
as TF32 (11 significant bits), i.e. < 2^-21 |W| truncated, <= 2^-22 |W| rounded; "ieee": <= 2^-24, as the torch
path), then fp32 accumulation adds the summation error any fp32 GEMM has (the tensor core's TF32 accumulation is
coarser than fp32 adds: "tf32x2w" adds its chains of TF32X2W_PROMOTE_K in fp32; the order differs between kernels;
cuBLAS differs from itself across split-K choices): on either path |logit - exact| <~ 1e-6 * sum_k |x_k W_ek|
(tests bound it by 1e-5 x that; the A/B prints the measured error). The logits are reproducible bit for bit for a given
T and precision on a given device; across T (path, precision, split and tile differ) a logit may differ in its last
bits. Routing is discrete: an exact tie of sig + bias on the computed fp32 logits picks the lower expert id (as
`moe_router_ref`'s stable sort does); a near-tie whose margin is within the logit error above may pick either expert,
and may differ from the torch fp32 GEMM of the reference, which is not order-exact either. Weights are then within ~1e-6
relative of the reference's for the same ids.

The torch reference `moe_router_ref` (x.float() @ W^T in IEEE fp32, TF32 off, stable sort) is the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ladle.kernels._common import decide_triton, interpreting, num_sms, triton_ok, tl, triton
from ladle.kernels.split_counters import arrive, release, split_counters
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "moe_router"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); logits by torch below ROUTER_KERNEL_MIN_TOKENS, "
                                 "else by the kernel's tl.dot at ROUTER_LARGE_T_PRECISION")

EPILOGUE_BLOCK_T = 16  # token rows per program of `_router_topk_kernel` above EPILOGUE_SMALL_T tokens
EPILOGUE_BLOCK_T_SMALL = 4  # ... and up to EPILOGUE_SMALL_T tokens (decode: 8 programs at T = 32, not 2)
EPILOGUE_SMALL_T = 256
EPILOGUE_TILE_ELEMS = 8192  # fp32 elements per partial-logit load of `_router_topk_kernel` (64 per thread, 4 warps)
# The op's rule (`router_precision`), the switches an H200 A/B (benchmarks/gpu_moe_router_ab.py) flips:
ROUTER_KERNEL_MIN_TOKENS = 128  # local tokens from which ROUTER_LARGE_T_PRECISION runs (module doc: measured)
ROUTER_LARGE_T_PRECISION = "tf32x2w"  # the kernel's products from ROUTER_KERNEL_MIN_TOKENS tokens (module doc)
# "tf32x2w": K elements per tensor-core accumulation chain; each chain's fp32 result is added to the logits on the
# CUDA cores. H200 (results/round9/scripts/tf32_probe.py): one chain over K = 6144 gave logit rel err 1.4e-5 whether
# W's residual was zero or W was its residual alone (the tensor core's TF32 accumulation, not the split), 768-long
# chains 1.8e-6.
TF32X2W_PROMOTE_K = 512
ROUTER_SMALL_T_PRECISION: Optional[str] = "tf32x2w"  # below it: None = torch logits; a precision: small-T kernel (A/B)
# The one-launch small-T kernel (`moe_router_small_t`): runs the op's rule below ROUTER_KERNEL_MIN_TOKENS when
# ROUTER_SMALL_T_PRECISION is set and T <= SMALL_T_MAX_TOKENS; programs (expert block of SMALL_T_EXPERT_BLOCK, K split
# of SMALL_T_K_CHUNK): 8 x 12 = 96 at H 6144, E 128.
SMALL_T_MAX_TOKENS = 64
SMALL_T_EXPERT_BLOCK = 16
SMALL_T_K_CHUNK = 512  # <= TF32X2W_PROMOTE_K: one tensor-core accumulation chain per program
SMALL_T_BLOCK_K = 64
COUNTER_KEY = "moe_router_small_t"
PRECISIONS = ("tf32x3", "tf32x2w", "ieee")  # the kernel's product precisions (module doc)
_DOT_INPUT = {"tf32x3": "tf32x3", "tf32x2w": "tf32", "ieee": "ieee"}  # tl.dot input_precision of each (GPU)


@triton.jit
def _route_rows(logit, rows, t_ok, e, e_ok, bias_ptr, ids_ptr, w_ptr, num_experts, scaling,
                BLOCK_T: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr, OUT_COLS: tl.constexpr,
                OUT_P2: tl.constexpr, HAS_BIAS: tl.constexpr, SHARED: tl.constexpr):
    """Routing epilogue of a [BLOCK_T, E_P2] fp32 logit tile: sigmoid, biased choice, top-k (lower id wins ties),
    renormalise, scale, shared column; stores ids [T, OUT_COLS] int32 and weights [T, OUT_COLS] fp32 for rows t_ok."""
    sig = tl.sigmoid(logit)
    if HAS_BIAS:
        choice = sig + tl.load(bias_ptr + e, mask=e_ok, other=0.0)[None, :]
    else:
        choice = sig
    choice = tl.where(e_ok[None, :], choice, float("-inf"))
    col = tl.arange(0, OUT_P2)[None, :]
    ids = tl.zeros([BLOCK_T, OUT_P2], tl.int32)
    ws = tl.zeros([BLOCK_T, OUT_P2], tl.float32)
    for i in tl.static_range(TOPK):
        best = tl.max(choice, axis=1)
        idx = tl.min(tl.where(choice == best[:, None], e[None, :], E_P2), axis=1)
        hit = e[None, :] == idx[:, None]
        wsel = tl.sum(tl.where(hit, sig, 0.0), axis=1)
        ids = tl.where(col == i, idx[:, None], ids)
        ws = tl.where(col == i, wsel[:, None], ws)
        choice = tl.where(hit, float("-inf"), choice)
    total = tl.sum(ws, axis=1)
    ws = ws / total[:, None] * scaling
    if SHARED:
        ids = tl.where(col == TOPK, num_experts, ids)
        ws = tl.where(col == TOPK, 1.0, ws)
    off = rows.to(tl.int64)[:, None] * OUT_COLS + col
    ok = t_ok[:, None] & (col < OUT_COLS)
    tl.store(ids_ptr + off, ids, mask=ok)
    tl.store(w_ptr + off, ws, mask=ok)


@triton.jit
def _tf32_split(w):
    """fp32 tile w -> (w_hi, w_lo), fp32 tiles of its shape: w_hi = w with its 13 low mantissa bits cleared (a TF32
    value: w truncated toward zero to 11 significant bits), w_lo = w - w_hi (exact in fp32: at most 13 significant
    bits, |w_lo| < 2^-10 |w|), so w_hi + w_lo == w exactly. For finite w."""
    w_hi = (w.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return w_hi, w - w_hi


@triton.jit
def _k_tiles(x_rows, w_rows, ks, k_end, t_ok, e_ok, EVEN_K: tl.constexpr):
    """The [BLOCK_T, BLOCK_K] x tile (its dtype) and [E_P2, BLOCK_K] W tile at columns ks; past k_end: zeros."""
    if EVEN_K:
        xt = tl.load(x_rows + ks[None, :], mask=t_ok[:, None], other=0.0)
        wt = tl.load(w_rows + ks[None, :], mask=e_ok[:, None], other=0.0)
    else:
        k_ok = ks < k_end
        xt = tl.load(x_rows + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_rows + ks[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
    return xt, wt


@triton.jit
def _logit_dots(x_rows, w_rows, kk, k_lo, k_hi, k_end, t_ok, e_ok, acc, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                SPLIT_W: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One tensor-core (or "ieee") accumulation over K columns [k_lo, k_hi) in BLOCK_K steps (kk = arange(BLOCK_K)),
    x widened to fp32 in registers. SPLIT_W ("tf32x2w"): returns (x w_hi^T, x w_lo^T), two chains started from
    `acc` (zeros) for the caller to add in fp32; else (acc + x W^T, acc)."""
    c_hi = acc
    c_lo = acc
    for k in range(k_lo, k_hi, BLOCK_K):
        xt, wt = _k_tiles(x_rows, w_rows, k + kk, k_end, t_ok, e_ok, EVEN_K)
        if SPLIT_W:
            w_hi, w_lo = _tf32_split(wt.to(tl.float32))
            c_hi = tl.dot(xt.to(tl.float32), tl.trans(w_hi), c_hi, input_precision=DOT_PRECISION)
            c_lo = tl.dot(xt.to(tl.float32), tl.trans(w_lo), c_lo, input_precision=DOT_PRECISION)
        else:
            c_hi = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), c_hi, input_precision=DOT_PRECISION)
    return c_hi, c_lo


@triton.jit
def _router_logits_kernel(
    x_ptr, w_ptr, bias_ptr, part_ptr, ids_ptr, wts_ptr,
    num_tokens, hidden, num_experts, stride_xt, stride_we, k_chunk, scaling,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, E_P2: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_W: tl.constexpr, PROMOTE_K: tl.constexpr, FUSED: tl.constexpr,
    TOPK: tl.constexpr, OUT_COLS: tl.constexpr, OUT_P2: tl.constexpr, HAS_BIAS: tl.constexpr, SHARED: tl.constexpr,
):
    """Logits of BLOCK_T tokens over K range [split * k_chunk, +k_chunk), x widened to fp32 in registers, products
    by DOT_PRECISION ("tf32x3"; "ieee" under the interpreter): routed in registers (FUSED) or stored as fp32
    partials part[split, t, e]."""
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rows < num_tokens
    e = tl.arange(0, E_P2)
    e_ok = e < num_experts
    kk = tl.arange(0, BLOCK_K)
    k0 = split * k_chunk
    k_end = tl.minimum(k0 + k_chunk, hidden)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt
    w_rows = w_ptr + e.to(tl.int64)[:, None] * stride_we
    acc = tl.zeros([BLOCK_T, E_P2], tl.float32)
    if SPLIT_W:  # "tf32x2w": x exact in TF32, W as a TF32 high part and its fp32 residual (module doc)
        for kc in range(k0, k_end, PROMOTE_K):  # tensor-core accumulation over PROMOTE_K at most, then fp32 adds
            c_hi, c_lo = _logit_dots(x_rows, w_rows, kk, kc, tl.minimum(kc + PROMOTE_K, k_end), k_end, t_ok, e_ok,
                                     tl.zeros([BLOCK_T, E_P2], tl.float32), BLOCK_K, EVEN_K, SPLIT_W, DOT_PRECISION)
            acc += c_hi + c_lo
    else:
        acc, _ = _logit_dots(x_rows, w_rows, kk, k0, k_end, k_end, t_ok, e_ok, acc, BLOCK_K, EVEN_K, SPLIT_W,
                             DOT_PRECISION)
    if FUSED:
        _route_rows(acc, rows, t_ok, e, e_ok, bias_ptr, ids_ptr, wts_ptr, num_experts, scaling,
                    BLOCK_T, E_P2, TOPK, OUT_COLS, OUT_P2, HAS_BIAS, SHARED)
    else:
        p = part_ptr + (split.to(tl.int64) * num_tokens + rows.to(tl.int64))[:, None] * num_experts + e[None, :]
        tl.store(p, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _router_topk_kernel(
    part_ptr, bias_ptr, ids_ptr, w_ptr, num_tokens, num_experts, num_splits, scaling,
    BLOCK_T: tl.constexpr, SPLIT_BLOCK: tl.constexpr, E_P2: tl.constexpr, TOPK: tl.constexpr,
    OUT_COLS: tl.constexpr, OUT_P2: tl.constexpr, HAS_BIAS: tl.constexpr, SHARED: tl.constexpr,
):
    """Sum of the fp32 partial logits part[s, t, e] over s = 0..num_splits-1, SPLIT_BLOCK splits per load (a
    [SPLIT_BLOCK, BLOCK_T, E_P2] tile summed over its first axis, the blocks added in split order: a fixed order,
    so deterministic), then `_route_rows`."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rows < num_tokens
    e = tl.arange(0, E_P2)
    e_ok = e < num_experts
    ok = t_ok[:, None] & e_ok[None, :]
    off = rows.to(tl.int64)[:, None] * num_experts + e[None, :]
    sb = tl.arange(0, SPLIT_BLOCK)
    logit = tl.zeros([BLOCK_T, E_P2], tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        s = s0 + sb
        p = part_ptr + (s.to(tl.int64) * num_tokens * num_experts)[:, None, None] + off[None, :, :]
        logit += tl.sum(tl.load(p, mask=(s < num_splits)[:, None, None] & ok[None, :, :], other=0.0), axis=0)
    _route_rows(logit, rows, t_ok, e, e_ok, bias_ptr, ids_ptr, w_ptr, num_experts, scaling,
                BLOCK_T, E_P2, TOPK, OUT_COLS, OUT_P2, HAS_BIAS, SHARED)


@triton.jit
def _router_small_t_kernel(
    x_ptr, w_ptr, bias_ptr, part_ptr, logit_ptr, cnt_ptr, ids_ptr, wts_ptr,
    num_tokens, hidden, num_experts, stride_xt, stride_we, scaling,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, EB: tl.constexpr, E_P2: tl.constexpr, K_CHUNK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, S_P2: tl.constexpr, NUM_EB: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT_W: tl.constexpr, TOPK: tl.constexpr, OUT_COLS: tl.constexpr, OUT_P2: tl.constexpr, HAS_BIAS: tl.constexpr,
    SHARED: tl.constexpr,
):
    """Small-T router in one launch, program (expert block eb, split s): the partial logits of all (<= BLOCK_T)
    tokens x experts [eb EB, (eb + 1) EB) over K range [s K_CHUNK, (s + 1) K_CHUNK) (one tensor-core chain of at
    most TF32X2W_PROMOTE_K, products as `_router_logits_kernel`'s) -> part[s, t, e]; the last split program of
    block eb (arrival counter cnt[eb]) sums the NUM_SPLITS partials of its [T, EB] slab in a fixed order into
    logit[t, e]; the last block to finish (counter cnt[NUM_EB]) routes the whole [T, E] logit tile (`_route_rows`).
    Counters zero at rest (split_counters.py)."""
    eb = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    t_ok = rows < num_tokens
    e = eb * EB + tl.arange(0, EB)
    e_ok = e < num_experts
    kk = tl.arange(0, BLOCK_K)
    k0 = split * K_CHUNK
    k_end = tl.minimum(k0 + K_CHUNK, hidden)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt
    w_rows = w_ptr + e.to(tl.int64)[:, None] * stride_we
    c_hi, c_lo = _logit_dots(x_rows, w_rows, kk, k0, k_end, k_end, t_ok, e_ok, tl.zeros([BLOCK_T, EB], tl.float32),
                             BLOCK_K, False, SPLIT_W, DOT_PRECISION)
    tile = rows.to(tl.int64)[:, None] * num_experts + e[None, :]
    ok = t_ok[:, None] & e_ok[None, :]
    part = c_hi + c_lo if SPLIT_W else c_hi
    tl.store(part_ptr + split.to(tl.int64) * num_tokens * num_experts + tile, part, mask=ok)
    if arrive(cnt_ptr + eb, NUM_SPLITS):
        sp = tl.arange(0, S_P2)
        parts = tl.load(part_ptr + (sp.to(tl.int64) * num_tokens * num_experts)[:, None, None] + tile[None, :, :],
                        mask=(sp < NUM_SPLITS)[:, None, None] & ok[None, :, :], other=0.0, cache_modifier=".cg")
        tl.store(logit_ptr + tile, tl.sum(parts, axis=0), mask=ok)
        release(cnt_ptr + eb)
        if arrive(cnt_ptr + NUM_EB, NUM_EB):
            ea = tl.arange(0, E_P2)
            ea_ok = ea < num_experts
            full = tl.load(logit_ptr + rows.to(tl.int64)[:, None] * num_experts + ea[None, :],
                           mask=t_ok[:, None] & ea_ok[None, :], other=0.0, cache_modifier=".cg")
            _route_rows(full, rows, t_ok, ea, ea_ok, bias_ptr, ids_ptr, wts_ptr, num_experts, scaling,
                        BLOCK_T, E_P2, TOPK, OUT_COLS, OUT_P2, HAS_BIAS, SHARED)
            release(cnt_ptr + NUM_EB)


def epilogue_tiles(num_tokens: int, num_splits: int, e_p2: int) -> tuple[int, int]:
    """(BLOCK_T, SPLIT_BLOCK) of `_router_topk_kernel`: EPILOGUE_BLOCK_T_SMALL token rows per program up to
    EPILOGUE_SMALL_T tokens (more programs for the decode sizes, where the split-K partials are read by few rows),
    else EPILOGUE_BLOCK_T; splits per load so that one load is at most EPILOGUE_TILE_ELEMS fp32 elements."""
    block_t = EPILOGUE_BLOCK_T_SMALL if num_tokens <= EPILOGUE_SMALL_T else EPILOGUE_BLOCK_T
    cap = max(1, EPILOGUE_TILE_ELEMS // (block_t * e_p2))
    return block_t, min(triton.next_power_of_2(max(num_splits, 1)), 1 << (cap.bit_length() - 1))


@dataclass(frozen=True)
class RouterLaunch:
    """Tiles of one `moe_router_triton` call: BLOCK_T tokens x E_P2 experts per program, K in BLOCK_K steps,
    `splits` programs per row tile each over `k_chunk` (a multiple of BLOCK_K) of the hidden dim."""
    block_t: int
    block_k: int
    e_p2: int
    splits: int
    k_chunk: int
    num_warps: int
    num_stages: int


def router_precision(num_tokens: int, x_dtype: torch.dtype, precision: Optional[str] = None) -> Optional[str]:
    """The products the op runs for `num_tokens` local tokens of x in `x_dtype`: one of PRECISIONS (the Triton
    kernel), or None (torch logits). `precision` None = the op's rule: ROUTER_LARGE_T_PRECISION from
    ROUTER_KERNEL_MIN_TOKENS tokens, ROUTER_SMALL_T_PRECISION below; else the kernel at that precision at any T.
    "tf32x2w" needs x exact in TF32 (bf16/fp16): a float32 x runs "tf32x3". ValueError for an unknown name."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"moe_router precision {precision!r}: expected None (the op's rule) or one of {PRECISIONS}")
    if precision is None:
        precision = ROUTER_LARGE_T_PRECISION if num_tokens >= ROUTER_KERNEL_MIN_TOKENS else ROUTER_SMALL_T_PRECISION
    if precision == "tf32x2w" and x_dtype not in (torch.bfloat16, torch.float16):
        return "tf32x3"
    return precision


def small_t_kernel_runs(num_tokens: int, precision: Optional[str] = None) -> bool:
    """True when the op's rule (`precision` None) runs the one-launch small-T kernel at `num_tokens`: below
    ROUTER_KERNEL_MIN_TOKENS with ROUTER_SMALL_T_PRECISION set, up to SMALL_T_MAX_TOKENS."""
    return (precision is None and ROUTER_SMALL_T_PRECISION is not None
            and 0 < num_tokens <= min(SMALL_T_MAX_TOKENS, ROUTER_KERNEL_MIN_TOKENS - 1))


def router_path(num_tokens: int, x_dtype: torch.dtype, precision: Optional[str] = None) -> str:
    """The path `router_precision` picks (module doc), as the dispatch record names it: "torch logits",
    "triton small-t <precision>" (`small_t_kernel_runs`) or "triton logits <precision>" (e.g. "triton logits
    tf32x3")."""
    resolved = router_precision(num_tokens, x_dtype, precision)
    if resolved is None:
        return "torch logits"
    return f"triton {'small-t' if small_t_kernel_runs(num_tokens, precision) else 'logits'} {resolved}"


def router_launch(num_tokens: int, hidden: int, num_experts: int, device: torch.device,
                  splits: Optional[int] = None) -> RouterLaunch:
    """The launch rule (module doc), the same for every precision. Row tile 16/32/64 tokens; split K only while the
    row tiles fill less than half of the SMs, into about one program per SM, capped so the partial buffer
    (splits x T x E fp32) is no larger than W; `splits` overrides the split count (rounded so that every split has
    whole BLOCK_K steps)."""
    e_p2 = max(16, triton.next_power_of_2(num_experts))
    block_t = 16 if num_tokens <= 16 else 32 if num_tokens <= 32 else 64
    block_k = 32 if e_p2 <= 128 else 16
    tiles = triton.cdiv(num_tokens, block_t)
    if splits is None:
        sms = num_sms(device)
        splits = 1 if 2 * tiles >= sms else min(sms // tiles, max(1, hidden // max(num_tokens, 1)))
    k_chunk = triton.cdiv(triton.cdiv(hidden, max(1, splits)), block_k) * block_k
    # sm_90 ptxas (triton 3.6, E 128, bf16 x): no register spills at these tiles and warps, fused epilogue included.
    # Registers per thread, split K (fused at BLOCK_T 64): tf32x3 -/-/184, tf32x2w 108/92/151, ieee 96/79/128 (159)
    # at BLOCK_T 16/32/64; the ieee dot is FMA (512 FFMA per thread per BLOCK_K step at 16 and 32 rows, 1024 at 64).
    return RouterLaunch(block_t, block_k, e_p2, triton.cdiv(hidden, k_chunk), k_chunk,
                        num_warps=4 if block_t == 16 else 8, num_stages=3 if num_tokens > 64 else 2)


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """[T, E] fp32 logits = x.float() @ W.float()^T with TF32 off for this matmul (the reference's logits)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return x.float() @ gate_weight.float().t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def route_from_logits(partials: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
                      routed_scaling_factor: float = 1.0, shared_expert: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_router_topk_kernel` alone: partials [S, T, E] fp32 contiguous (S = 1: finished logits) -> (ids, weights)
    as `moe_router_triton` returns them. The "torch logits" path's routing and the split-K launch's second pass."""
    S, T, E = partials.shape
    assert partials.dtype == torch.float32 and partials.is_contiguous() and 1 <= top_k <= E
    cols = top_k + int(shared_expert)
    ids = torch.empty((T, cols), dtype=torch.int32, device=partials.device)
    ws = torch.empty((T, cols), dtype=torch.float32, device=partials.device)
    if T == 0:
        return ids, ws
    bias = _bias(e_score_correction_bias, E, partials)
    e_p2 = max(16, triton.next_power_of_2(E))
    block_t, split_block = epilogue_tiles(T, S, e_p2)
    _router_topk_kernel[(triton.cdiv(T, block_t),)](
        partials, bias, ids, ws, T, E, S, float(routed_scaling_factor),
        BLOCK_T=block_t, SPLIT_BLOCK=split_block, E_P2=e_p2, TOPK=top_k, OUT_COLS=cols,
        OUT_P2=triton.next_power_of_2(cols), HAS_BIAS=e_score_correction_bias is not None, SHARED=shared_expert,
        num_warps=4,
    )
    return ids, ws


def _bias(e_score_correction_bias: Optional[torch.Tensor], E: int, placeholder: torch.Tensor) -> torch.Tensor:
    if e_score_correction_bias is None:
        return placeholder  # never read (HAS_BIAS False)
    assert e_score_correction_bias.shape == (E,)
    return e_score_correction_bias.float().contiguous()  # the layer's bias is fp32 already: no copy


def moe_router_triton(
    x: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
    routed_scaling_factor: float = 1.0, shared_expert: bool = False, *, precision: Optional[str] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's fast path, by `router_precision(T, x.dtype, precision)`: "torch logits" (`router_logits` +
    `route_from_logits`) where it is None (by default below ROUTER_KERNEL_MIN_TOKENS), else `moe_router_kernel` at
    that precision. `precision` None = the op's rule; one of PRECISIONS forces the kernel at any T. Other arguments
    and returns as `moe_router_kernel`."""
    resolved = router_precision(x.shape[0], x.dtype, precision)
    if resolved is not None and small_t_kernel_runs(x.shape[0], precision):
        return moe_router_small_t(x, gate_weight, e_score_correction_bias, top_k, routed_scaling_factor,
                                  shared_expert, precision=resolved)
    if resolved is not None:
        return moe_router_kernel(x, gate_weight, e_score_correction_bias, top_k, routed_scaling_factor, shared_expert,
                                 precision=resolved)
    return route_from_logits(router_logits(x, gate_weight)[None], e_score_correction_bias, top_k,
                             routed_scaling_factor, shared_expert)


def moe_router_kernel(
    x: torch.Tensor,  # [T, hidden] activations, bf16/fp16/fp32 (read in place; rows may be strided)
    gate_weight: torch.Tensor,  # [E, hidden] router weight (fp32 as the layer stores it)
    e_score_correction_bias: Optional[torch.Tensor],  # [E] fp32, choice only
    top_k: int,
    routed_scaling_factor: float = 1.0,
    shared_expert: bool = False,
    *,
    splits: Optional[int] = None,  # split-K override (tests); None = `router_launch`'s rule
    precision: Optional[str] = None,  # one of PRECISIONS; None = ROUTER_LARGE_T_PRECISION
) -> tuple[torch.Tensor, torch.Tensor]:
    """The "triton logits" path at any T (the op's from ROUTER_KERNEL_MIN_TOKENS; tests and the A/B force it):
    `_router_logits_kernel` at `precision` ("tf32x2w" on a float32 x runs "tf32x3", module doc), fused epilogue or
    split K + `_router_topk_kernel`. Returns (topk_ids [T, k(+1)] int32, topk_weights [T, k(+1)] fp32); the shared
    column, if any, is last. ValueError for an unknown precision."""
    precision = router_precision(x.shape[0], x.dtype, ROUTER_LARGE_T_PRECISION if precision is None else precision)
    assert x.dim() == 2 and gate_weight.dim() == 2 and x.shape[1] == gate_weight.shape[1]
    T, H = x.shape
    E = gate_weight.shape[0]
    assert 1 <= top_k <= E
    cols = top_k + int(shared_expert)
    if T == 0:
        return (torch.empty((0, cols), dtype=torch.int32, device=x.device),
                torch.empty((0, cols), dtype=torch.float32, device=x.device))
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_weight = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    cfg = router_launch(T, H, E, x.device, splits)
    if cfg.splits > 1:
        part = torch.empty((cfg.splits, T, E), dtype=torch.float32, device=x.device)
        _launch_logits(x, gate_weight, cfg, precision, part)
        return route_from_logits(part, e_score_correction_bias, top_k, routed_scaling_factor, shared_expert)
    ids = torch.empty((T, cols), dtype=torch.int32, device=x.device)
    ws = torch.empty((T, cols), dtype=torch.float32, device=x.device)
    _launch_logits(x, gate_weight, cfg, precision, (ids, ws), e_score_correction_bias, top_k, routed_scaling_factor,
                   shared_expert)
    return ids, ws


def moe_router_small_t(
    x: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
    routed_scaling_factor: float = 1.0, shared_expert: bool = False, *, precision: str = "tf32x2w",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-launch small-T path (`_router_small_t_kernel`, T <= SMALL_T_MAX_TOKENS) at `precision` (one of
    PRECISIONS; "tf32x2w" on a float32 x runs "tf32x3"). Arguments and returns as `moe_router_kernel`. Scratch:
    [K splits, T, E] partials and [T, E] logits (fp32), the counters of `split_counters(COUNTER_KEY)` (the first call
    on a device must be eager: it may allocate)."""
    precision = router_precision(x.shape[0], x.dtype, precision)
    assert precision is not None and x.dim() == 2 and gate_weight.dim() == 2 and x.shape[1] == gate_weight.shape[1]
    T, H = x.shape
    E = gate_weight.shape[0]
    assert 1 <= top_k <= E and T <= SMALL_T_MAX_TOKENS, (T, top_k, E)
    cols = top_k + int(shared_expert)
    ids = torch.empty((T, cols), dtype=torch.int32, device=x.device)
    ws = torch.empty((T, cols), dtype=torch.float32, device=x.device)
    if T == 0:
        return ids, ws
    x = x if x.stride(1) == 1 else x.contiguous()
    gate_weight = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    e_p2 = max(16, triton.next_power_of_2(E))
    num_eb = triton.cdiv(E, SMALL_T_EXPERT_BLOCK)
    splits = triton.cdiv(H, SMALL_T_K_CHUNK)
    part = torch.empty((splits, T, E), dtype=torch.float32, device=x.device)
    logits = torch.empty((T, E), dtype=torch.float32, device=x.device)
    counters = split_counters(COUNTER_KEY, x.device, num_eb + 1)
    block_t = max(16, triton.next_power_of_2(T))
    _router_small_t_kernel[(num_eb, splits)](
        x, gate_weight, _bias(e_score_correction_bias, E, gate_weight), part, logits, counters, ids, ws,
        T, H, E, x.stride(0), gate_weight.stride(0), float(routed_scaling_factor),
        BLOCK_T=block_t, BLOCK_K=SMALL_T_BLOCK_K, EB=SMALL_T_EXPERT_BLOCK, E_P2=e_p2, K_CHUNK=SMALL_T_K_CHUNK,
        NUM_SPLITS=splits, S_P2=triton.next_power_of_2(splits), NUM_EB=num_eb,
        DOT_PRECISION="ieee" if interpreting() else _DOT_INPUT[precision], SPLIT_W=precision == "tf32x2w",
        TOPK=top_k, OUT_COLS=cols, OUT_P2=triton.next_power_of_2(cols), HAS_BIAS=e_score_correction_bias is not None,
        SHARED=shared_expert, num_warps=4 if block_t <= 32 else 8, num_stages=3,
    )
    return ids, ws


def moe_router_logits_triton(x: torch.Tensor, gate_weight: torch.Tensor, splits: Optional[int] = 1,
                             precision: Optional[str] = None) -> torch.Tensor:
    """The kernel's [T, E] fp32 logits alone (tests, A/B): `_router_logits_kernel` at `precision` (as
    `moe_router_kernel`'s) into a [splits, T, E] partial buffer; splits = 1 gives exactly the logits the fused
    epilogue routes, splits > 1 their torch sum over splits (within rounding of `_router_topk_kernel`'s
    fixed-order sum)."""
    T, H = x.shape
    E = gate_weight.shape[0]
    precision = router_precision(T, x.dtype, ROUTER_LARGE_T_PRECISION if precision is None else precision)
    cfg = router_launch(max(T, 1), H, E, x.device, splits)
    part = torch.zeros((cfg.splits, T, E), dtype=torch.float32, device=x.device)
    if T:
        _launch_logits(x if x.stride(1) == 1 else x.contiguous(), gate_weight.contiguous(), cfg, precision, part)
    return part.sum(0) if cfg.splits > 1 else part[0]


def _launch_logits(x: torch.Tensor, gate_weight: torch.Tensor, cfg: RouterLaunch, precision: str, out, bias=None,
                   top_k: int = 1, scaling: float = 1.0, shared: bool = False) -> None:
    """One `_router_logits_kernel` launch at `precision` (resolved by `router_precision`; under the interpreter
    every dot is "ieee", "tf32x2w" still splits W). out = (ids, weights): fused routing (cfg.splits must be 1);
    out = a [splits, T, E] fp32 tensor: the partial logits (bias, top_k, scaling, shared unused)."""
    T, H = x.shape
    E = gate_weight.shape[0]
    fused = isinstance(out, tuple)
    assert not fused or cfg.splits == 1
    part, (ids, ws) = (None, out) if fused else (out, (out, out))
    _router_logits_kernel[(triton.cdiv(T, cfg.block_t), cfg.splits)](
        x, gate_weight, _bias(bias, E, gate_weight), part if part is not None else ws, ids, ws,
        T, H, E, x.stride(0), gate_weight.stride(0), cfg.k_chunk, float(scaling),
        BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, E_P2=cfg.e_p2, EVEN_K=H % cfg.block_k == 0,
        DOT_PRECISION="ieee" if interpreting() else _DOT_INPUT[precision], SPLIT_W=precision == "tf32x2w",
        PROMOTE_K=max(TF32X2W_PROMOTE_K // cfg.block_k, 1) * cfg.block_k,
        FUSED=fused, TOPK=top_k, OUT_COLS=top_k + int(shared), OUT_P2=triton.next_power_of_2(top_k + int(shared)),
        HAS_BIAS=fused and bias is not None, SHARED=shared, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def moe_router_ref(
    x: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
    routed_scaling_factor: float = 1.0, shared_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference: choice in fp32 exactly as specified (stable sort: lower id wins ties), weights in
    float64 then cast to fp32."""
    logits = router_logits(x, gate_weight)
    sig = torch.sigmoid(logits)
    choice = sig + (e_score_correction_bias.float() if e_score_correction_bias is not None else 0.0)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = sig.double().gather(1, ids)
    w = w / w.sum(dim=-1, keepdim=True) * routed_scaling_factor
    if shared_expert:
        T, E = logits.shape
        ids = torch.cat([ids, torch.full((T, 1), E, dtype=ids.dtype, device=ids.device)], dim=1)
        w = torch.cat([w, torch.ones((T, 1), dtype=w.dtype, device=w.device)], dim=1)
    return ids.to(torch.int32), w.float()


@timed_op
def moe_router(
    x: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
    routed_scaling_factor: float = 1.0, shared_expert: bool = False, *, use_triton: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching entry point: `moe_router_triton` (the op's rule) when asked for (`use_triton`) and eligible, else
    `moe_router_ref`; recorded as op "moe_router", the bucket naming the fast path's `router_path`."""
    reason = triton_ok(x, gate_weight)
    run_fast = decide_triton(OP, x.shape[0], use_triton, reason, path=router_path(x.shape[0], x.dtype))
    if run_fast:
        return moe_router_triton(x, gate_weight, e_score_correction_bias, top_k, routed_scaling_factor, shared_expert)
    return moe_router_ref(x, gate_weight, e_score_correction_bias, top_k, routed_scaling_factor, shared_expert)
