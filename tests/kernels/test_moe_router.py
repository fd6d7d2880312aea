"""MoE router (ladle/kernels/moe_router.py) vs its reference and vs hand-computed float64 values."""

from __future__ import annotations

import math

import torch

from ladle.kernels.moe_router import moe_router, moe_router_ref, moe_router_triton


def test_random_with_bias_and_shared_column():
    torch.manual_seed(0)
    T, H, E, k = 9, 48, 8, 3
    x = torch.randn(T, H).bfloat16()
    w = torch.randn(E, H)
    bias = torch.randn(E) * 0.5  # large enough that biased choice != unbiased ranking somewhere
    ids, wts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True)
    rids, rwts = moe_router_ref(x, w, bias, k, 2.0, shared_expert=True)
    assert torch.equal(ids, rids)
    assert torch.allclose(wts, rwts, rtol=1e-6, atol=1e-6)
    assert (ids[:, -1] == E).all() and (wts[:, -1] == 1.0).all(), "shared column: id E, weight exactly 1.0"
    assert torch.allclose(wts[:, :k].sum(1), torch.full((T,), 2.0), atol=1e-5)
    unbiased = torch.topk(torch.sigmoid(x.float() @ w.T), k, dim=1).indices.sort(1).values
    assert not torch.equal(unbiased, ids[:, :k].long().sort(1).values), "bias must change some choice"


def test_hand_computed_token():
    """One token, float64 by hand: choice by sigmoid+bias, weights from the unbiased sigmoid."""
    x = torch.tensor([[1.0, -2.0]])
    w = torch.tensor([[0.5, 0.0], [0.0, 0.5], [1.0, 1.0], [-1.0, 0.0]])  # logits 0.5, -1, -1, -1
    bias = torch.tensor([0.0, 0.9, 0.0, 0.2])
    ids, wts = moe_router_triton(x, w, bias, 2, 2.5)
    # choice = sig + bias = [0.622, 1.169, 0.269, 0.469] -> experts 1, 0
    s0, s1 = 1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(1.0))
    assert ids.tolist() == [[1, 0]]
    assert torch.allclose(wts.double(), torch.tensor([[s1, s0]], dtype=torch.float64) / (s0 + s1) * 2.5, atol=1e-6)


def test_ties_lower_id_wins_and_no_bias():
    x = torch.ones(2, 4)
    w = torch.zeros(6, 4)
    w[3] = 1.0  # expert 3 best; experts 0,1,2,4,5 tie
    ids, wts = moe_router(x, w, None, 3, 1.0)
    assert ids.tolist() == [[3, 0, 1], [3, 0, 1]]
    assert torch.equal(ids, moe_router_ref(x, w, None, 3, 1.0)[0])
    assert torch.allclose(wts.sum(1), torch.ones(2))
