"""RMSNorm (+ fused residual) and NeoX RoPE (full and partial) against float64 formulas."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import apply_rope, rms_norm, rope_cos_sin_cache


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("hidden,offset", [(48, 0.0), (100, 1.0)])
def test_rmsnorm_fused_residual(device, hidden, offset):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(13, hidden, generator=g) * 3
    r = torch.randn(13, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    eps = 1e-5
    s = x.double() + r.double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)
    out, res = rms_norm(x.to(device), w.to(device), eps, residual=r.to(device), weight_offset=offset)
    assert _rel(res.cpu(), s) < 1e-7
    assert _rel(out.cpu(), want) < 1e-6
    plain = rms_norm(x.to(device), w.to(device), eps, weight_offset=offset)
    xd = x.double()
    want_plain = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + offset)
    assert _rel(plain.cpu(), want_plain) < 1e-6


def _rope64(x, positions, rot, base):
    """float64 NeoX rotation written from the formula (independent of the cache builder)."""
    x = x.double().clone()
    half = rot // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) * 2 / rot)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half].clone(), x[..., half:rot].clone()
    x[..., :half] = x1 * cos - x2 * sin
    x[..., half:rot] = x2 * cos + x1 * sin
    return x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("head_dim,rot", [(16, 16), (32, 16)])  # full and partial rotary
def test_rope_neox(device, head_dim, rot):
    g = torch.Generator().manual_seed(head_dim + rot)
    t, hq, hk, base = 11, 5, 2, 10000.0
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=g)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)  # strided views, as a model passes them
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(t, hk, head_dim)
    positions = torch.randint(0, 500, (t,), generator=g)
    want_q, want_k = _rope64(q, positions, rot, base), _rope64(k, positions, rot, base)
    qkv_d = qkv.to(device)
    qd = qkv_d[:, : hq * head_dim].view(t, hq, head_dim)
    kd = qkv_d[:, hq * head_dim : (hq + hk) * head_dim].view(t, hk, head_dim)
    cache = rope_cos_sin_cache(rot, 512, base, device=device)
    apply_rope(qd, kd, positions.to(device), cache)
    assert _rel(qd.cpu(), want_q) < 1e-6 and _rel(kd.cpu(), want_k) < 1e-6
    assert torch.equal(qkv_d[:, (hq + hk) * head_dim :].cpu(), qkv[:, (hq + hk) * head_dim :]), "v must be untouched"
