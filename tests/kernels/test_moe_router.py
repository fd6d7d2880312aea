"""MoE router (ladle/kernels/moe_router.py) vs its reference and vs hand-computed float64 values."""

from __future__ import annotations

import math

import pytest
import torch

from ladle.kernels.moe_router import (moe_router, moe_router_logits_triton, moe_router_ref, moe_router_triton,
                                     router_launch)


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


# -- the logits kernel (3xTF32 on the GPU, exact fp32 under the interpreter) ------------------------------------------
# Stated bound: every logit within LOGIT_TOL * sum_k |x_k W_ek| of the float64 value (3xTF32 is ~1e-6 of that on the
# GPU; the interpreter's fp32 products ~1e-7); routed weights within WEIGHT_RTOL of float64 for the same ids.
LOGIT_TOL, WEIGHT_RTOL = 1e-5, 1e-5
H_TEST = 256  # 8 BLOCK_K steps of 32: the interpreter's launch rule splits K into 4 programs (num_sms() = 4 off-GPU)


def _inputs(T, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H_TEST, generator=g).to(dtype)
    w = torch.randn(E, H_TEST, generator=g) * 0.05
    bias = torch.randn(E, generator=g) * 0.2
    return x, w, bias


def _check_against_float64(x, w, bias, k, shared, ids, wts):
    """Ids equal the reference's on every token whose top-k margin (sorted choice gaps among the first k+1)
    exceeds twice the logit bound; weights within WEIGHT_RTOL of float64 for the kernel's ids. Returns the number
    of tokens whose ids were compared."""
    T, E = x.shape[0], w.shape[0]
    l64 = x.double() @ w.double().T
    bound = LOGIT_TOL * (x.double().abs() @ w.double().abs().T)
    rids, _ = moe_router_ref(x, w, bias, k, 2.0, shared_expert=shared)
    choice = torch.sigmoid(l64) + (bias.double() if bias is not None else 0.0)
    top = choice.sort(dim=1, descending=True).values[:, :min(k + 1, E)]
    margin = (top[:, :-1] - top[:, 1:]).min(dim=1).values if top.shape[1] > 1 else torch.full((T,), 1.0)
    clear = margin > 2 * bound.max(dim=1).values
    assert torch.equal(ids[clear], rids[clear])
    sel = ids[:, :k].long()
    s = torch.sigmoid(l64).gather(1, sel)
    w64 = s / s.sum(1, keepdim=True) * 2.0
    assert ((wts[:, :k].double() - w64).abs() <= WEIGHT_RTOL * w64).all()
    if shared:
        assert (ids[:, k] == E).all() and (wts[:, k] == 1.0).all()
    return int(clear.sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("E, with_bias, shared", [(8, True, True), (8, False, False), (12, True, False),
                                                  (12, False, True)])
def test_kernel_logits_ids_weights_vs_float64(dtype, T, E, with_bias, shared):
    x, w, bias = _inputs(T, E, dtype, seed=T * 100 + E + 7 * with_bias + 3 * shared)
    bias = bias if with_bias else None
    k = 3
    compared = 0
    for splits in (1, None):  # fused epilogue, then the launch rule (split K + epilogue kernel)
        cfg = router_launch(T, H_TEST, E, x.device, splits)
        assert (cfg.splits == 1) == (splits == 1), cfg
        logits = moe_router_logits_triton(x, w, splits=splits)
        l64 = x.double() @ w.double().T
        assert ((logits.double() - l64).abs() <= LOGIT_TOL * (x.double().abs() @ w.double().abs().T)).all()
        assert rel_err(logits, l64) < LOGIT_TOL
        ids, wts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=shared, splits=splits)
        assert ids.shape == wts.shape == (T, k + int(shared))
        compared += _check_against_float64(x, w, bias, k, shared, ids, wts)
    assert compared >= T, "most tokens must have a clear top-k margin (else the id check says nothing)"


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("splits", [1, None])
def test_exact_tie_on_fp32_logits_picks_lower_id(splits):
    """Identical W rows give bit-identical logits (same products, same order): the lower id wins, in the fused
    epilogue and after the split-K sum; E = 12 so the padded experts 12..15 must never be chosen either."""
    x, w, _ = _inputs(5, 12, torch.bfloat16, seed=3)
    w[4] = w[9] = 0.2 * x[0].float().sign()  # experts 4 and 9: the same (large) row
    ids, _ = moe_router_triton(x, w, None, 12, 1.0, splits=splits)
    assert (ids[0, :2] == torch.tensor([4, 9], dtype=torch.int32)).all()
    assert torch.equal(ids.sort(dim=1).values, torch.arange(12, dtype=torch.int32).expand(5, 12))
    assert torch.equal(ids, moe_router_ref(x, w, None, 12, 1.0)[0])


def test_moe_layer_routes_bf16_x_without_an_fp32_copy():
    """FusedMoE.route (what the M3 MoE layers call) on bf16 x with the Triton MoE backend makes no float32 [T, H]
    tensor, and its router weight is stored float32 (so no cast of W either); with the torch backend, whose
    reference casts x.float(), the same probe sees the copy. Both route alike."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ladle.layers.attention.metadata import ForwardContext, OpBackends, set_forward_context
    from ladle.layers.moe import FusedMoE

    class FloatCopies(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.seen = shape, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == self.shape:
                    self.seen.append(str(func))
            return out

    x, w, bias = _inputs(17, 8, torch.bfloat16, seed=11)
    moe = FusedMoE(H_TEST, 8, 2, 32, shared_intermediate_size=32, routed_scaling_factor=2.0, dtype=torch.bfloat16)
    assert moe.gate_weight.dtype == torch.float32 and moe.e_score_correction_bias.dtype == torch.float32
    moe.gate_weight.data.copy_(w)
    moe.e_score_correction_bias.data.copy_(bias)
    routes = []
    for backends, expect_copy in ((OpBackends.kernels(), False), (OpBackends.reference(), True)):
        with set_forward_context(ForwardContext(None, [], backends)), FloatCopies(tuple(x.shape)) as probe:
            routes.append(moe.route(x, with_shared=True))
        assert bool(probe.seen) == expect_copy, (backends, probe.seen)
    assert torch.equal(routes[0][0], routes[1][0])


def test_fp16_x_read_through_a_row_stride():
    """fp16 x, given as a column slice of a wider tensor (row stride 2H): read in place, same bound and checks."""
    x, w, bias = _inputs(17, 12, torch.float16, seed=21)
    wide = torch.cat([x, torch.randn_like(x.float()).half()], dim=1)
    view = wide[:, :H_TEST]
    assert view.stride(0) == 2 * H_TEST
    for splits in (1, None):
        logits = moe_router_logits_triton(view, w, splits=splits)
        l64 = x.double() @ w.double().T
        assert ((logits.double() - l64).abs() <= LOGIT_TOL * (x.double().abs() @ w.double().abs().T)).all()
        ids, wts = moe_router_triton(view, w, bias, 3, 2.0, shared_expert=True, splits=splits)
        assert _check_against_float64(x, w, bias, 3, True, ids, wts) >= 17 // 2


@pytest.mark.parametrize("T", [3, 64])
def test_bf16x3w_precision_vs_float64(T):
    """The A/B candidate "bf16x3w" (bf16 x times W split into three bf16 parts): same bound, same ids/weights checks,
    fused and split. Under the interpreter the products are fp32, so this checks the split (w1 + w2 + w3 = W)."""
    x, w, bias = _inputs(T, 12, torch.bfloat16, seed=T + 5)
    for splits in (1, None):
        logits = moe_router_logits_triton(x, w, splits=splits, precision="bf16x3w")
        l64 = x.double() @ w.double().T
        assert ((logits.double() - l64).abs() <= LOGIT_TOL * (x.double().abs() @ w.double().abs().T)).all()
        ids, wts = moe_router_triton(x, w, bias, 4, 2.0, shared_expert=True, splits=splits, precision="bf16x3w")
        assert _check_against_float64(x, w, bias, 4, True, ids, wts) >= T // 2


def test_precision_refusals():
    x, w, bias = _inputs(3, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="bf16x3w"):
        moe_router_triton(x, w, bias, 2, precision="bf16x3w")
    with pytest.raises(ValueError, match="ladle offers"):
        moe_router_triton(x.bfloat16(), w, bias, 2, precision="fp64")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 128, 2048])
@pytest.mark.parametrize("precision", ["tf32x3", "bf16x3w"])
def test_gpu_m3_shape_accuracy_and_graph(T, precision):
    """One TP4 rank of M3 (H 6144, E 128, top-4 + shared): the logit bound, ids/weights vs float64, and a CUDA-graph
    replay on new x data equal to the eager call (same launch, so bit for bit)."""
    g = torch.Generator(device="cuda").manual_seed(T)
    H, E, k = 6144, 128, 4
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    w = torch.randn(E, H, generator=g, device="cuda") / H ** 0.5
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    cfg = router_launch(T, H, E, x.device, None, precision)
    logits = moe_router_logits_triton(x, w, splits=cfg.splits, precision=precision)
    l64 = x.double() @ w.double().T
    assert ((logits.double() - l64).abs() <= LOGIT_TOL * (x.double().abs() @ w.double().abs().T)).all()
    ids, wts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True, precision=precision)
    assert _check_against_float64(x.cpu(), w.cpu(), bias.cpu(), k, True, ids.cpu(), wts.cpu()) >= 0.9 * T
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gids, gwts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True, precision=precision)
    x.copy_(torch.randn(T, H, generator=g, device="cuda").bfloat16())
    graph.replay()
    eids, ewts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True, precision=precision)
    assert torch.equal(gids, eids) and torch.equal(gwts, ewts)
