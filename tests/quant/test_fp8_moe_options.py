"""K-loop / launch options of the FP8 fused MoE (`Fp8MoEOptions`, ladle/kernels/fused_moe_fp8.py) under the Triton
interpreter, on fresh random inputs, against `fused_moe_fp8_ref` (float64) and the default options.

Budget (as tests/quant/test_fp8_kernels.py): every option computes the same promoted K steps as the default loop, so
outputs differ only by float32 summation order, except where that moves an intermediate value across an fp8
rounding boundary before GEMM 2: relative error < 2e-3 against the reference and against the default options.
Shapes cover ragged K (masked loads), an odd number of K steps (k_unroll 2's zero tail), I not a multiple of BN1
(the masked columns of the interleaved gate / up tile) and K a multiple of the step (EVEN_K, no K masks).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ladle.kernels import fused_moe_fp8 as moe8
from ladle.kernels._common import MAX_TOKENS
from ladle.kernels.fp8_quant import quantize_fp8_rows, quantize_mxfp8
from ladle.kernels.fused_moe import MoETileConfig
from ladle.kernels.fused_moe_fp8 import Fp8MoEOptions, fused_moe_fp8_ref, fused_moe_fp8_triton, select_options
from ladle.kernels.moe_router import moe_router_triton
from ladle.observe import dispatch

OPTIONS = [Fp8MoEOptions(gu_dot=True), Fp8MoEOptions(k_unroll=2), Fp8MoEOptions(gu_dot=True, k_unroll=2, max_regs=168)]


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _case(T, H, I, E, k, quantize, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids, wts = moe_router_triton(x, torch.randn(E, H, generator=g), torch.zeros(E), k, 2.0, shared_expert=True)
    w13 = torch.randn(E + 1, 2 * I, H, generator=g) / H ** 0.5 * 3
    w2 = torch.randn(E + 1, H, I, generator=g) / I ** 0.5
    tables = [torch.stack(t) for t in zip(*[quantize(w) for w in w13])] + \
             [torch.stack(t) for t in zip(*[quantize(w) for w in w2])]
    return x, tables, ids, wts


@pytest.mark.parametrize("opt", OPTIONS, ids=["gu", "unroll2", "gu_unroll2_regs"])
@pytest.mark.parametrize("T,H,I,cfg", [
    (19, 300, 80, MoETileConfig(16, 32, 32, 128, 4, 2)),   # H: 3 ragged K steps; I: 1 ragged step, 80 % 32 != 0
    (12, 256, 128, MoETileConfig(16, 16, 64, 128, 4, 2)),  # H even for both unrolls; I: 1 step (odd for unroll 2)
], ids=["ragged", "even"])
def test_fp8_options_match_reference_and_default(opt, T, H, I, cfg):
    x, tabs, ids, wts = _case(T, H, I, 5, 2, quantize_fp8_rows, seed=T + H)
    ref = fused_moe_fp8_ref(x, *tabs, ids, wts)
    out = fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg, options=opt)
    assert _rel(out, ref) < 2e-3
    assert _rel(out, fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg)) < 2e-3


def test_mxfp8_options_match_reference():
    """E8M0 scales, K steps of 32: H = 96 is 3 steps (odd), I = 64 two; the padded K step's scale byte reads 127."""
    x, tabs, ids, wts = _case(13, 96, 64, 5, 2, quantize_mxfp8, seed=7)
    ref = fused_moe_fp8_ref(x, *tabs, ids, wts)
    for opt in OPTIONS:
        out = fused_moe_fp8_triton(x, *tabs, ids, wts, config=MoETileConfig(16, 16, 32, 32, 4, 2), options=opt)
        assert _rel(out, ref) < 2e-3, opt


@pytest.mark.parametrize("opt", [Fp8MoEOptions(block_scales=True), Fp8MoEOptions(gu_dot=True, block_scales=True),
                                 Fp8MoEOptions(gu_dot=True, k_unroll=2, block_scales=True)],
                         ids=["block", "gu_block", "gu_unroll2_block"])
def test_block_scales_match_reference(opt):
    """`quantize_fp8_rows` (128x128 blocks, rows expanded) gives block-uniform scales; I = 256: two blocks of gate
    rows, two of up rows, BN1 32 and BN2 64 tiles inside them; H = 300 ragged (3 K steps)."""
    x, tabs, ids, wts = _case(19, 300, 256, 5, 2, quantize_fp8_rows, seed=3)
    out = fused_moe_fp8_triton(x, *tabs, ids, wts, config=MoETileConfig(16, 32, 64, 128, 4, 2), options=opt)
    assert _rel(out, fused_moe_fp8_ref(x, *tabs, ids, wts)) < 2e-3


def test_block_scales_read_one_scale_per_block():
    """Scales that differ inside a 128-row block are outside block_scales' contract: the kernel then uses the
    block's first row, so changing any other row's scale changes nothing (and the per-row default sees it)."""
    x, tabs, ids, wts = _case(9, 128, 128, 3, 2, quantize_fp8_rows, seed=5)
    opt, cfg = Fp8MoEOptions(block_scales=True), MoETileConfig(16, 32, 64, 128, 4, 2)
    out = fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg, options=opt)
    tabs[1][:, 1:128] *= 2.0  # gate rows 1..127 of every expert (row 0 holds the block's scale)
    assert torch.equal(fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg, options=opt), out)
    assert _rel(fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg), out) > 1e-2


def test_options_refuse_what_the_kernels_do_not_offer():
    with pytest.raises(ValueError, match="k_unroll 4"):
        Fp8MoEOptions(k_unroll=4)
    for regs in (40, 100, 256):
        with pytest.raises(ValueError, match=f"max_regs {regs}"):
            Fp8MoEOptions(max_regs=regs)
    block, cfg = Fp8MoEOptions(block_scales=True), MoETileConfig(16, 32, 64, 32, 4, 2)
    for quantize, I in ((quantize_mxfp8, 128), (quantize_fp8_rows, 96)):  # E8M0 scales; I not a multiple of 128
        x, tabs, ids, wts = _case(5, 64, I, 3, 2, quantize, seed=2)
        with pytest.raises(ValueError, match="ladle offers block_scales=False"):
            fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg, options=block)


def test_the_options_table_row_is_what_the_launcher_runs(monkeypatch):
    """The table per weight family (H200 A/B of 2026-12-02): gu for per-row fp32 scales, gu + block_scales for
    block-uniform ones (GEMM 2 over 4 column tiles above 256 tokens, round 10, into aligned rows from the Gluon
    kernel on sm_90, round 16), the round-3 loop for MXFP8; an
    edited row reaches both GEMMs of a launch."""
    assert all(select_options(m, "fp8") == Fp8MoEOptions(gu_dot=True) for m in (1, 256, 257, 8192))
    assert select_options(256, "fp8_block") == Fp8MoEOptions(gu_dot=True, block_scales=True)
    assert select_options(257, "fp8_block") == select_options(8192, "fp8_block") == select_options(
        32768, "fp8_block") == Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=4, gemm2_aligned=True,
                                             gemm2_gluon=True)
    assert select_options(32, "mxfp8") == Fp8MoEOptions()
    edited = Fp8MoEOptions(gu_dot=True, k_unroll=2)
    monkeypatch.setitem(moe8.FP8_MOE_OPTIONS, "fp8", ((16, Fp8MoEOptions()), (MAX_TOKENS, edited)))
    seen = []
    for name in ("fp8_moe_gemm1", "fp8_moe_gemm2"):
        real = getattr(moe8, name)
        monkeypatch.setattr(moe8, name, lambda plan, *a, real=real: seen.append(plan.opt) or real(plan, *a))
    x, tabs, ids, wts = _case(17, 128, 32, 3, 2, quantize_fp8_rows, seed=1)
    out = fused_moe_fp8_triton(x, *tabs, ids, wts, config=MoETileConfig(16, 16, 32, 128, 4, 2))
    assert seen == [edited, edited] and _rel(out, fused_moe_fp8_ref(x, *tabs, ids, wts)) < 2e-3


def test_block_uniform_scales_select_the_block_rows(monkeypatch):
    """`block_scales_uniform` holds for 128x128-block quantized tables (rows a multiple of 128) and not for per-row
    scales; fused_moe_fp8(block_uniform=True) then runs the "fp8_block" options (block_scales) and still matches
    the reference; the FP8 MoE quant method checks its tables once and keeps the answer on the scale parameter."""
    from ladle.quant.fp8_moe import Fp8FusedMoEMethod

    x, tabs, ids, wts = _case(9, 128, 128, 3, 2, quantize_fp8_rows, seed=3)
    assert moe8.block_scales_uniform(tabs[1], tabs[3])
    per_row = tabs[1].clone()
    per_row[:, 5] *= 2.0  # one row of a block scaled differently: no longer uniform
    assert not moe8.block_scales_uniform(per_row, tabs[3])
    seen = []
    real = moe8.fp8_moe_gemm1
    monkeypatch.setattr(moe8, "fp8_moe_gemm1", lambda plan, *a: seen.append(plan.opt) or real(plan, *a))
    out = moe8.fused_moe_fp8(x, *tabs, ids, wts, block_uniform=True)
    assert seen[-1].block_scales and _rel(out, fused_moe_fp8_ref(x, *tabs, ids, wts)) < 2e-3
    w13_scale = torch.nn.Parameter(tabs[1], requires_grad=False)
    method = Fp8FusedMoEMethod()
    method.run_experts(x, tabs[0], w13_scale, tabs[2], tabs[3], ids, wts, 1.702, 7.0, use_triton=True)
    assert w13_scale.block_uniform is True and seen[-1].block_scales


@pytest.mark.parametrize("n_tiles", [2, 4])
@pytest.mark.parametrize("block", [False, True], ids=["rows", "block"])
def test_gemm2_n_tiles_same_bytes(n_tiles, block):
    """gemm2_n_tiles runs the same promoted K steps per column tile in the same order, so the output equals the
    one-tile program's bit for bit; H = 160 is 5 BN2 = 32 tiles (the last program's trailing tiles masked or past
    N), I = 256 two K steps (EVEN_K); with block scales (128-row blocks, BN2 32 divides 128) too. E8M0 scales and
    k_unroll 2 are refused with it."""
    x, tabs, ids, wts = _case(11, 160, 256, 5, 2, quantize_fp8_rows, seed=n_tiles)
    cfg = MoETileConfig(16, 32, 32, 128, 4, 2)
    base = Fp8MoEOptions(gu_dot=True, block_scales=block)
    one = fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg, options=base, block_uniform=block)
    out = fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg, block_uniform=block,
                               options=Fp8MoEOptions(gu_dot=True, block_scales=block, gemm2_n_tiles=n_tiles))
    assert torch.equal(out, one)
    assert _rel(out, fused_moe_fp8_ref(x, *tabs, ids, wts)) < 2e-3
    with pytest.raises(ValueError, match="ladle offers 1, 2, 4 or 8"):
        Fp8MoEOptions(k_unroll=2, gemm2_n_tiles=n_tiles)
    with pytest.raises(ValueError, match="ladle offers 1, 2, 4 or 8"):
        Fp8MoEOptions(gemm2_n_tiles=3)


@pytest.mark.parametrize("slot_dtype", [None, torch.bfloat16], ids=["f32_rows", "bf16_rows"])
@pytest.mark.parametrize("n_tiles,bn2,bm", [
    (2, 32, 16),   # H = 160: 5 column tiles of 32, programs of 64 columns: the last one masked (not EVEN_N)
    (1, 32, 16),   # one column tile per program, EVEN_N
    (4, 32, 32),   # BM 32, 128-column programs: the second one past H (masked)
], ids=["n2_masked", "n1_even", "n4_bm32"])
def test_gemm2_aligned_rows_match_slot_rows(slot_dtype, n_tiles, bn2, bm, monkeypatch):
    """gemm2_aligned: GEMM 2 writes the aligned rows (no routed weight) and the combine gathers them by
    `aligned_positions` and applies the weights. Same promoted K steps as the slot-row GEMM 2 (the two scale
    factors multiplied first: an fp32 rounding per step); the routed weight is applied after the row's rounding
    to the row dtype instead of before it. So against the float64 reference its error is the slot-row path's plus
    at most that rounding: per output element <= 2 u_row S + u_out (|out| + |slot-row out|), S = sum_i |w_i r_i|
    over the slots (from the aligned rows), u_row / u_out the unit roundoffs of the row and output dtypes; in norm,
    rel <= rel(slot rows) + (2 u_row ||S|| + 2 u_out ||out||) / ||ref|| + 1e-5 (the fp32 scale order). Float32 x
    also against the reference directly (< 2e-3, as the other options); bf16 x runs with bf16 rows."""
    x, tabs, ids, wts = _case(19, 160, 256, 5, 2, quantize_fp8_rows, seed=11 + n_tiles)
    x = x.to(slot_dtype or x.dtype)  # 16-bit rows go with 16-bit activations
    T, H, k = x.shape[0], x.shape[1], ids.shape[1]
    cfg = MoETileConfig(bm, 32, bn2, 128, 4, 2)
    slots = Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=n_tiles)
    aligned = Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=n_tiles, gemm2_aligned=True)
    kw = dict(config=cfg, block_uniform=True, slot_dtype=slot_dtype)
    seen, real = [], moe8.fp8_moe_gemm2

    def spy(plan, *args):
        seen.append((plan, real(plan, *args)))
        return seen[-1][1]

    monkeypatch.setattr(moe8, "fp8_moe_gemm2", spy)
    out = fused_moe_fp8_triton(x, *tabs, ids, wts, options=aligned, **kw)
    plan, rows = seen[-1]
    assert plan.opt.gemm2_aligned and rows.shape == (plan.sorted_ids.numel(), H)
    out_slots = fused_moe_fp8_triton(x, *tabs, ids, wts, options=slots, **kw)
    ref = fused_moe_fp8_ref(x, *tabs, ids, wts)
    pos = moe8.aligned_positions(plan.sorted_ids, T * k).long()
    S = (rows[pos].double().abs() * wts.double().reshape(-1, 1)).view(T, k, H).sum(1)
    u_row = 2.0 ** -24 if rows.dtype == torch.float32 else 2.0 ** -8
    u_out = 2.0 ** -24 if x.dtype == torch.float32 else 2.0 ** -8
    slack = (2 * u_row * S.norm() + 2 * u_out * out.double().norm()).item() / ref.double().norm().item() + 1e-5
    assert _rel(out, ref) <= _rel(out_slots, ref) + slack
    if slot_dtype is None:
        assert _rel(out, ref) < 2e-3
    assert not torch.equal(out, out_slots) or slot_dtype is None


def test_gemm2_aligned_refusals():
    """gemm2_aligned reads one weight scale per K step, so it needs block_scales; its loop takes one K step per
    iteration, so k_unroll 2 is refused rather than ignored."""
    with pytest.raises(ValueError, match="gemm2_aligned needs block_scales"):
        Fp8MoEOptions(gemm2_aligned=True)
    with pytest.raises(ValueError, match="k_unroll 2"):
        Fp8MoEOptions(block_scales=True, k_unroll=2, gemm2_aligned=True)


def test_gluon_refusals():
    """The Gluon GEMM 2 writes aligned rows: without them it is refused, not ignored."""
    with pytest.raises(ValueError, match="gemm2_gluon writes aligned rows"):
        Fp8MoEOptions(block_scales=True, gemm2_gluon=True)


def test_gluon_options_off_sm90_run_the_triton_loops_and_say_so():
    """On the CPU (interpreter) the Gluon option is configured but not eligible: the dispatch record says why, and
    the Triton loop computes the rows, bitwise what the same options without Gluon give."""
    x, tabs, ids, wts = _case(17, 128, 128, 3, 2, quantize_fp8_rows, seed=4)
    cfg = MoETileConfig(16, 32, 64, 128, 4, 2)
    plain = Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=2, gemm2_aligned=True)
    gluon = dataclasses.replace(plain, gemm2_gluon=True)
    dispatch.reset()
    out = fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg, options=gluon, block_uniform=True)
    assert torch.equal(out, fused_moe_fp8_triton(x, *tabs, ids, wts, config=cfg, options=plain, block_uniform=True))
    ops = dispatch.snapshot()["ops"]
    buckets, reasons = ops[moe8.GLUON_OP]["buckets"].values(), ops[moe8.GLUON_OP]["fallback_reasons"]
    assert [(b["configured"], b["eligible"], b["executed"]) for b in buckets] == [(1, 0, 0)]
    assert list(reasons) == ["not a cuda device (gluon does not run under the interpreter)"]

