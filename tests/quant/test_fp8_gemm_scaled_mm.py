"""The "scaled_mm" prefill path of the FP8 dense GEMM (ladle/kernels/fp8_gemm.py): its eligibility rule, the
M-major activation scales it reads, the dispatch record, and (GPU) torch._scaled_mm's block-wise recipe against
`fp8_gemm_ref`.

torch's CPU _scaled_mm has no block-wise recipe (torch 2.13: "Invalid scaling configuration"), so the CPU tests run
the path's wiring against a stand-in `_scaled_mm_emulated` that asserts the layouts torch's CUDA op checks (aten
ScaledBlas.cpp `is_blockwise_1x128_scaling` and the sm_90 TN rule) and computes the dequantized product; the GPU
test runs the real op. Error budgets: on the CPU the path and the float64 reference see the same fp8 bytes, so they
differ by float32 rounding (< 1e-5); on the H200 the tensor cores accumulate fp8 products inside a 128-wide K block
at reduced precision (the Triton kernel does too), and a bf16 output rounds at 2^-9: < 1e-3 in float32 output, < 1e-2
in bf16 (the Triton kernel's GPU bound in test_fp8_kernels.py).
"""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import fp8_gemm
from ladle.kernels.fp8_gemm import (fp8_gemm_ref, fp8_gemm_scaled_mm, fp8_linear, scaled_mm_ineligible,
                                    scaled_mm_support)
from ladle.kernels.fp8_quant import (act_quant_ref, act_quant_triton, dequant_block_fp8, quantize_fp8_rows,
                                     quantize_mxfp8)
from ladle.observe import dispatch


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _scaled_mm_emulated(a, b, scale_a, scale_b, out_dtype):
    """torch._scaled_mm's (BlockWise1x128, BlockWise1x128) recipe as the CUDA op checks it: a [M, K] row-major,
    b [K, N] column-major, scale_a [M, G] strides (1, M), scale_b [G, N] whose transpose has strides (1, N)."""
    (m, k), n = a.shape, b.shape[1]
    g = -(-k // 128)
    assert a.stride(1) == 1 and b.stride(0) == 1, "sm_90 multiplies row-major a by column-major b only"
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_a.shape == (m, g) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    assert scale_b.shape == (g, n) and scale_b.t().stride() == (1, n), (scale_b.shape, scale_b.stride())
    a_f = dequant_block_fp8(a, scale_a, torch.float64)
    b_f = dequant_block_fp8(b.t(), scale_b.t(), torch.float64)
    return (a_f @ b_f.T).to(out_dtype)


@pytest.fixture
def emulated_scaled_mm(monkeypatch):
    """The path runs on the CPU: the device probe says yes, torch._scaled_mm is the stand-in (calls counted) and the
    threshold is 8 tokens."""
    calls = []
    monkeypatch.setattr(fp8_gemm, "scaled_mm_support", lambda device: None)
    monkeypatch.setattr(fp8_gemm, "SCALED_MM_MIN_TOKENS", 8)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: calls.append(1) or _scaled_mm_emulated(*a, **kw))
    return calls


@pytest.mark.parametrize("quant", [act_quant_ref, act_quant_triton], ids=["ref", "triton"])
def test_act_quant_m_major_scale_same_bytes(quant):
    """m_major_scale writes the same scales with strides (1, M) (the layout _scaled_mm reads); the values match."""
    x = torch.randn(6, 300) * torch.logspace(-3, 2, 300)
    q, s = quant(x)
    q2, s2 = quant(x, m_major_scale=True)
    assert s2.shape == (6, 3) and s2.stride() == (1, 6) and s.stride() == (3, 1)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


def test_scaled_mm_rule_reasons():
    """Format and shape reasons on the CPU, then the device: MXFP8 scales, K off the 128 grid, CPU. An M off the
    4-row grid is no reason (fp8_linear pads the quantized rows)."""
    x = torch.randn(8, 256)
    w_q, w_s = quantize_fp8_rows(torch.randn(32, 256))
    assert "MXFP8" in scaled_mm_ineligible(x, *quantize_mxfp8(torch.randn(32, 256)))
    assert scaled_mm_ineligible(torch.randn(8, 200), *quantize_fp8_rows(torch.randn(32, 200))).startswith("K 200")
    assert scaled_mm_ineligible(x[:6], w_q, w_s) == "device cpu (needs cuda)"
    assert scaled_mm_ineligible(x, w_q, w_s) == "device cpu (needs cuda)" == scaled_mm_support(x.device)


def test_fp8_linear_scaled_mm_path_layout_and_record(emulated_scaled_mm):
    """At M >= the threshold the path quantizes with M-major scales and calls _scaled_mm with the layouts torch
    checks; the record names op fp8_gemm_scaled_mm as executed and leaves op fp8_gemm out of that call."""
    dispatch.reset()
    x, w, b = torch.randn(2, 6, 256) * torch.logspace(-2, 1, 256), torch.randn(48, 256), torch.randn(48)
    w_q, w_s = quantize_fp8_rows(w)
    fast = fp8_linear(x, w_q, w_s, b, use_triton=True)
    slow = fp8_linear(x, w_q, w_s, b, use_triton=False)
    assert emulated_scaled_mm == [1]
    assert fast.shape == (2, 6, 48) and _rel(fast, slow) < 1e-5
    ops = dispatch.snapshot()["ops"]
    assert ops["fp8_gemm_scaled_mm"]["path"] == "scaled_mm"
    assert ops["fp8_gemm_scaled_mm"]["buckets"]["T<=16"] == {"configured": 1, "eligible": 1, "executed": 1, "calls": 1}
    assert ops["fp8_gemm"]["buckets"]["T<=16"] == {"configured": 0, "eligible": 1, "executed": 0, "calls": 1}


def test_scaled_mm_scale_b_is_a_view_of_n_minor_linear_scales(emulated_scaled_mm, monkeypatch):
    """An FP8 linear's weight_scale_inv (N-minor, ladle/quant/fp8.py) reaches torch._scaled_mm as scale_b = its
    transpose, a view of the same storage (no per-call copy); a row-major w_scale still works through a contiguous
    copy. Both give the reference path's output."""
    from ladle.layers.linear import RowParallelLinear
    from ladle.layers.quant_slot import quant_config_scope
    from ladle.quant.fp8 import Fp8Config

    seen = []
    emulate = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, sa, sb, **kw: seen.append(sb) or emulate(a, b, sa, sb, **kw))
    with quant_config_scope(Fp8Config()):
        layer = RowParallelLinear(256, 48)
    w = torch.randn(48, 256)
    layer.weight.weight_loader(layer.weight, w)
    x = torch.randn(8, 256) * torch.logspace(-2, 1, 256)
    w_s = layer.weight_scale_inv
    y = fp8_linear(x, layer.weight, w_s, use_triton=True)  # what Fp8LinearMethod.apply runs with the fast kernels
    assert len(seen) == 1 and seen[0].shape == (2, 48) and seen[0].is_contiguous()
    assert seen[0].data_ptr() == w_s.data_ptr() and seen[0].stride() == (48, 1)
    w_q, w_s_rows = quantize_fp8_rows(w)
    assert w_s_rows.is_contiguous() and torch.equal(w_s_rows, w_s)
    y_rows = fp8_linear(x, w_q, w_s_rows, use_triton=True)
    assert len(seen) == 2 and seen[1].is_contiguous() and seen[1].data_ptr() != w_s_rows.data_ptr()
    ref = fp8_linear(x, w_q, w_s_rows, use_triton=False)
    assert torch.equal(y, y_rows) and _rel(y, ref) < 1e-5


@pytest.mark.parametrize("quant", [act_quant_ref, act_quant_triton], ids=["ref", "triton"])
def test_act_quant_pad_rows(quant):
    """pad_rows_to: the first M rows are the unpadded quantization byte for byte; the added rows are zeros with
    scale 1, in both scale layouts; M already on the grid adds nothing."""
    x = torch.randn(6, 300) * torch.logspace(-3, 2, 300)
    q, s = quant(x)
    for m_major in (False, True):
        qp, sp = quant(x, m_major_scale=m_major, pad_rows_to=4)
        assert qp.shape == (8, 300) and sp.shape == (8, 3) and sp.stride() == ((1, 8) if m_major else (3, 1))
        assert torch.equal(qp[:6].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sp[:6], s)
        assert not qp[6:].view(torch.uint8).any() and torch.equal(sp[6:], torch.ones(2, 3))
    q4, s4 = quant(x[:4], pad_rows_to=4)
    assert q4.shape == (4, 300) and torch.equal(s4, quant(x[:4])[1])


def test_fp8_linear_scaled_mm_pads_m(emulated_scaled_mm, monkeypatch):
    """M = 10 (off cuBLASLt's 4-row grid; the fixture's threshold is 8) still takes the scaled_mm path: _scaled_mm
    sees 12 quantized rows (the last two zero) and fp8_linear returns the first 10 output rows, equal to the
    reference path's."""
    seen = []
    real = fp8_gemm.fp8_gemm_scaled_mm
    monkeypatch.setattr(fp8_gemm, "fp8_gemm_scaled_mm", lambda a_q, *rest: seen.append(a_q.shape) or real(a_q, *rest))
    dispatch.reset()
    x, w = torch.randn(10, 256) * torch.logspace(-2, 1, 256), torch.randn(48, 256)
    w_q, w_s = quantize_fp8_rows(w)
    fast = fp8_linear(x, w_q, w_s, use_triton=True)
    slow = fp8_linear(x, w_q, w_s, use_triton=False)
    assert emulated_scaled_mm == [1] and seen == [(12, 256)]
    assert fast.shape == (10, 48) and fast.is_contiguous() and _rel(fast, slow) < 1e-5
    assert dispatch.snapshot()["ops"]["fp8_gemm_scaled_mm"]["buckets"]["T<=16"]["executed"] == 1


def test_fp8_linear_scaled_mm_fallback_reason_recorded(emulated_scaled_mm, monkeypatch):
    """A failed device probe sends the call to the Triton kernel and is counted as the path's fallback reason;
    below the threshold the path is not asked for (nothing recorded for it)."""
    monkeypatch.setattr(fp8_gemm, "scaled_mm_support", lambda device: "probe failed: no block-wise recipe")
    dispatch.reset()
    w_q, w_s = quantize_fp8_rows(torch.randn(32, 128))
    y = fp8_linear(torch.randn(12, 128), w_q, w_s, use_triton=True)
    fp8_linear(torch.randn(4, 128), w_q, w_s, use_triton=True)
    assert emulated_scaled_mm == [] and y.shape == (12, 32)
    ops = dispatch.snapshot()["ops"]
    assert ops["fp8_gemm_scaled_mm"]["fallback_reasons"] == {"probe failed: no block-wise recipe": 1}
    assert list(ops["fp8_gemm_scaled_mm"]["buckets"]) == ["T<=16"]
    assert ops["fp8_gemm"]["buckets"]["T<=16"]["executed"] == 1 and ops["fp8_gemm"]["buckets"]["T<=4"]["executed"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1024, 2050, 2052])
def test_scaled_mm_gpu_against_reference(m):
    """H200: the device probe passes; TP4-rank M3 shapes (qkv 6144 -> 2688, o_proj 2048 -> 6144) and a K of 3
    groups (not a multiple of 4 groups) against the float64 reference, M = 2050 through padded rows; fp8_linear
    runs the path in bf16."""
    assert scaled_mm_support(torch.device("cuda")) is None
    for n, k in ((2688, 6144), (6144, 2048), (256, 384)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w_q, w_s = quantize_fp8_rows(torch.randn(n, k, device="cuda") / k ** 0.5)
        a_q, a_s = act_quant_triton(x, m_major_scale=True, pad_rows_to=fp8_gemm.SCALED_MM_ROW_MULTIPLE)
        ref = fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float64, torch.float64)[:m]
        assert _rel(fp8_gemm_scaled_mm(a_q, a_s, w_q, w_s, torch.float32)[:m], ref) < 1e-3
        dispatch.reset()
        assert _rel(fp8_linear(x, w_q, w_s, use_triton=True), ref) < 1e-2
        assert dispatch.snapshot()["ops"]["fp8_gemm_scaled_mm"]["buckets"][dispatch.tokens_bucket(m)]["executed"] == 1


@pytest.mark.gpu
def test_scaled_mm_path_in_a_cuda_graph():
    """M = 128 (a decode graph size at or above SCALED_MM_MIN_TOKENS): fp8_linear captured in a CUDA graph and
    replayed on new x equals an eager call on that x bit for bit (same path, same launch), and the path is
    scaled_mm."""
    assert fp8_gemm.SCALED_MM_MIN_TOKENS <= 128
    assert fp8_gemm.SCALED_MM_MIN_TOKENS == 1  # every decode size with N-minor scales (round 11 call 1)
    w_q, w_s = quantize_fp8_rows(torch.randn(2688, 6144, device="cuda") / 6144 ** 0.5)
    x = torch.randn(128, 6144, device="cuda", dtype=torch.bfloat16)
    fp8_linear(x, w_q, w_s, use_triton=True)  # eager first: the device probe runs outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, w_q, w_s, use_triton=True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    dispatch.reset()
    eager = fp8_linear(x, w_q, w_s, use_triton=True)
    assert torch.equal(y, eager)
    assert dispatch.snapshot()["ops"]["fp8_gemm_scaled_mm"]["buckets"][dispatch.tokens_bucket(128)]["executed"] == 1
