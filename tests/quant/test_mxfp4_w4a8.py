"""MXFP4 experts with FP8 activations (W4A8, ladle/kernels/fused_moe_mxfp4.py) on fresh random inputs.

Budgets:
  kernel vs its own reference (`fused_moe_mxfp4_ref(fp8_activations=True)`, float64 on the exactly dequantised
  weights, activations quantized by `act_quant_ref` at the same points): the fp8 values and scales are identical, so
  only summation order differs, plus the rare e4m3 rounding flip it causes in the intermediate's quantization:
  relative error < 1e-3 (observed ~1e-7 when written).
  W4A8 vs W4A16 (the same weights, float activations): the FP8 activation budget — e4m3 keeps 3 mantissa bits, a
  relative rounding error of at most 2^-4 per element and ~2.5% RMS per quantized GEMM input
  (tests/quant/test_fp8_kernels.py), two quantized inputs in a row: relative error < 0.08; a wrong activation or
  weight scale (a factor of 2 or more on a group) exceeds it.
  Tiny M3 end to end: the whole-model logits of W4A8 vs W4A16 are not a usable gate on a tiny random model (a few %
  of activation rounding in layer 0 grows to a minimum per-position cosine of ~0.47 at the logits, measured; the same
  chaos tests/quant/test_fp8_minimax_m3.py documents for FP8). So the model is checked in two parts: every MoE
  layer of the W4A8 model, fed the W4A16 model's MoE inputs from one prefill, is within W4A8_VS_W4A16 of the W4A16
  layer's output; and the W4A8 model's whole prefill with the Triton MoE equals its prefill with the reference MoE
  (cosine >= 0.99999 per position: the same math, summation order only), the dispatch record naming the variant.
"""

from __future__ import annotations

import json

import pytest
import torch

from drivers.minimax_m3_paged import PagedDriver
from ladle.config import ModelConfig
from ladle.layers.attention.metadata import OpBackends
from ladle.layers.moe import FusedMoE
from ladle.models.loader import load_model, resolve_model_source
from ladle.tools.checkpoint_m3 import make_checkpoint

from ladle.kernels.fp8_quant import quantize_mxfp4
from ladle.kernels.fused_moe import MoETileConfig
from ladle.kernels.fused_moe_mxfp4 import OP, OP_W4A8, fused_moe_mxfp4, fused_moe_mxfp4_ref, fused_moe_mxfp4_triton
from ladle.kernels.moe_router import moe_router_triton
from ladle.observe import dispatch

W4A8_VS_W4A16 = 0.08


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _pack(w):
    return (torch.stack(t) for t in zip(*[quantize_mxfp4(x) for x in w]))


def _moe(T, H, I, E, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, generator=g, device=device).to(dtype)
    ids, wts = moe_router_triton(x, torch.randn(E, H, generator=g, device=device),
                                 torch.zeros(E, device=device), 2, 2.0, shared_expert=True)
    w13 = _pack(torch.randn(E + 1, 2 * I, H, generator=g, device=device) / H ** 0.5 * 3)
    w2 = _pack(torch.randn(E + 1, H, I, generator=g, device=device) / I ** 0.5)
    return (x, *w13, *w2, ids, wts)


@pytest.mark.parametrize("T,cfg", [(7, MoETileConfig(16, 16, 32, 32, 4, 2)), (64, None)])
def test_w4a8_kernel_against_its_reference(T, cfg):
    args = _moe(T, 160, 64, 5, seed=T)  # H = 160: the last 128-group of activations is partial
    out = fused_moe_mxfp4_triton(*args, config=cfg, fp8_activations=True)
    ref = fused_moe_mxfp4_ref(*args, fp8_activations=True)
    assert _rel(out, ref) < 1e-3
    w4a16 = fused_moe_mxfp4_ref(*args)
    assert 1e-4 < _rel(out, w4a16) < W4A8_VS_W4A16  # the activations really are fp8, within their budget


def test_dispatch_records_the_variant():
    args = _moe(5, 64, 32, 3, seed=1)
    bucket = dispatch.tokens_bucket(5)

    def counts():
        entry = dispatch.snapshot()["ops"][OP_W4A8]["buckets"].get(bucket, {})
        return entry.get("calls", 0), entry.get("executed", 0)

    calls, executed = counts()
    got = fused_moe_mxfp4(*args, use_triton=False, fp8_activations=True)  # the reference of the W4A8 variant
    assert counts() == (calls + 1, executed)
    assert _rel(got, fused_moe_mxfp4_ref(*args, fp8_activations=True)) < 1e-5
    fused_moe_mxfp4(*args, use_triton=True, fp8_activations=True)  # Triton (the interpreter here)
    assert counts() == (calls + 2, executed + 1)


@pytest.fixture(scope="module")
def tiny_mxfp4(tmp_path_factory):
    """The tiny M3 MXFP4 checkpoint loaded twice: W4A16 (as written) and W4A8 (ladle's quantization_config key)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    d = make_checkpoint(str(tmp_path_factory.mktemp("m3") / "mx4"), "tiny", dtype="mxfp4")
    models = []
    for over in (None, json.dumps({"quantization_config": {"activation_dtype": "fp8"}})):
        mc = ModelConfig(model=d, hf_overrides=over)
        models.append(load_model(mc, resolve_model_source(mc), torch.float32, torch.device("cpu")))
    yield models
    torch.set_num_threads(n)


def test_tiny_m3_w4a8_moe_layers_against_w4a16(tiny_mxfp4):
    a16, a8 = tiny_mxfp4
    assert [m.quant_method.config.activation_dtype for m in a8.modules() if isinstance(m, FusedMoE)] == ["fp8"] * 3
    seen = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0].clone(), out.clone())))
             for m in a16.modules() if isinstance(m, FusedMoE)]
    ids = torch.randint(3, 512, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    PagedDriver(a16, num_blocks=10).prefill("a", ids)
    for h in hooks:
        h.remove()
    twins = dict(zip([m for m in a16.modules() if isinstance(m, FusedMoE)],
                     [m for m in a8.modules() if isinstance(m, FusedMoE)]))
    assert len(seen) == 3
    for mod, x, want in seen:
        with torch.no_grad():
            got = twins[mod](x)  # outside a forward: the reference MoE of the W4A8 variant
        assert 1e-4 < _rel(got, want) < W4A8_VS_W4A16


def test_tiny_m3_w4a8_triton_equals_reference_in_the_model(tiny_mxfp4):
    a8 = tiny_mxfp4[1]
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    bucket = dispatch.tokens_bucket(len(ids))

    def executed(op):
        return dispatch.snapshot()["ops"][op]["buckets"].get(bucket, {}).get("executed", 0)

    before = executed(OP_W4A8), executed(OP)
    ref = PagedDriver(a8, num_blocks=10).prefill("a", ids)
    got = PagedDriver(a8, num_blocks=10, backends=OpBackends(moe="triton")).prefill("a", ids)
    assert (executed(OP_W4A8), executed(OP)) == (before[0] + 3, before[1])  # three MoE layers, the W4A8 variant
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item() >= 0.99999


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 1024])
def test_w4a8_gpu_tp4_rank_shapes(T):
    """TP4 rank of M3 (H 6144, I_r 768, 128 experts + shared row), bf16 activations quantized to fp8."""
    args = _moe(T, 6144, 768, 128, device="cuda", dtype=torch.bfloat16, seed=T)
    out = fused_moe_mxfp4_triton(*args, fp8_activations=True)
    assert _rel(out, fused_moe_mxfp4_ref(*args, fp8_activations=True)) < 2e-2  # bf16 intermediate and output
    assert _rel(out, fused_moe_mxfp4_ref(*args)) < W4A8_VS_W4A16
