"""FP8 quant methods in the layer kit (ladle/quant/fp8.py, fp8_moe.py) and their loading paths.

Round trips: an HF block-FP8 checkpoint (per-piece 128x128 grids, ragged) loaded into merged layers dequantizes
EXACTLY to the checkpoint's dequantized values; online quantization (--quantization fp8) through the same loaders
equals quantizing each merged weight per 128x128 block; the layers' outputs match float64 on the dequantized
weights within the w8a8 budget (< 8%, see test_fp8_kernels.py).
"""

from __future__ import annotations

import json

import torch

from ladle.config import ModelConfig
from ladle.kernels.fp8_quant import dequant_block_fp8, quantize_block_fp8, quantize_fp8_rows
from ladle.layers.linear import QKVParallelLinear, RowParallelLinear
from ladle.layers.moe import FusedMoE
from ladle.layers.quant_slot import quant_config_scope
from ladle.models.weights import WeightNameTable, WeightRule, load_weights_by_table
from ladle.quant.config import quant_config_of
from ladle.quant.fp8 import Fp8Config
from torch import nn


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(200, 48, 3, 1)  # q 144 rows: k starts off a 128-row boundary
        self.o_proj = RowParallelLinear(144, 136)


TABLE = WeightNameTable((WeightRule(r"([qkv])_proj\.weight", "qkv_proj.weight", r"\1"),
                         WeightRule(r"o_proj\.weight", "o_proj.weight")))


def _float_ckpt(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"q_proj.weight": torch.randn(144, 200, generator=g), "k_proj.weight": torch.randn(48, 200, generator=g),
            "v_proj.weight": torch.randn(48, 200, generator=g), "o_proj.weight": torch.randn(136, 144, generator=g)}


def test_hf_block_fp8_checkpoint_loads_exactly():
    ckpt, deq = {}, {}
    for name, w in _float_ckpt().items():
        q, s = quantize_block_fp8(w)
        ckpt[name], ckpt[name + "_scale_inv"] = q, s
        deq[name] = dequant_block_fp8(q, s, torch.float64)
    with quant_config_scope(Fp8Config(from_checkpoint=True)):
        m = _Tiny()
    loaded = load_weights_by_table(m, list(ckpt.items()), TABLE)
    assert loaded == {n for n, _ in m.named_parameters()}
    merged = torch.cat([deq[f"{c}_proj.weight"] for c in "qkv"])
    assert torch.equal(dequant_block_fp8(m.qkv_proj.weight, m.qkv_proj.weight_scale_inv, torch.float64), merged)
    assert torch.equal(dequant_block_fp8(m.o_proj.weight, m.o_proj.weight_scale_inv, torch.float64),
                       deq["o_proj.weight"])
    x = torch.randn(5, 200)
    assert _rel(m.qkv_proj(x), x.double() @ merged.T) < 0.08


def test_online_quantization_through_the_loaders():
    ckpt = _float_ckpt(1)
    with quant_config_scope(Fp8Config()):
        m = _Tiny()
    assert m.qkv_proj.weight.dtype == torch.float8_e4m3fn
    loaded = load_weights_by_table(m, list(ckpt.items()), TABLE)
    assert loaded == {n for n, _ in m.named_parameters()}  # scales count as written with their weight
    merged = torch.cat([ckpt[f"{c}_proj.weight"] for c in "qkv"])
    q, s = quantize_fp8_rows(merged)
    assert torch.equal(m.qkv_proj.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(m.qkv_proj.weight_scale_inv, s)
    x = torch.randn(4, 144)
    assert _rel(m.o_proj(x), x.double() @ ckpt["o_proj.weight"].double().T) < 0.08


def _n_minor(scale):
    """A float32 scale [N, G] laid out N-minor: strides (1, N), its transpose contiguous (not row-major)."""
    n, g = scale.shape
    return scale.dtype == torch.float32 and scale.stride() == (1, n) and scale.t().is_contiguous() and g > 1


def test_linear_scales_n_minor_through_every_loader():
    """Fp8LinearMethod makes a linear's float32 weight_scale_inv N-minor (its transpose is torch._scaled_mm's scale_b
    with no per-call copy); MXFP8's uint8 scales stay row-major. Every way in (HF block-FP8 checkpoint incl. a
    tensor-parallel rank, online quantization through the loaders, dummy init_from_float) writes into that storage
    (same data_ptr, same strides afterwards) the values quantize_fp8_rows gives for the same float weight (the
    checkpoint: per piece, as stored)."""
    ckpt = _float_ckpt(3)
    merged = torch.cat([ckpt[f"{c}_proj.weight"] for c in "qkv"])
    o_rows = quantize_fp8_rows(ckpt["o_proj.weight"])
    want_float = {"qkv_proj": quantize_fp8_rows(merged), "o_proj": o_rows}
    per_piece = [quantize_fp8_rows(ckpt[f"{c}_proj.weight"]) for c in "qkv"]
    want_hf = {"qkv_proj": tuple(torch.cat(t) for t in zip(*per_piece)), "o_proj": o_rows}
    hf = {}
    for name, w in ckpt.items():
        hf[name], hf[name + "_scale_inv"] = quantize_block_fp8(w)

    def check(m, want):
        for layer_name, (q, s) in want.items():
            layer = getattr(m, layer_name)
            assert _n_minor(layer.weight_scale_inv) and layer.weight_scale_inv.data_ptr() == ptrs[layer_name]
            assert torch.equal(layer.weight_scale_inv, s)
            assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))

    for config, fill in ((Fp8Config(), "online"), (Fp8Config(), "dummy"), (Fp8Config(from_checkpoint=True), "hf")):
        with quant_config_scope(config):
            m = _Tiny()
        ptrs = {name: getattr(m, name).weight_scale_inv.data_ptr() for name in want_float}
        assert all(_n_minor(getattr(m, name).weight_scale_inv) for name in want_float)
        if fill == "online":
            load_weights_by_table(m, list(ckpt.items()), TABLE)
        elif fill == "dummy":
            m.qkv_proj.weight.init_from_float(merged)
            m.o_proj.weight.init_from_float(ckpt["o_proj.weight"])
        else:
            load_weights_by_table(m, list(hf.items()), TABLE)
        check(m, want_hf if fill == "hf" else want_float)

    # tensor-parallel rank 1 of 2 (rows of q|k|v, 128-groups of o_proj's K), checkpoint path
    with quant_config_scope(Fp8Config(from_checkpoint=True)):
        qkv = QKVParallelLinear(256, 64, 4, 2, tp_rank=1, tp_size=2)
        o = RowParallelLinear(512, 136, tp_rank=1, tp_size=2)
    ptr_qkv, ptr_o = qkv.weight_scale_inv.data_ptr(), o.weight_scale_inv.data_ptr()
    g = torch.Generator().manual_seed(4)
    pieces = {"q": torch.randn(256, 256, generator=g), "k": torch.randn(128, 256, generator=g),
              "v": torch.randn(128, 256, generator=g)}
    for sid, w in pieces.items():
        qkv.weight_scale_inv.weight_loader(qkv.weight_scale_inv, quantize_block_fp8(w)[1], sid)
    w_o = torch.randn(136, 512, generator=g)
    o.weight_scale_inv.weight_loader(o.weight_scale_inv, quantize_block_fp8(w_o)[1])
    assert _n_minor(qkv.weight_scale_inv) and qkv.weight_scale_inv.data_ptr() == ptr_qkv
    assert _n_minor(o.weight_scale_inv) and o.weight_scale_inv.data_ptr() == ptr_o
    rank_rows = torch.cat([quantize_fp8_rows(w)[1][w.shape[0] // 2:] for w in pieces.values()])
    assert torch.equal(qkv.weight_scale_inv, rank_rows)
    assert torch.equal(o.weight_scale_inv, quantize_fp8_rows(w_o)[1][:, 2:])

    with quant_config_scope(Fp8Config(from_checkpoint=True, mx=True)):
        mx = RowParallelLinear(256, 64)
    assert mx.weight_scale_inv.dtype == torch.uint8 and mx.weight_scale_inv.is_contiguous()
    assert mx.weight_scale_inv.shape == (64, 8)


def _moe(config):
    with quant_config_scope(config):
        moe = FusedMoE(136, 4, 2, 160, shared_intermediate_size=160, routed_scaling_factor=2.0)
    moe.gate_weight.data.normal_()
    moe.e_score_correction_bias.data.normal_(std=0.1)
    return moe


def test_fused_moe_fp8_checkpoint_and_online_agree():
    g = torch.Generator().manual_seed(2)
    experts = {e: {w: torch.randn(*(160, 136) if w != "w2" else (136, 160), generator=g) / 12 for w in
                   ("w1", "w3", "w2")} for e in (0, 1, 2, 3, "shared")}
    online, ckpt_moe = _moe(Fp8Config()), _moe(Fp8Config(from_checkpoint=True))
    ckpt_moe.gate_weight.data.copy_(online.gate_weight)
    ckpt_moe.e_score_correction_bias.data.copy_(online.e_score_correction_bias)
    for e, ws in experts.items():
        for shard, w in ws.items():
            param = "w2" if shard == "w2" else "w13"
            getattr(online, param).weight_loader(getattr(online, param), w, shard, expert_id=e)
            q, s = quantize_block_fp8(w)
            p = getattr(ckpt_moe, param)
            p.weight_loader(p, q, shard, expert_id=e)
            ps = getattr(ckpt_moe, param + "_scale_inv")
            ps.weight_loader(ps, s, shard, expert_id=e)
    row = 4  # the folded shared expert
    w13_deq = dequant_block_fp8(ckpt_moe.w13[row], ckpt_moe.w13_scale_inv[row], torch.float64)
    want = torch.cat([dequant_block_fp8(*quantize_block_fp8(experts["shared"][w]), torch.float64)
                      for w in ("w1", "w3")])
    assert torch.equal(w13_deq, want)
    x = torch.randn(9, 136)
    ref_w13 = torch.stack([torch.cat([experts[e]["w1"], experts[e]["w3"]]) for e in (0, 1, 2, 3, "shared")])
    ref_w2 = torch.stack([experts[e]["w2"] for e in (0, 1, 2, 3, "shared")])
    from ladle.kernels.fused_moe import fused_moe_ref

    ids, wts = online.route(x, with_shared=True)
    ref = fused_moe_ref(x, ref_w13, ref_w2, ids, wts)
    assert _rel(online(x), ref) < 0.08 and _rel(ckpt_moe(x), ref) < 0.08


def test_quant_config_choice():
    assert quant_config_of(ModelConfig(), {}) is None
    assert quant_config_of(ModelConfig(quantization="fp8"), {}) == Fp8Config(False)
    hf_fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert quant_config_of(ModelConfig(), hf_fp8) == Fp8Config(True)
    assert quant_config_of(ModelConfig(), {"quantization_config": {"quant_method": "mxfp8"}}) == Fp8Config(True, True)
    for bad_cfg, bad_hf in ((ModelConfig(quantization="awq"), {}),
                            (ModelConfig(), {"quantization_config": {"quant_method": "fp8",
                                                                     "weight_block_size": [1, 128]}})):
        try:
            quant_config_of(bad_cfg, bad_hf)
        except ValueError:
            continue
        raise AssertionError(json.dumps(bad_hf))
