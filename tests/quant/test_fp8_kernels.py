"""FP8 kernels (ladle/kernels/fp8_quant.py, fp8_gemm.py, fused_moe_fp8.py) under the Triton interpreter against their
float64 dequantized references, on fresh random inputs with ragged shapes (K, N not multiples of 128).

Error budgets: the kernel and its reference quantize the activations identically (same bytes), so they differ only
by float32 summation order: relative error < 1e-5 for the GEMM. The MoE's intermediate is re-quantized to fp8 after
the swigluoai epilogue; a summation-order difference can move one intermediate value across an fp8 rounding boundary
(a 2^-4 relative step on that element), hence the MoE budget 2e-3 (observed ~1e-6 when no value flips).
Against the unquantized float64 product the w8a8 error is a few percent (e4m3 keeps 3 mantissa bits: 2^-4 relative
rounding per element, averaging down over K): asserted < 8%.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from ladle.kernels.fp8_gemm import GemmTileConfig, fp8_gemm_ref, fp8_gemm_triton, fp8_linear
from ladle.kernels.fp8_quant import (act_quant_ref, act_quant_triton, dequant_block_fp8, quantize_block_fp8,
                                     quantize_fp8_rows, quantize_mxfp8)
from ladle.kernels.fused_moe import MoETileConfig, fused_moe_ref
from ladle.kernels.fused_moe_fp8 import (GLUON_OP, Fp8MoEOptions, compile_gemm2_gluon_sm90, fp8_moe_gemm2,
                                         fp8_moe_plan, fused_moe_fp8, fused_moe_fp8_ref, fused_moe_fp8_triton)
from ladle.kernels.moe_router import moe_router_triton
from ladle.observe import dispatch


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_act_quant_triton_matches_reference_bytes():
    x = torch.randn(7, 300) * torch.logspace(-3, 2, 300)  # groups with very different ranges
    q, s = act_quant_ref(x)
    q2, s2 = act_quant_triton(x)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert s.shape == (7, 3) and q.abs().float().max() <= 448
    assert _rel(dequant_block_fp8(q, s, torch.float64), x) < 0.04


def test_act_quant_triton_multi_group_programs_match_reference_bytes():
    """K = 2,100: 17 groups, so programs of 8 groups with a ragged last chunk (one group, itself ragged) and a
    masked tail of 7 groups; rows with a zero group (the eps floor)."""
    x = torch.randn(5, 2100) * torch.logspace(-2, 3, 2100)
    x[2, 128:256] = 0.0
    q, s = act_quant_ref(x)
    q2, s2 = act_quant_triton(x)
    assert s.shape == (5, 17)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert _rel(dequant_block_fp8(q, s, torch.float64), x) < 0.04


def test_block_quantize_ragged_grid_and_row_expansion():
    w = torch.randn(130, 200)
    q, s = quantize_block_fp8(w)
    assert s.shape == (2, 2)
    qr, sr = quantize_fp8_rows(w)
    assert sr.shape == (130, 2) and torch.equal(sr[127], s[0]) and torch.equal(sr[128], s[1])
    assert torch.equal(dequant_block_fp8(q, s), dequant_block_fp8(qr, sr))
    assert _rel(dequant_block_fp8(q, s, torch.float64), w) < 0.04


@pytest.mark.parametrize("m,n,k,cfg", [(3, 130, 200, None), (37, 96, 256, GemmTileConfig(16, 32, 4, 2)),
                                       (70, 260, 136, None)])
def test_fp8_gemm_against_float64(m, n, k, cfg):
    x, w = torch.randn(m, k), torch.randn(n, k) / k ** 0.5
    a_q, a_s = act_quant_ref(x)
    w_q, w_s = quantize_fp8_rows(w)
    y = fp8_gemm_triton(a_q, a_s, w_q, w_s, torch.float32, config=cfg)
    assert _rel(y, fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float64, torch.float64)) < 1e-5
    assert _rel(y, x.double() @ w.double().T) < 0.08


@pytest.mark.parametrize("m,n,k", [(5, 72, 224), (33, 40, 96)])
def test_mxfp8_gemm_as_released_against_float64(m, n, k):
    """MXFP8 weights (uint8 E8M0 per 32 K elements) run as stored: K steps of 32 in the kernel."""
    x, w = torch.randn(m, k), torch.randn(n, k) * torch.logspace(-2, 1, k)  # groups of very different exponents
    a_q, a_s = act_quant_ref(x)
    w_q, w_s = quantize_mxfp8(w)
    y = fp8_gemm_triton(a_q, a_s, w_q, w_s, torch.float32, config=GemmTileConfig(16, 32, 4, 2))
    assert _rel(y, fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float64, torch.float64)) < 1e-5
    assert _rel(y, x.double() @ w.double().T) < 0.08


@pytest.mark.parametrize("m,n,k,split_k,quantize", [(3, 130, 1000, 2, quantize_fp8_rows),
                                                     (17, 72, 1100, 8, quantize_fp8_rows),
                                                     (5, 40, 544, 4, quantize_mxfp8)])
def test_fp8_gemm_split_k_against_float64(m, n, k, split_k, quantize):
    """Split-K (decode sizes): K groups over split_k programs per tile, the last arriving one sums the fp32 partials
    in split order. Ragged M, N, K; 1000 = 8 groups over 2; 1100 = 9 groups over 8 (splits of 2: the last ones
    empty); MXFP8's 32-groups (544 = 17 groups over 4, the last split short). Same error budget as without splits
    (float32 summation order); a second call gives the same bits (fixed order); the counters are back to zero."""
    from ladle.kernels.split_counters import split_counters

    x, w = torch.randn(m, k), torch.randn(n, k) * torch.logspace(-1, 1, k) / k ** 0.5
    a_q, a_s = act_quant_ref(x)
    w_q, w_s = quantize(w)
    cfg = GemmTileConfig(16, 32, 4, 2)
    y = fp8_gemm_triton(a_q, a_s, w_q, w_s, torch.float32, config=cfg, split_k=split_k)
    assert _rel(y, fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float64, torch.float64)) < 1e-5
    assert _rel(y, x.double() @ w.double().T) < 0.08
    assert torch.equal(fp8_gemm_triton(a_q, a_s, w_q, w_s, torch.float32, config=cfg, split_k=split_k), y)
    assert int(split_counters("fp8_gemm", torch.device("cpu"), 1).abs().sum()) == 0


@pytest.mark.parametrize("split_k", [1, 2])
def test_fp8_gemm_n_minor_weight_scales(split_k):
    """w_scale is read through its strides: the N-minor layout of the linears' scales (strides (1, N), the
    transpose of a contiguous [K/128, N]) gives the row-major result bit for bit, within the float64 budget. K groups
    of very different ranges, so a scale read at the wrong (n, kb) shows."""
    m, n, k = 7, 72, 256
    x, w = torch.randn(m, k), torch.randn(n, k) * torch.logspace(-2, 2, k) / k ** 0.5
    a_q, a_s = act_quant_ref(x)
    w_q, w_s = quantize_fp8_rows(w)
    w_s_nm = w_s.t().contiguous().t()
    assert w_s_nm.stride() == (1, n) and w_s.stride() == (2, 1) and torch.equal(w_s_nm, w_s)
    cfg = GemmTileConfig(16, 32, 4, 2)
    y = fp8_gemm_triton(a_q, a_s, w_q, w_s, torch.float32, config=cfg, split_k=split_k)
    y_nm = fp8_gemm_triton(a_q, a_s, w_q, w_s_nm, torch.float32, config=cfg, split_k=split_k)
    assert torch.equal(y_nm, y)
    assert _rel(y_nm, fp8_gemm_ref(a_q, a_s, w_q, w_s_nm, torch.float64, torch.float64)) < 1e-5
    assert _rel(y_nm, x.double() @ w.double().T) < 0.08


def test_fp8_gemm_default_split_k_rule():
    """Split only at decode sizes, from shape constants: a power of two, <= 8, >= 12 K groups per split."""
    from ladle.kernels.fp8_gemm import SPLIT_K_MAX_M, default_split_k

    cpu, cfg = torch.device("cpu"), GemmTileConfig(16, 32, 4, 4)  # the interpreter counts 4 SMs
    assert default_split_k(SPLIT_K_MAX_M + 1, 32, 48, cfg, cpu) == 1
    assert default_split_k(1, 32, 48, cfg, cpu) == 4  # 1 tile on 4 "SMs": 32 wanted, 48 groups allow 4 splits
    assert default_split_k(1, 32, 36, cfg, cpu) == 2  # 36 groups: at most 3 splits of >= 12 -> 2
    assert default_split_k(1, 32, 16, cfg, cpu) == 1  # o_proj's 16 groups: no split
    assert default_split_k(32, 32 * 16, 48, cfg, cpu) == 1  # 32 tiles >= 8 per SM already


def test_fp8_linear_dispatch_record_and_bias():
    dispatch.reset()
    x, w, b = torch.randn(2, 5, 160), torch.randn(48, 160), torch.randn(48)
    w_q, w_s = quantize_fp8_rows(w)
    fast = fp8_linear(x, w_q, w_s, b, use_triton=True)
    slow = fp8_linear(x, w_q, w_s, b, use_triton=False)
    assert fast.shape == (2, 5, 48) and _rel(fast, slow) < 1e-5
    rows = dispatch.snapshot()["ops"]["fp8_gemm"]["buckets"]["T<=16"]
    assert rows == {"configured": 1, "eligible": 2, "executed": 1, "calls": 2}


@pytest.mark.parametrize("T,cfg", [(11, MoETileConfig(16, 16, 32, 128, 4, 2)), (40, None)])
def test_fused_moe_fp8_with_shared_expert(T, cfg):
    H, I, E, k = 136, 160, 6, 2  # both K dims ragged over 128
    x = torch.randn(T, H)
    ids, wts = moe_router_triton(x, torch.randn(E, H), torch.randn(E) * 0.3, k, 2.0, shared_expert=True)
    w13 = torch.randn(E + 1, 2 * I, H) * 0.6 / H ** 0.5 * 4
    w2 = torch.randn(E + 1, H, I) / I ** 0.5
    w13_q, w13_s = quantize_fp8_rows(w13)
    w2_q, w2_s = quantize_fp8_rows(w2)
    out = fused_moe_fp8_triton(x, w13_q, w13_s, w2_q, w2_s, ids, wts, config=cfg)
    ref = fused_moe_fp8_ref(x, w13_q, w13_s, w2_q, w2_s, ids, wts)
    assert _rel(out, ref) < 2e-3
    assert _rel(out, fused_moe_ref(x, w13, w2, ids, wts)) < 0.08
    slow = fused_moe_fp8(x, w13_q, w13_s, w2_q, w2_s, ids, wts, use_triton=False)
    assert _rel(slow, ref) < 2e-3  # float32 vs float64 reference: the same intermediate fp8 flips as the kernel


def test_fused_moe_mxfp8_as_released():
    T, H, I, E = 13, 96, 64, 5
    x = torch.randn(T, H)
    ids, wts = moe_router_triton(x, torch.randn(E, H), torch.zeros(E), 2, 2.0, shared_expert=True)
    w13 = torch.randn(E + 1, 2 * I, H) / H ** 0.5 * 3
    w2 = torch.randn(E + 1, H, I) / I ** 0.5
    w13_q, w13_s = (torch.stack(t) for t in zip(*[quantize_mxfp8(w) for w in w13]))
    w2_q, w2_s = (torch.stack(t) for t in zip(*[quantize_mxfp8(w) for w in w2]))
    out = fused_moe_fp8_triton(x, w13_q, w13_s, w2_q, w2_s, ids, wts, config=MoETileConfig(16, 16, 32, 32, 4, 2))
    assert _rel(out, fused_moe_fp8_ref(x, w13_q, w13_s, w2_q, w2_s, ids, wts)) < 2e-3
    assert _rel(out, fused_moe_ref(x, w13, w2, ids, wts)) < 0.08


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 512, 4096])
@pytest.mark.parametrize("quantize", [quantize_fp8_rows, quantize_mxfp8], ids=["fp8_128", "mxfp8"])
def test_fp8_gemm_gpu_real_shapes(m, quantize):
    """M3 TP4-rank q|k|v|iq|ik projection (6144 -> 2688) and o_proj (2048 -> 6144) at decode and prefill sizes."""
    for n, k in ((2688, 6144), (6144, 2048)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w_q, w_s = quantize(torch.randn(n, k, device="cuda") / k ** 0.5)
        a_q, a_s = act_quant_triton(x)
        ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float64, torch.float64)
        assert _rel(fp8_gemm_triton(a_q, a_s, w_q, w_s, torch.bfloat16), ref) < 1e-2


def _m3_rank_case(T: int):
    """A TP4 rank of M3 on the GPU: x [T, 6144] bf16, routes (top-4 + shared column over 128 routed experts + the
    shared row) and the block-FP8 expert tables (w13_q, w13_s, w2_q, w2_s) at I_r 768."""
    H, I, E = 6144, 768, 128
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids, wts = moe_router_triton(x, torch.randn(E, H, device="cuda"), torch.zeros(E, device="cuda"), 4, 2.0,
                                 shared_expert=True)
    w13_q, w13_s = quantize_fp8_rows(torch.randn(E + 1, 2 * I, H, device="cuda") / H ** 0.5)
    w2_q, w2_s = quantize_fp8_rows(torch.randn(E + 1, H, I, device="cuda") / I ** 0.5)
    return x, ids, wts, (w13_q, w13_s, w2_q, w2_s)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [False, True], ids=["rows", "block"])
@pytest.mark.parametrize("T", [1, 32, 2048, 9000])
def test_fused_moe_fp8_gpu_real_shapes(T, block):
    """TP4 rank of M3: H 6144, I_r 768, 128 routed experts + the shared row, top-4 + shared column; block: the
    block-uniform scales' "fp8_block" rows (at 2048 tokens GEMM 2 into aligned rows, at 9000 the 128-row tile:
    `FP8_MOE_OPTIONS`, MOE_TILES)."""
    x, ids, wts, (w13_q, w13_s, w2_q, w2_s) = _m3_rank_case(T)
    out = fused_moe_fp8_triton(x, w13_q, w13_s, w2_q, w2_s, ids, wts, block_uniform=block)
    assert _rel(out, fused_moe_fp8_ref(x, w13_q, w13_s, w2_q, w2_s, ids, wts)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("T", [2048, 9000])
def test_gemm2_gluon_equals_triton_aligned_rows(T, bm):
    """The Gluon GEMM 2 (`_fp8_gemm2_gluon_kernel`) against the Triton loop's aligned rows and the float64 GEMM 2 of
    the same quantized operands, at a TP4 rank of M3 (H 6144, I_r 768, 128 routed + shared, top-4 + shared), BM 64
    (4 warps) and 128 (8 warps), 4 column tiles, 4 stages; the launch shows in its dispatch op; the op through it
    against its reference."""
    H, I = 6144, 768
    x, ids, wts, (w13_q, w13_s, w2_q, w2_s) = _m3_rank_case(T)
    cfg = MoETileConfig(bm, 64, 128, 64, 8, 4)
    gluon = Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=4, gemm2_aligned=True, gemm2_gluon=True)
    plan = fp8_moe_plan(x, w13_q, w13_s, w2_q, w2_s, ids, wts, cfg, gluon, block_uniform=True)
    i_q, i_s = act_quant_triton(torch.randn(plan.sorted_ids.numel(), I, device="cuda", dtype=torch.bfloat16))
    dispatch.reset()
    got = fp8_moe_gemm2(plan, i_q, i_s, w2_q, w2_s, wts).float()
    assert sum(b["executed"] for b in dispatch.snapshot()["ops"][GLUON_OP]["buckets"].values()) == 1
    triton_rows = fp8_moe_gemm2(plan._replace(opt=dataclasses.replace(gluon, gemm2_gluon=False)), i_q, i_s, w2_q,
                                w2_s, wts).float()
    n = int(plan.npp.item())
    a = dequant_block_fp8(i_q[:n], i_s[:n], torch.float64)
    e = plan.expert_ids.long().repeat_interleave(bm)[:n]
    ref = torch.empty(n, H, dtype=torch.float64, device="cuda")
    for ex in e.unique().tolist():
        rows = (e == ex).nonzero().squeeze(1)
        ref[rows] = a[rows] @ dequant_block_fp8(w2_q[ex], w2_s[ex], torch.float64).T
    assert _rel(got[:n], ref) < 5e-3  # bf16 rows: 2^-9 relative rounding, fp32 sums
    assert _rel(got[:n], triton_rows[:n]) < 5e-3
    out = fused_moe_fp8_triton(x, w13_q, w13_s, w2_q, w2_s, ids, wts, config=cfg, options=gluon, block_uniform=True)
    assert _rel(out, fused_moe_fp8_ref(x, w13_q, w13_s, w2_q, w2_s, ids, wts)) < 2e-2


def test_gemm2_gluon_compiles_for_sm90_with_one_wgmma_in_flight():
    """CPU (no GPU needed): the Gluon GEMM 2 builds for sm_90a through ptxas at the served tiles (BM 64 and 128,
    BN2 128, 4 column tiles, 4 stages), its K loop waits for at most one outstanding wgmma (PTX
    `wgmma.wait_group 1`; only the drain after the loop waits for 0), and its shared memory fits an H100 / H200 SM
    (227 KiB per block). In a fresh process: this one has run kernels under the interpreter, which leaves Triton's
    language patched for compiling. The numerics are checked on the GPU
    (`test_gemm2_gluon_equals_triton_aligned_rows`)."""
    code = ("import json, re\n"
            "from ladle.kernels.fused_moe_fp8 import compile_gemm2_gluon_sm90\n"
            "out = {}\n"
            "for bm in (64, 128):\n"
            "    k = compile_gemm2_gluon_sm90(bm, 128, 4, 4)\n"
            "    waits = re.findall(r'wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)', k.asm['ptx'])\n"
            "    out[bm] = [waits, k.metadata.shared]\n"
            "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for waits, shared in json.loads(done.stdout.strip().splitlines()[-1]).values():
        assert waits == ["1", "0"] and shared <= 227 * 1024
