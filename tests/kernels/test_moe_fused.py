"""Fused MoE (ladle/kernels/fused_moe.py) vs the float64 per-expert reference (the align step alone:
test_moe_align.py)."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels.fused_moe import (MoETileConfig, fused_moe, fused_moe_ref, fused_moe_triton, select_config,
                                     swigluoai_ref)
from ladle.kernels.moe_router import moe_router_triton

H, I = 64, 32
SMALL = MoETileConfig(16, 16, 32, 32, 4, 2)
ODD = MoETileConfig(4, 16, 16, 64, 4, 2)  # BM 4 (many tiles), BK > I exercises the K masks


def _weights(E, scale=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * scale, torch.randn(E, H, I, generator=g) * 0.2


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_swigluoai_hand_values():
    g = torch.tensor([0.0, 1.0, 9.0, -3.0])
    u = torch.tensor([2.0, -9.0, 8.0, 0.5])
    sig = lambda z: 1 / (1 + torch.exp(torch.tensor(-z)))  # noqa: E731
    expect = torch.stack([torch.tensor(0.0), (-7 + 1) * 1 * sig(1.702), (7 + 1) * 7 * sig(1.702 * 7),
                          (0.5 + 1) * -3 * sig(-1.702 * 3)])
    assert torch.allclose(swigluoai_ref(g, u), expect, atol=1e-6)


@pytest.mark.parametrize("cfg", [SMALL, ODD])
def test_router_to_moe_with_shared_expert(cfg):
    """Router output (k routed + shared column id E, weight 1.0) through the fused path; weights scaled so both
    clamps are hit."""
    torch.manual_seed(1)
    T, E, k = 11, 8, 2
    x = torch.randn(T, H)
    ids, wts = moe_router_triton(x, torch.randn(E, H), torch.randn(E) * 0.3, k, 2.0, shared_expert=True)
    w13, w2 = _weights(E + 1, scale=0.6)
    assert (x @ w13[:, :I].transpose(1, 2)).abs().max() > 7
    out = fused_moe_triton(x, w13, w2, ids, wts, config=cfg)
    assert _rel(out, fused_moe_ref(x, w13, w2, ids, wts)) < 1e-5


def test_empty_experts_and_all_to_one_expert():
    torch.manual_seed(2)
    E, T = 8, 37
    x = torch.randn(T, H)
    w13, w2 = _weights(E)
    ids = torch.where(torch.rand(T, 2) < 0.5, 1, 5).int()  # experts 0,2,3,4,6,7 get nothing
    ids[:, 1] = torch.where(ids[:, 0] == 1, 5, 1)
    wts = torch.rand(T, 2)
    assert _rel(fused_moe_triton(x, w13, w2, ids, wts, config=SMALL), fused_moe_ref(x, w13, w2, ids, wts)) < 1e-5
    ids1 = torch.full((T, 1), 3, dtype=torch.int32)  # one expert, 37 rows > BLOCK_M: several tiles
    wts1 = torch.rand(T, 1)
    assert _rel(fused_moe_triton(x, w13, w2, ids1, wts1, config=SMALL), fused_moe_ref(x, w13, w2, ids1, wts1)) < 1e-5


def test_prefill_config_and_bf16():
    torch.manual_seed(3)
    E, T = 6, 300  # > 256 tokens: the prefill tile config
    assert select_config(T).block_m >= 64
    x = torch.randn(T, H)
    w13, w2 = _weights(E)
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)]).int()
    wts = torch.rand(T, 2)
    ref = fused_moe_ref(x, w13, w2, ids, wts)
    assert _rel(fused_moe_triton(x, w13, w2, ids, wts), ref) < 1e-5
    out16 = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), ids, wts)
    assert out16.dtype == torch.bfloat16 and _rel(out16, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 40, 700])
def test_gpu_bf16_and_graph(T):
    torch.manual_seed(6)
    E, h, i = 17, 256, 128
    x = torch.randn(T, h, device="cuda").bfloat16()
    w13 = (torch.randn(E, 2 * i, h, device="cuda") * 0.1).bfloat16()
    w2 = (torch.randn(E, h, i, device="cuda") * 0.1).bfloat16()
    ids, wts = moe_router_triton(x, torch.randn(E - 1, h, device="cuda"), None, 4, 2.0, shared_expert=True)
    out = fused_moe_triton(x, w13, w2, ids, wts)
    assert _rel(out, fused_moe_ref(x, w13, w2, ids, wts)) < 2e-2
    g = torch.cuda.CUDAGraph()
    fused_moe_triton(x, w13, w2, ids, wts)
    with torch.cuda.graph(g):
        static = fused_moe_triton(x, w13, w2, ids, wts)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)
