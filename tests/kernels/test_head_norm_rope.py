"""Fused per-head Gemma RMSNorm + partial NeoX RoPE against a float64 formula and against the M3 torch layers."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels._common import interpreting
from ladle.kernels.head_norm_rope import head_norm_rope, head_norm_rope_ref
from ladle.kernels.rope import rotate_ref
from ladle.layers.norm import RMSNorm
from ladle.layers.rotary import RotaryEmbedding
from ladle.observe import dispatch


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _formula64(x, w, eps, cos, sin):
    """float64: Gemma RMSNorm over the last dim, then rotate-half on the first r = cos.shape[-1] channels, written
    from the formulas with the given cos/sin rows (the angles are the cos/sin builder's business, tested elsewhere)."""
    xd = x.double()
    n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.double())
    rot = cos.shape[-1]
    half = rot // 2
    cos, sin = cos.double()[:, None, :half], sin.double()[:, None, :half]
    y = n.clone()
    y[..., :half] = n[..., :half] * cos - n[..., half:rot] * sin
    y[..., half:rot] = n[..., half:rot] * cos + n[..., :half] * sin
    return y


def _inputs(T, H, D, rot, seed, dtype, strided):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(T, H * D + (3 * D if strided else 0), generator=g) * 2 + 0.5
    x = base[:, :H * D].view(T, H, D) if strided else base.view(T, H, D)  # a view of a wider projection output
    w = torch.randn(D, generator=g) * 0.3
    positions = torch.randint(0, 4096, (T,), generator=g)
    return x.to(dtype), w.to(dtype), positions


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("T,H,D,rot,strided", [(7, 4, 32, 16, True), (16, 16, 32, 32, False),  # T == H trap
                                               (5, 1, 64, 32, False), (3, 3, 48, 16, True)])  # non-pow2 D and H
def test_head_norm_rope_float32_matches_formula(device, T, H, D, rot, strided):
    x, w, positions = _inputs(T, H, D, rot, seed=T * 100 + H, dtype=torch.float32, strided=strided)
    rope = RotaryEmbedding(D, rot, 4096, 10000.0, device="cpu")
    cos, sin = rope.cos_sin(positions, torch.float32)
    before = dispatch.snapshot()["ops"].get("head_norm_rope", {}).get("buckets", {})
    out = head_norm_rope(x.to(device), w.to(device), 1e-6, cos.to(device), sin.to(device))
    counts = dispatch.snapshot()["ops"]["head_norm_rope"]["buckets"]
    if device == "cuda" or interpreting():  # a CPU tensor on a CUDA box runs the reference (not eligible)
        assert sum(v["executed"] for v in counts.values()) > sum(v["executed"] for v in before.values())
    want = _formula64(x, w, 1e-6, cos, sin)
    assert out.shape == (T, H, D) and out.is_contiguous()
    assert _rel(out.cpu(), want) < 1e-6
    assert _rel(head_norm_rope_ref(x, w, 1e-6, cos, sin), want) < 1e-6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_head_norm_rope_bf16_matches_torch_layers(device):
    """bf16: the kernel reproduces the rounding points of the (1 + w) RMSNorm then the RoPE rotation, so nearly every
    element is bit-identical (the sum of squares may be added in another order: then 1 ulp apart), on the GPU and
    under the CPU interpreter alike (the kernel rounds with integer ops: the interpreter truncates on a bf16 cast)."""
    T, H, D, rot = 9, 4, 64, 32
    x, w, positions = _inputs(T, H, D, rot, seed=3, dtype=torch.bfloat16, strided=True)
    norm = RMSNorm(D, 1e-6, weight_offset=1.0, dtype=torch.bfloat16, device="cpu")
    norm.weight.data.copy_(w)
    rope = RotaryEmbedding(D, rot, 4096, 10000.0, device="cpu")
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    want = rotate_ref(norm(x), cos, sin)
    out = head_norm_rope(x.to(device), w.to(device), 1e-6, cos.to(device), sin.to(device)).cpu()
    same = (out == want).float().mean().item()
    assert same > 0.97, f"only {same:.3f} of elements bit-identical to the torch layers"
    # each of the three roundings moves a value by < 1 ulp <= 2^-7 x the head's largest normed value (bf16 keeps 8
    # significant bits), so the gap to the torch layers stays under 3 such ulps everywhere
    ulp = norm(x).float().abs().amax(-1, keepdim=True) * 2.0 ** -7
    assert ((out.float() - want.float()).abs() <= 3 * ulp).all()
    assert _rel(out, _formula64(x.float(), w.float(), 1e-6, cos, sin)) < 1e-2


def test_head_norm_rope_rejects_bad_shapes():
    x = torch.randn(4, 2, 16)
    w = torch.randn(16)
    cos = sin = torch.randn(4, 8)
    with pytest.raises(AssertionError, match="rotary width"):
        head_norm_rope(x, w, 1e-6, torch.randn(4, 7), torch.randn(4, 7))
    with pytest.raises(AssertionError, match="dtype"):
        head_norm_rope(x, w, 1e-6, cos.half(), sin.half())
    with pytest.raises(AssertionError, match="weight"):
        head_norm_rope(x, torch.randn(8), 1e-6, cos, sin)
