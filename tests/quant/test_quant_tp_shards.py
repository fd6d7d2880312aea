"""Tensor-parallel loading of quantized weights (tp_size 2): every rank's FP8 / MXFP8 / MXFP4 parameters, dequantized,
equal exactly that rank's slice of the checkpoint's dequantized full tensor (rows for column-parallel layers and
expert gate/up, 128- or 32-groups of K for row-parallel layers and expert down). No forward: collectives belong to
the tensor-parallel issue.
"""

from __future__ import annotations

import pytest
import torch

from ladle.kernels.fp8_quant import (dequant_block_fp8, dequant_mxfp4, quantize_block_fp8, quantize_mxfp4,
                                     quantize_mxfp8)
from ladle.layers.linear import QKVParallelLinear, RowParallelLinear
from ladle.layers.moe import FusedMoE
from ladle.layers.quant_slot import quant_config_scope
from ladle.quant.fp8 import Fp8Config
from ladle.quant.mxfp4 import Mxfp4Config

TP = 2
FORMATS = {"fp8": (Fp8Config(True), quantize_block_fp8, dequant_block_fp8),
           "mxfp8": (Fp8Config(True, True), quantize_mxfp8, dequant_block_fp8)}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_linear_shards(fmt):
    config, quantize, dequant = FORMATS[fmt]
    g = torch.Generator().manual_seed(0)
    pieces = {"q": torch.randn(256, 256, generator=g), "k": torch.randn(128, 256, generator=g),
              "v": torch.randn(128, 256, generator=g)}
    o = torch.randn(192, 512, generator=g)
    for r in range(TP):
        with quant_config_scope(config):
            qkv = QKVParallelLinear(256, 64, 4, 2, tp_rank=r, tp_size=TP)
            row = RowParallelLinear(512, 192, tp_rank=r, tp_size=TP)
        want = []
        for sid, w in pieces.items():
            q, s = quantize(w)
            qkv.weight.weight_loader(qkv.weight, q, sid)
            qkv.weight_scale_inv.weight_loader(qkv.weight_scale_inv, s, sid)
            rows = w.shape[0] // TP
            want.append(dequant(q, s)[r * rows:(r + 1) * rows])
        assert torch.equal(dequant(qkv.weight, qkv.weight_scale_inv), torch.cat(want))
        q, s = quantize(o)
        row.weight.weight_loader(row.weight, q)
        row.weight_scale_inv.weight_loader(row.weight_scale_inv, s)
        assert torch.equal(dequant(row.weight, row.weight_scale_inv), dequant(q, s)[:, r * 256:(r + 1) * 256])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "mxfp4"])
def test_moe_shards(fmt):
    config, quantize, dequant = FORMATS.get(fmt, (Mxfp4Config(), quantize_mxfp4, dequant_mxfp4))
    H, I = 128, 256
    g = torch.Generator().manual_seed(1)
    w1, w3, w2 = torch.randn(I, H, generator=g), torch.randn(I, H, generator=g), torch.randn(H, I, generator=g)
    for r in range(TP):
        with quant_config_scope(config):
            moe = FusedMoE(H, 2, 1, I, shared_intermediate_size=I, tp_rank=r, tp_size=TP)
        for shard, w, param in (("w1", w1, "w13"), ("w3", w3, "w13"), ("w2", w2, "w2")):
            q, s = quantize(w)
            p, ps = getattr(moe, param), getattr(moe, param + "_scale_inv")
            p.weight_loader(p, q, shard, expert_id="shared")
            ps.weight_loader(ps, s, shard, expert_id="shared")
        i_r = I // TP
        full = {n: dequant(*quantize(w)) for n, w in (("w1", w1), ("w3", w3), ("w2", w2))}
        gate_up = torch.cat([full["w1"][r * i_r:(r + 1) * i_r], full["w3"][r * i_r:(r + 1) * i_r]])
        assert torch.equal(dequant(moe.w13[2], moe.w13_scale_inv[2]), gate_up)
        assert torch.equal(dequant(moe.w2[2], moe.w2_scale_inv[2]), full["w2"][:, r * i_r:(r + 1) * i_r])
