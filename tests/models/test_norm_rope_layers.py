"""The RMSNorm and RotaryEmbedding layers reach the ops the forward context asks for (OpBackends.fused_norms) and
agree with float64 formulas either way: Llama's w and Gemma's 1 + w, fused residual, per-head norm, norm + RoPE."""

from __future__ import annotations

import contextlib

import pytest
import torch

from ladle.layers.attention.metadata import ForwardContext, OpBackends, set_forward_context
from ladle.layers.norm import RMSNorm
from ladle.layers.rotary import RotaryEmbedding
from ladle.observe import dispatch


def _ctx(fused: bool):
    if not fused:
        return contextlib.nullcontext()  # outside a forward: the references
    return set_forward_context(ForwardContext(None, [], backends=OpBackends.kernels()))


def _executed(op: str) -> int:
    return sum(b["executed"] for b in dispatch.snapshot()["ops"].get(op, {}).get("buckets", {}).values())


def _norm64(x, w, eps, offset):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rmsnorm_layer_residual_and_per_head(fused, offset):
    g = torch.Generator().manual_seed(int(offset) + 2 * fused)
    x, res = torch.randn(6, 32, generator=g) * 2, torch.randn(6, 32, generator=g)
    norm = RMSNorm(32, 1e-5, weight_offset=offset)
    assert torch.equal(norm.weight + offset, torch.ones(32))  # built at the identity
    norm.weight.data.copy_(torch.randn(32, generator=g) * 0.3 + (1 - offset))
    before = _executed("rmsnorm")
    with _ctx(fused):
        y, s = norm(x, res)
        first, same = norm.add_norm(x, None)
        heads = norm(x.view(6, 2, 16).repeat(1, 1, 2))  # per-head norm on [T, heads, dim]
    assert (_executed("rmsnorm") > before) == fused
    torch.testing.assert_close(s, x + res)
    torch.testing.assert_close(y.double(), _norm64(x + res, norm.weight, 1e-5, offset), rtol=1e-5, atol=1e-6)
    assert same is x and torch.allclose(first.double(), _norm64(x, norm.weight, 1e-5, offset), atol=1e-5)
    want = _norm64(x.view(6, 2, 16).repeat(1, 1, 2), norm.weight, 1e-5, offset)
    torch.testing.assert_close(heads.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_norm_rope_and_rotary_layer_dispatch(fused):
    g = torch.Generator().manual_seed(7)
    T, H, D, rot = 5, 3, 32, 16
    x = torch.randn(T, H * D + 8, generator=g)[:, : H * D].view(T, H, D)  # a strided view of a wider output
    positions = torch.tensor([0, 3, 17, 100, 511])
    rope = RotaryEmbedding(D, rot, 512, 10000.0)
    norm = RMSNorm(D, 1e-6, weight_offset=1.0)
    norm.weight.data.copy_(torch.randn(D, generator=g) * 0.2)
    before = (_executed("head_norm_rope"), _executed("rope"))
    with _ctx(fused):
        cos, sin = rope.cos_sin(positions, torch.float32)
        y = norm.norm_rope(x, cos, sin)
        q, k = rope(positions, x.reshape(T, H * D), x[:, :1].reshape(T, D))
    assert (_executed("head_norm_rope") > before[0]) == fused and (_executed("rope") > before[1]) == fused
    n = _norm64(x, norm.weight, 1e-6, 1.0)
    ang = positions.double()[:, None] * 10000.0 ** (-torch.arange(rot // 2, dtype=torch.float64) * 2 / rot)
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rot64(v):
        out = v.clone()
        out[..., : rot // 2] = v[..., : rot // 2] * c - v[..., rot // 2: rot] * s
        out[..., rot // 2: rot] = v[..., rot // 2: rot] * c + v[..., : rot // 2] * s
        return out

    torch.testing.assert_close(y.double(), rot64(n), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.double().view(T, H, D), rot64(x.double()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double().view(T, 1, D), rot64(x[:, :1].double()), rtol=1e-5, atol=1e-5)
