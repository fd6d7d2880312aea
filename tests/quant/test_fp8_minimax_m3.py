"""Tiny MiniMax-M3 in MXFP8 kept as FP8 (ladle/quant/fp8.py, mx): the loaded weights dequantize EXACTLY to the
checkpoint's dequantized values, and the w8a8 forward matches transformers on the dequantized weights.

The oracle: transformers in float32 on the dequantized weights, with its `F.linear` calls fed the same per-token
128-group e4m3 fake-quantized activations ladle computes (eager experts, so they call F.linear too; router and
lm_head excluded: ladle keeps them unquantized). Without that the tiny random model is chaotic: the ~2.6% activation rounding of layer 0 grows to
cosine 0.35 at the logits (measured), which says nothing about correctness. With it the remaining differences are
float32 summation order and the rare fp8 rounding flip it causes: cosine >= COS_MIN per position.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from drivers.minimax_m3_paged import PagedDriver
from ladle.config import ModelConfig
from ladle.kernels.fp8_quant import act_quant_ref, dequant_block_fp8
from ladle.models.loader import load_model, resolve_model_source
from ladle.tools.checkpoint_m3 import make_checkpoint

M = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
COS_MIN = 0.9999  # observed 0.9999998 when written


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops on a shared 2-core box (tests/models/conftest.py)
    d = make_checkpoint(str(tmp_path_factory.mktemp("m3") / "mx"), "tiny", dtype="mxfp8")
    cfg = ModelConfig(model=d)
    yield d, load_model(cfg, resolve_model_source(cfg), torch.float32, torch.device("cpu"))
    torch.set_num_threads(n)


def _ckpt(d):
    import glob

    out = {}
    for f in glob.glob(f"{d}/*.safetensors"):
        out.update(load_file(f))
    return out


def test_mxfp8_weights_kept_and_dequantize_exactly(mx):
    d, ours = mx
    ckpt = _ckpt(d)
    def deq(base):
        return dequant_block_fp8(ckpt[base + ".weight"], ckpt[base + ".weight_scale_inv"], torch.float64)
    layer = ours.layers[3]
    p = "language_model.model.layers.3."
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale_inv.dtype == torch.uint8
    want = torch.cat([deq(p + f"self_attn.{n}_proj") for n in ("q", "k", "v", "index_q", "index_k")])
    assert torch.equal(dequant_block_fp8(qkv.weight, qkv.weight_scale_inv, torch.float64), want)
    moe = layer.mlp
    e = 1
    w13 = torch.cat([deq(p + f"block_sparse_moe.experts.{e}.w{i}") for i in (1, 3)])
    assert torch.equal(dequant_block_fp8(moe.w13[e], moe.w13_scale_inv[e], torch.float64), w13)
    assert torch.equal(dequant_block_fp8(moe.w2[e], moe.w2_scale_inv[e], torch.float64),
                       deq(p + f"block_sparse_moe.experts.{e}.w2"))
    shared = torch.cat([deq(p + f"block_sparse_moe.shared_experts.{n}_proj") for n in ("gate", "up")])
    assert torch.equal(dequant_block_fp8(moe.w13[-1], moe.w13_scale_inv[-1], torch.float64), shared)


def test_mxfp8_forward_matches_transformers_dequant(mx):
    d, ours = mx
    theirs = M.MiniMaxM3SparseForConditionalGeneration.from_pretrained(d, dtype=torch.float32,
                                                                    experts_implementation="eager").eval()
    ids = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(9)).tolist()
    skip = {id(m.weight) for name, m in theirs.named_modules() if name.endswith("lm_head") or
            name.endswith("mlp.gate")}
    linear = torch.nn.functional.linear

    def fake_quant_linear(x, w, b=None):
        if id(w) in skip:
            return linear(x, w, b)
        q, s = act_quant_ref(x.reshape(-1, x.shape[-1]))
        return linear(dequant_block_fp8(q, s).view_as(x), w, b)

    with torch.no_grad(), mock.patch("torch.nn.functional.linear", fake_quant_linear):
        ref = theirs(input_ids=torch.tensor([ids])).logits[0].float()
    got = PagedDriver(ours, num_blocks=10).prefill("a", ids)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min().item() >= COS_MIN, cos.min().item()
