"""FusedMoE runs long token runs in chunks of MOE_CHUNK_TOKENS (ladle/layers/moe.py): the chunked output equals the
one-call output, token by token, for the plain and the FP8 expert tables (the shared expert folded in), on the torch
references and on the Triton kernels (CPU interpreter); each chunk's result is written into its rows of the layer's
output (the FP8 op's combine writes them; the others copy)."""

import pytest
import torch

from ladle.layers import moe as moe_module
from ladle.layers.attention.metadata import OpBackends
from ladle.layers.moe import FusedMoE
from ladle.quant.fp8 import Fp8Config
from ladle.layers.quant_slot import quant_config_scope


def _layer(quant):
    torch.manual_seed(0)
    if quant:
        with quant_config_scope(Fp8Config()):
            layer = FusedMoE(128, 6, 2, 96, shared_intermediate_size=96, routed_scaling_factor=2.0)
    else:
        layer = FusedMoE(128, 6, 2, 96, shared_intermediate_size=96, routed_scaling_factor=2.0, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    for e in [*range(6), "shared"]:
        for shard, shape in (("w1", (96, 128)), ("w3", (96, 128)), ("w2", (128, 96))):
            param = layer.w2 if shard == "w2" else layer.w13
            param.weight_loader(param, torch.randn(*shape, generator=g) / 10, shard, expert_id=e)
    layer.gate_weight.data.normal_(generator=g)
    layer.e_score_correction_bias.data.normal_(std=0.1, generator=g)
    return layer


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("quant", [False, True], ids=["bf16-table", "fp8"])
def test_chunked_moe_equals_one_call(monkeypatch, quant, path):
    if path == "triton":
        monkeypatch.setattr(moe_module, "op_backends", OpBackends.kernels)
    layer = _layer(quant)
    x = torch.randn(23, 128, generator=torch.Generator().manual_seed(3))
    whole = layer(x)
    calls = []
    apply = layer.quant_method.apply

    def counting_apply(lyr, xs, ids, wts, use_triton, out=None):
        got = apply(lyr, xs, ids, wts, use_triton=use_triton, out=out)
        calls.append((xs.shape[0], out.data_ptr(), got.data_ptr(), use_triton))
        return got

    monkeypatch.setattr(layer.quant_method, "apply", counting_apply)
    monkeypatch.setattr(moe_module, "MOE_CHUNK_TOKENS", 8)
    chunked = layer(x)
    row = chunked.stride(0) * chunked.element_size()
    base = chunked.data_ptr()
    # three chunks, each handed its rows of the output, each returning that very tensor
    assert calls == [(n, base + start * row, base + start * row, path == "triton")
                     for n, start in ((8, 0), (8, 8), (7, 16))]
    assert whole.abs().max() > 0.1  # a real output, not zeros
    # each token's experts are computed from its own row only; the reference matmuls may round a row differently
    # when the row count changes (BLAS blocking), so allow float32 rounding, far below any row mix-up (~O(1) rel)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    # a permutation of the chunks' rows would not pass: rows of the output differ from each other
    assert (whole[:8] - whole[8:16]).abs().max() > 1e-2
