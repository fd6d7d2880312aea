"""FP8 w8a8 block-scaled dense GEMM: y = dequant(a_q, a_scale) @ dequant(w_q, w_scale)^T.

Inputs (formats in ladle/kernels/fp8_quant.py): activations a_q [M, K] float8_e4m3fn with a_scale [M, ceil(K/128)]
float32 (per token per 128-element K group, quantized at run time by op "fp8_act_quant"); weight w_q [N, K]
float8_e4m3fn (K contiguous, kernels_and_limits.md §5) with w_scale [N, ceil(K/128)] float32: one scale per
output row per 128-wide K group ("row-expanded" block scales), any strides (the FP8 linears store it N-minor,
strides (1, N), for the scaled_mm path below). A 128x128-block checkpoint is stored with its block scale repeated
over the block's 128 rows (same values, so the product is unchanged); that makes merged layers (q|k|v, gate|up)
whose pieces do not start on a 128-row boundary, and tensor-parallel row slices, exact. Cost: the scales add
4/128 = 3.1% to the weight bytes read (a 128-row-block variant for aligned layers is a follow-up).

MXFP8 weights (design/minimax_m3.md §2.2) run as stored: w_scale [N, K/32] uint8 E8M0 (2^(byte - 127)), one per 32
K elements; the kernel then steps K by 32 (BLOCK_K = the weight group) and converts the byte in registers. Keeping
the release bytes is exact by construction; re-laying them to 128-groups would round small elements of groups
whose exponent is below the 128-group maximum (kernels_and_limits.md §5), and dequantising to bf16 doubles the
bytes. The price is a K=32 MMA per step (4x the scale multiplies of the 128 path): measure on the H200.

Math (block-wise mode of kernels_and_limits.md §1.2): for each K step kb of the weight group (128, or 32 for MXFP8),
    acc[m, n] += (a_q[m, kb] . w_q[n, kb]) * a_scale[m, kb*BK // 128] * w_scale[n, kb]
in float32, so every K step is promoted out of the fp8 MMA accumulator (DeepSeek-V3 §3.3.2). BLOCK_K is therefore
the weight group; BLOCK_N is free (the weight scale is loaded per column). Ragged M, N, K are masked.

Kernel `_fp8_gemm_kernel`: grid (cdiv(M, BM), cdiv(N, BN), split_k); the tile is chosen from the local M
(`select_gemm_config`). At decode sizes the K groups are split over `split_k` programs per tile
(`default_split_k`: too few tiles to keep the weight stream in flight otherwise); each writes an fp32 partial and
the last to arrive sums the partials in split order (deterministic) and writes y (counters: split_counters.py).
`fp8_gemm_ref` dequantizes both operands and multiplies in `compute_dtype`.

Prefill path "scaled_mm" (op "fp8_gemm_scaled_mm" in the dispatch record): at M >= SCALED_MM_MIN_TOKENS the same
math runs as torch._scaled_mm's block-wise (1x128, 1x128) recipe (cuBLASLt VEC128_32F scales, both operands): the
row-expanded weight scales ARE 1x128 blocks of w_q, so no checkpoint change. cuBLASLt applies the two scales to each
128-wide K block's fp32 partial product, like this kernel (the two differ by float32 summation order). Layouts
torch checks (aten ScaledBlas.cpp `is_blockwise_1x128_scaling`): a row-major [M, K] with scale_a [M, K/128] M-major
(strides (1, M), written so by `act_quant(..., m_major_scale=True)`); b = w_q.t() (column-major [K, N]) with
scale_b [K/128, N] contiguous = w_scale.t(), a view: `Fp8LinearMethod` stores w_scale N-minor (strides (1, N),
ladle/quant/fp8.py), so no transpose copy of N*K/32 bytes runs per call (a row-major w_scale is still copied).
cuBLAS >= 12.9 on sm_90 only; `scaled_mm_support` tries it once per device (a 128 x 128 x 512 product checked
against `fp8_gemm_ref`) and its failure reason is what the dispatch record shows. Eligibility: `scaled_mm_ineligible`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ladle.kernels._common import (MAX_TOKENS, decide_triton, interpreting, num_sms, tile_row, tl, triton,
                                   triton_ok)
from ladle.kernels.fp8_quant import (FP8_DTYPE, GROUP, MX_GROUP, act_quant, act_quant_ref, dequant_block_fp8,
                                     quantize_fp8_rows)
from ladle.kernels.split_counters import arrive, release, split_counters
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "fp8_gemm"
OP_SCALED_MM = "fp8_gemm_scaled_mm"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); fp8 e4m3 weight [N, K] + [N, K/128] fp32 scales")
dispatch.register(OP_SCALED_MM, "scaled_mm", "asked for at M >= SCALED_MM_MIN_TOKENS; cuda sm_90 with block-wise "
                  "torch._scaled_mm (probed once per device); fp32 128-group weight scales (not MXFP8); K % 128 == 0, "
                  "N % 16 == 0 (M padded to a multiple of 4)")

# Smallest local M (tokens) that asks for the "scaled_mm" path; below it the Triton kernel runs. H200, 2026-12-02
# (benchmarks/gpu_fp8_gemm_ab.py, benchmarks/results/round7/kernels/call2_fp8_gemm_ab.log; whole op incl. act_quant):
# scaled_mm 1.18-1.77x the Triton kernel at M = 128, 1.23-1.67x at 1024, 1.58-1.89x at 8192 on the six TP4-rank
# shapes. Round 10 call 5 (benchmarks/gpu_fp8_gemm_decode_ab.py, results/round10/call5; the GEMM with the per-call
# scale transpose, against the Triton kernel at its default split): qkv 2688 x 6144 / o_proj 6144 x 2048 at M = 64
# 1.77x / 1.60x, at M = 32 1.10x / 1.10x, at M = 8 0.81x / 1.00x, at M = 1 0.80x / 0.94x: then from 17 tokens.
# Session 11 call 1 (same script, results/round11/call1): with the linears' N-minor scales (no per-call transpose)
# scaled_mm against the Triton default: qkv 10.1 / 9.9 / 10.8 / 10.1 us vs 10.2 / 10.1 / 14.2 / 23.0 at M = 1 / 8 /
# 32 / 64, o_proj 6.4 / 6.6 / 6.7 / 7.2 vs 8.2 / 8.7 / 10.0 / 15.0: at every decode size. So every M; the Triton
# kernel keeps MXFP8, non-sm_90 devices and shapes scaled_mm refuses (`scaled_mm_ineligible`).
SCALED_MM_MIN_TOKENS = 1
# cuBLASLt's block-wise recipe wants the M-major scale_a columns 16-byte aligned: M a multiple of 4 (an M of 4k + 2
# fails with CUBLAS_STATUS_NOT_SUPPORTED, round 7's gpu_fp8_gemm_ab.py). `fp8_linear` quantizes into rows padded to
# this multiple (zeros, scale 1; `act_quant` pad_rows_to) and keeps the first M output rows, instead of sending the
# whole step to the Triton kernel (round 10: 3 of 7 sampled 32K-token prefill steps ran all 126 dense GEMMs there).
SCALED_MM_ROW_MULTIPLE = 4


@dataclass(frozen=True)
class GemmTileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Tile table per weight format, in the bucket layout of ladle/kernels/_common.py (`tile_row`: the first bucket with
# num_tokens <= bound wins). "fp8": 128-group fp32 scales (K step 128); "mxfp8": E8M0 32-group scales (K step 32).
# benchmarks/gpu_fp8_tiles.py measures these on the H200 and prints replacement entries.
# Measured on the H200, 2026-12-01: benchmarks/gpu_fp8_tiles.py (results: benchmarks/results/round3/fp8_tiles.*),
# the best of 10 configs per (format, M) by summed time over the TP4-rank shapes, each checked against the reference.
GEMM_TILES: dict[str, tuple[tuple[int, GemmTileConfig], ...]] = {
    "fp8": ((16, GemmTileConfig(block_m=16, block_n=16, num_warps=2, num_stages=5)),
            (64, GemmTileConfig(block_m=16, block_n=32, num_warps=4, num_stages=4)),
            (256, GemmTileConfig(block_m=64, block_n=64, num_warps=4, num_stages=4)),
            (MAX_TOKENS, GemmTileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3))),
    "mxfp8": ((16, GemmTileConfig(block_m=16, block_n=32, num_warps=4, num_stages=6)),
              (64, GemmTileConfig(block_m=16, block_n=64, num_warps=4, num_stages=6)),
              (256, GemmTileConfig(block_m=64, block_n=128, num_warps=4, num_stages=6)),
              (MAX_TOKENS, GemmTileConfig(block_m=64, block_n=128, num_warps=4, num_stages=5))),
}


def select_gemm_config(num_tokens: int, kernel: str = "fp8") -> GemmTileConfig:
    """Decode sizes (M <= 64) stream the weight with the smallest MMA M tile and narrow N tiles for more CTAs;
    larger M reuses each weight tile over 64-128 rows. `kernel` ("fp8" | "mxfp8") names the GEMM_TILES row.
    Rows measured on the H200 (benchmarks/gpu_fp8_tiles.py)."""
    return tile_row(GEMM_TILES[kernel], num_tokens)[1]


@triton.jit
def load_weight_scale(ptrs, mask, E8M0: tl.constexpr):
    """One K step's weight scales [BN] as float32: fp32 as stored, or uint8 E8M0 bytes -> 2^(byte - 127)."""
    # one return after if/else: Triton's compiler type-checks an early `return` inside a constexpr branch against the
    # return after it ("Inconsistent return types: fp32 and uint8" on the H200, 2026-12-01)
    if E8M0:
        scale = tl.exp2(tl.load(ptrs, mask=mask, other=127).to(tl.float32) - 127.0)
    else:
        scale = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return scale


@triton.jit
def fp8_dot(a, w, F32_DOT: tl.constexpr):
    """dot(a [BM, BK] fp8, w [BK, BN] fp8) in fp32; F32_DOT (the interpreter): exact fp32 products of fp8 values."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(a, w)


@triton.jit
def fp8_dot_step(a, a_s, w, w_s, acc, F32_DOT: tl.constexpr):
    """acc + dot(a [BM, BK] fp8, w [BK, BN] fp8) * a_s[:, None] * w_s[None, :] (one promoted K step; shared with fused_moe_fp8.py)."""
    return acc + fp8_dot(a, w, F32_DOT) * a_s[:, None] * w_s[None, :]


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, num_kb, num_akb,
    stride_am, stride_wn, stride_wsn, stride_wsk, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, E8M0: tl.constexpr, F32_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr, KB_PER_SPLIT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BK)
    kb_lo = split * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, num_kb)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + kb_lo * BK + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + kb_lo * BK + offs_k[:, None]  # [BK, BN] view of [N, K]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * num_akb
    ws_ptrs = ws_ptr + offs_n.to(tl.int64) * stride_wsn  # w_scale (n, kb) at n * stride_wsn + kb * stride_wsk
    acc = tl.zeros([BM, BN], tl.float32)
    for kb in range(kb_lo, kb_hi):
        k_ok = offs_k + kb * BK < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb * BK // 128, mask=m_ok, other=0.0)  # activation groups are 128 wide
        w_s = load_weight_scale(ws_ptrs + kb * stride_wsk, n_ok, E8M0)
        acc = fp8_dot_step(a, a_s, w, w_s, acc, F32_DOT)
        a_ptrs += BK
        w_ptrs += BK
    mn_ok = m_ok[:, None] & n_ok[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mn_ok)
    else:
        # partials [SPLIT_K, M, N] fp32; the last of the SPLIT_K programs of this (m, n) tile sums them in split
        # order (deterministic whatever the arrival order) and writes y (counter protocol: split_counters.py)
        tile = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptr + split.to(tl.int64) * M * N + tile, acc, mask=mn_ok)
        cnt = cnt_ptr + pid_m * tl.num_programs(1) + pid_n
        if arrive(cnt, SPLIT_K):
            tl.debug_barrier()
            total = tl.zeros([BM, BN], tl.float32)
            for s in range(0, SPLIT_K):
                total += tl.load(part_ptr + s * M * N + tile, mask=mn_ok, other=0.0, cache_modifier=".cg")
            tl.store(y, total.to(y_ptr.dtype.element_ty), mask=mn_ok)
            release(cnt)


# Split-K at decode sizes (M <= SPLIT_K_MAX_M): a decode GEMM has too few (M, N) tiles to keep enough weight bytes in
# flight per SM (latency-bound: each tile walks all K groups in sequence), so its K groups are split over
# programs until there are about SPLIT_K_CTAS_PER_SM programs per SM, each keeping >= SPLIT_K_MIN_STEPS K steps.
# H200, 2026-12-02 (benchmarks/gpu_fp8_gemm_decode_ab.py, results/round7/kernels/call2_fp8_gemm_decode_ab.log):
# N x K = 2688 x 6144 (48 groups) gains 1.67-1.75x at M = 1 / 8 and 1.40x at M = 32 with 4 splits, nothing at 64;
# 6144 x 2048 (16 groups) loses with any split beyond 2 (0.65-0.9x at 4-8), hence 12 groups per split at least.
SPLIT_K_MAX_M = 64
SPLIT_K_CTAS_PER_SM = 8
SPLIT_K_MIN_STEPS = 12
SPLIT_K_MAX = 8
COUNTER_KEY = OP


def default_split_k(m: int, n: int, num_kb: int, cfg: GemmTileConfig, device: torch.device) -> int:
    """Splits of the K groups from shape constants only (CUDA-graph safe): 1 above SPLIT_K_MAX_M, else the largest
    power of two <= SPLIT_K_CTAS_PER_SM * SMs / tiles, at most SPLIT_K_MAX and num_kb / SPLIT_K_MIN_STEPS."""
    if m > SPLIT_K_MAX_M:
        return 1
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    want = max(1, SPLIT_K_CTAS_PER_SM * num_sms(device) // tiles)
    cap = max(1, min(SPLIT_K_MAX, num_kb // SPLIT_K_MIN_STEPS))
    return 1 << (min(want, cap).bit_length() - 1)


def fp8_gemm_triton(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, config: Optional[GemmTileConfig] = None,
                    split_k: Optional[int] = None) -> torch.Tensor:
    """a_q [M, K] fp8, a_scale [M, ceil(K/128)] fp32 contiguous, w_q [N, K] fp8 (K contiguous), w_scale
    [N, ceil(K/128)] fp32 (MXFP8: uint8 [N, K/32]) of any strides (row-major, or the linears' N-minor (1, N))
    -> y [M, N] in out_dtype. No host sync; grid from shapes only. split_k: programs per (M, N) tile over the K
    groups (None: `default_split_k`); with split_k > 1 the partials go to fp32 scratch and the last program of each
    tile sums them in split order, using (and leaving zero) the counters `split_counters("fp8_gemm", ...)` (the
    first call at a larger tile count must be eager: it may allocate)."""
    m, k = a_q.shape
    n, kw = w_q.shape
    w_group = weight_group(w_scale)
    num_kb = triton.cdiv(k, w_group)
    assert kw == k and a_q.dtype == w_q.dtype == FP8_DTYPE, f"a {tuple(a_q.shape)} w {tuple(w_q.shape)}"
    assert a_scale.shape == (m, triton.cdiv(k, GROUP)) and w_scale.shape == (n, num_kb)
    assert a_scale.dtype == torch.float32 and a_scale.is_contiguous()  # w_scale: read through its strides
    assert a_q.stride(1) == 1 and w_q.stride(1) == 1
    y = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0:
        return y
    e8m0 = w_scale.dtype == torch.uint8
    cfg = config or select_gemm_config(m, "mxfp8" if e8m0 else "fp8")
    if split_k is None:
        split_k = default_split_k(m, n, num_kb, cfg, a_q.device)
    assert split_k >= 1 and split_k & (split_k - 1) == 0, f"split_k {split_k}: a power of two"
    per = triton.cdiv(num_kb, split_k)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
    if split_k > 1:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=a_q.device)
        counters = split_counters(COUNTER_KEY, a_q.device, grid[0] * grid[1])
    else:
        part = counters = y  # unused
    _fp8_gemm_kernel[grid](a_q, a_scale, w_q, w_scale, y, part, counters, m, n, k, num_kb, a_scale.shape[1],
                           a_q.stride(0), w_q.stride(0), w_scale.stride(0), w_scale.stride(1), y.stride(0),
                           BM=cfg.block_m, BN=cfg.block_n, BK=w_group, E8M0=e8m0, F32_DOT=interpreting(),
                           SPLIT_K=split_k, KB_PER_SPLIT=per,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def weight_group(w_scale: torch.Tensor) -> int:
    """K elements per weight scale: 32 for MXFP8's uint8 E8M0 scales, 128 for float32 block scales."""
    assert w_scale.dtype in (torch.uint8, torch.float32), w_scale.dtype
    return MX_GROUP if w_scale.dtype == torch.uint8 else GROUP


def fp8_gemm_ref(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference: dequantize both operands (exact) and multiply in `compute_dtype` (float64 in tests)."""
    a = dequant_block_fp8(a_q, a_scale, compute_dtype)
    w = dequant_block_fp8(w_q, w_scale, compute_dtype)
    return (a @ w.T).to(out_dtype)


def fp8_gemm_ineligible(x: torch.Tensor, w_q: torch.Tensor) -> Optional[str]:
    """Eligibility rule of the Triton path: None when it may run, else the reason."""
    reason = triton_ok(x, w_q)
    if reason:
        return reason
    if w_q.dtype != FP8_DTYPE or w_q.stride(-1) != 1:
        return f"weight {w_q.dtype} (needs float8_e4m3fn, K contiguous)"
    return None


def fp8_gemm_scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """The "scaled_mm" path (module doc): a_q [M, K] fp8 row-major, a_scale [M, K/128] float32 M-major (strides
    (1, M)), w_q [N, K] fp8, w_scale [N, K/128] float32 -> y [M, N] in out_dtype, by torch._scaled_mm's (1x128,
    1x128) recipe. M a multiple of SCALED_MM_ROW_MULTIPLE (cuBLASLt; `fp8_linear` pads). Checks no eligibility
    (`scaled_mm_ineligible` does). scale_b = w_scale.t() [K/128, N] must be contiguous: a view for the linears'
    N-minor w_scale (strides (1, N)), a per-call copy for a row-major one."""
    scale_b = w_scale.t()
    if not scale_b.is_contiguous():
        scale_b = scale_b.contiguous()
    return torch._scaled_mm(a_q, w_q.t(), a_scale, scale_b, out_dtype=out_dtype)


_SCALED_MM_SUPPORT: dict[int, Optional[str]] = {}  # CUDA device index -> None (works) or why not


def scaled_mm_support(device: torch.device) -> Optional[str]:
    """None when torch._scaled_mm's block-wise recipe runs on `device` (CUDA) and matches `fp8_gemm_ref`, else the
    reason. Probed once per CUDA device and cached; not while a CUDA graph is being captured (that call answers "not
    probed yet" and a later eager call probes)."""
    if device.type != "cuda":
        return f"device {device.type} (needs cuda)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SCALED_MM_SUPPORT:
        if torch.cuda.is_current_stream_capturing():
            return "scaled_mm support not probed yet (CUDA graph capture)"
        _SCALED_MM_SUPPORT[index] = _probe_scaled_mm(torch.device("cuda", index))
    return _SCALED_MM_SUPPORT[index]


def _probe_scaled_mm(device: torch.device) -> Optional[str]:
    """One 128 x 128 x 512 block-scaled product through `fp8_gemm_scaled_mm`, checked against `fp8_gemm_ref`
    (relative error < 1e-3: the two differ by summation order and the tensor cores' fp8 accumulation inside a K
    block, ~1e-4 at most); K groups of very different ranges so a misread scale layout shows. Returns None or the
    reason (the exception's first line, or the error)."""
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"sm_{major}{minor}: torch._scaled_mm's block-wise 1x128 recipe (cuBLASLt) runs on sm_90 only"
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(128, 512, device=device, generator=gen) * torch.logspace(-2, 2, 512, device=device)
    w = torch.randn(128, 512, device=device, generator=gen) * torch.logspace(2, -2, 512, device=device)
    (a_q, a_s), (w_q, w_s) = act_quant_ref(x, m_major_scale=True), quantize_fp8_rows(w)
    try:
        y = fp8_gemm_scaled_mm(a_q, a_s, w_q, w_s, torch.float32)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"torch._scaled_mm block-wise failed: {type(exc).__name__}: {first[:160]}"
    ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    err = ((y - ref).norm() / ref.norm()).item()
    if not err < 1e-3:  # NaN fails too
        return f"torch._scaled_mm block-wise differs from fp8_gemm_ref: relative error {err:.1e}"
    return None


def scaled_mm_ineligible(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> Optional[str]:
    """Eligibility rule of the "scaled_mm" path for x [M, K], w_q [N, K], w_scale: None when it may run, else the
    reason (one fixed wording per cause, so the dispatch record counts one reason per cause). Format and shape
    first; the device and its one-time probe (`scaled_mm_support`) last."""
    k, n = x.shape[1], w_q.shape[0]
    if w_scale.dtype != torch.float32:
        return f"weight scales {w_scale.dtype} (scaled_mm takes float32 128-group scales; MXFP8 runs on Triton)"
    if w_q.dtype != FP8_DTYPE or w_q.stride(-1) != 1:
        return f"weight {w_q.dtype} (needs float8_e4m3fn, K contiguous)"
    if k % GROUP or n % 16:
        return f"K {k} not a multiple of 128 or N {n} of 16"
    if w_q.device != x.device:
        return "x and weight on different devices"
    return scaled_mm_support(x.device)


def _decide_path(x2: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, use_triton: bool) -> str:
    """The path of one fp8_linear call, "scaled_mm" | "triton" | "ref", recorded in ladle.observe.dispatch: the path
    that runs first (op_timing names a timed call after its first decision). "scaled_mm" is asked for (configured)
    when the fast kernels are (`use_triton`) and M >= SCALED_MM_MIN_TOKENS; its fallback reason is then counted."""
    m = x2.shape[0]
    wanted = use_triton and m >= SCALED_MM_MIN_TOKENS
    reason = scaled_mm_ineligible(x2, w_q, w_scale) if wanted else None
    if wanted and reason is None:
        dispatch.decide(OP_SCALED_MM, dispatch.tokens_bucket(m), configured=True, ineligible_reason=None)
        return "scaled_mm"
    fast = decide_triton(OP, m, use_triton, fp8_gemm_ineligible(x2, w_q))
    if wanted:
        dispatch.decide(OP_SCALED_MM, dispatch.tokens_bucket(m), configured=True, ineligible_reason=reason)
    return "triton" if fast else "ref"


@timed_op
def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
               *, use_triton: bool) -> torch.Tensor:
    """y = x W^T (+ b) with W block-FP8: x [..., K] float -> activations quantized per token per 128-group
    (op "fp8_act_quant"), then the w8a8 GEMM: op "fp8_gemm_scaled_mm" at prefill sizes where eligible, else op
    "fp8_gemm" (bucket = M). Returns [..., N] in x.dtype. Every path quantizes the activations identically, so they
    differ only by float32 summation order."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    path = _decide_path(x2, w_q, w_scale, use_triton)
    if path == "scaled_mm":
        a_q, a_scale = act_quant(x2.contiguous(), use_triton=True, m_major_scale=True,
                                 pad_rows_to=SCALED_MM_ROW_MULTIPLE)
        y = fp8_gemm_scaled_mm(a_q, a_scale, w_q, w_scale, x.dtype)[:x2.shape[0]]  # the first M rows: contiguous
    elif path == "triton":
        a_q, a_scale = act_quant(x2.contiguous(), use_triton=True)
        y = fp8_gemm_triton(a_q, a_scale, w_q, w_scale, x.dtype)
    else:
        a_q, a_scale = act_quant(x2.contiguous(), use_triton=False)
        y = fp8_gemm_ref(a_q, a_scale, w_q, w_scale, x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, w_q.shape[0])
