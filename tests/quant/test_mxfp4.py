"""MXFP4 experts (ladle/kernels/fused_moe_mxfp4.py, format helpers in fp8_quant.py) on fresh random inputs.

Format facts checked by hand (design/minimax_m3.md §2.3): low nibble = even element, E2M1 magnitudes, sign bit 3,
E8M0 scale. Kernel vs its float64 reference on the dequantised weights: weight-only, activations in float32 here,
so the two differ by summation order only: relative error < 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from ladle.kernels.fp8_quant import dequant_mxfp4, quantize_mxfp4
from ladle.kernels.fused_moe import MoETileConfig
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4, fused_moe_mxfp4_ref, fused_moe_mxfp4_triton
from ladle.kernels.moe_router import moe_router_triton


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _pack(w):
    return (torch.stack(t) for t in zip(*[quantize_mxfp4(x) for x in w]))


def test_mxfp4_layout_by_hand():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x3 | (0xD << 4)  # element 0: code 3 = +1.5; element 1: code 0xD = -(code 5) = -3
    packed[0, 1] = 0x7 | (0x9 << 4)  # element 2: +6; element 3: -0.5
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    vals = dequant_mxfp4(packed, scale)
    assert vals[0, :4].tolist() == [3.0, -6.0, 12.0, -1.0] and vals[0, 4:].abs().sum() == 0


def test_quantize_mxfp4_round_trip_error():
    w = torch.randn(16, 96)
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (16, 48) and scale.shape == (16, 3)
    assert _rel(dequant_mxfp4(packed, scale, torch.float64), w) < 0.15  # E2M1: 1 mantissa bit


@pytest.mark.parametrize("T,cfg", [(9, MoETileConfig(16, 16, 32, 32, 4, 2)), (40, None)])
def test_fused_moe_mxfp4_kernel(T, cfg):
    H, I, E = 96, 64, 5
    x = torch.randn(T, H)
    ids, wts = moe_router_triton(x, torch.randn(E, H), torch.zeros(E), 2, 2.0, shared_expert=True)
    w13_p, w13_s = _pack(torch.randn(E + 1, 2 * I, H) / H ** 0.5 * 3)
    w2_p, w2_s = _pack(torch.randn(E + 1, H, I) / I ** 0.5)
    out = fused_moe_mxfp4_triton(x, w13_p, w13_s, w2_p, w2_s, ids, wts, config=cfg)
    ref = fused_moe_mxfp4_ref(x, w13_p, w13_s, w2_p, w2_s, ids, wts)
    assert _rel(out, ref) < 1e-5
    assert _rel(fused_moe_mxfp4(x, w13_p, w13_s, w2_p, w2_s, ids, wts, use_triton=False), ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 1024])
def test_fused_moe_mxfp4_gpu_real_shapes(T):
    """TP4 rank of M3 (H 6144, I_r 768, 128 experts + shared row), bf16 activations."""
    H, I, E = 6144, 768, 128
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids, wts = moe_router_triton(x, torch.randn(E, H, device="cuda"), torch.zeros(E, device="cuda"), 4, 2.0,
                                 shared_expert=True)
    w13_p, w13_s = _pack(torch.randn(E + 1, 2 * I, H, device="cuda") / H ** 0.5)
    w2_p, w2_s = _pack(torch.randn(E + 1, H, I, device="cuda") / I ** 0.5)
    out = fused_moe_mxfp4_triton(x, w13_p, w13_s, w2_p, w2_s, ids, wts)
    assert _rel(out, fused_moe_mxfp4_ref(x, w13_p, w13_s, w2_p, w2_s, ids, wts)) < 2e-2


def test_tiny_m3_mxfp4_against_transformers_on_dequantized_weights(tmp_path):
    """`make-checkpoint --dtype mxfp4` -> load_model keeps the experts packed (exact dequantisation checked) and the
    forward matches transformers on a float32 twin of the dequantised checkpoint: weight-only, float32 activations,
    so only summation order differs (cosine >= 0.99999 per position, as the bf16 oracle test)."""
    import glob
    import json
    import os

    from safetensors.torch import load_file, save_file

    from drivers.minimax_m3_paged import PagedDriver
    from ladle.config import ModelConfig
    from ladle.models.loader import load_model, resolve_model_source
    from ladle.tools.checkpoint_m3 import make_checkpoint

    M = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    d = make_checkpoint(str(tmp_path / "mx4"), "tiny", dtype="mxfp4")
    tensors = {}
    for f in glob.glob(f"{d}/*.safetensors"):
        tensors.update(load_file(f))
    twin = {n: t.float() for n, t in tensors.items() if not n.endswith(".weight_scale") and t.dtype != torch.uint8}
    for n, t in tensors.items():
        if t.dtype == torch.uint8 and not n.endswith(".weight_scale"):
            twin[n] = dequant_mxfp4(t, tensors[n + "_scale"])
    os.makedirs(tmp_path / "twin")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg.pop("quantization_config")
    json.dump(cfg, open(tmp_path / "twin" / "config.json", "w"))
    save_file(twin, str(tmp_path / "twin" / "model.safetensors"))

    mc = ModelConfig(model=d)
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours = load_model(mc, resolve_model_source(mc), torch.float32, torch.device("cpu"))
        moe = ours.layers[2].mlp
        assert moe.w13.dtype == torch.uint8
        base = "language_model.model.layers.2.block_sparse_moe."
        want = torch.cat([twin[base + f"experts.3.w{i}.weight"] for i in (1, 3)])
        assert torch.equal(dequant_mxfp4(moe.w13[3], moe.w13_scale_inv[3]), want)
        shared_down = twin[base + "shared_experts.down_proj.weight"]
        assert torch.equal(dequant_mxfp4(moe.w2[-1], moe.w2_scale_inv[-1]), shared_down)
        theirs = M.MiniMaxM3SparseForConditionalGeneration.from_pretrained(str(tmp_path / "twin"),
                                                                            dtype=torch.float32).eval()
        ids = torch.randint(3, 512, (60,), generator=torch.Generator().manual_seed(4)).tolist()
        with torch.no_grad():
            ref = theirs(input_ids=torch.tensor([ids])).logits[0].float()
        got = PagedDriver(ours, num_blocks=10).prefill("a", ids)
    finally:
        torch.set_num_threads(n_threads)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min().item() >= 0.99999, cos.min().item()
