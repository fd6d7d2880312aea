"""MoE router (ladle/kernels/moe_router.py) vs its reference and vs hand-computed float64 values."""

from __future__ import annotations

import math

import pytest
import torch

from ladle.kernels.moe_router import (ROUTER_KERNEL_MIN_TOKENS, moe_router, moe_router_kernel,
                                     moe_router_logits_triton, moe_router_ref, moe_router_triton, router_launch,
                                     router_logits, router_path)
from ladle.observe import dispatch


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


@pytest.mark.parametrize("fn", [moe_router_triton, moe_router_kernel])  # the op at T = 1 (torch logits), the kernel
def test_hand_computed_token(fn):
    """One token, float64 by hand: choice by sigmoid+bias, weights from the unbiased sigmoid."""
    x = torch.tensor([[1.0, -2.0]])
    w = torch.tensor([[0.5, 0.0], [0.0, 0.5], [1.0, 1.0], [-1.0, 0.0]])  # logits 0.5, -1, -1, -1
    bias = torch.tensor([0.0, 0.9, 0.0, 0.2])
    ids, wts = fn(x, w, bias, 2, 2.5)
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
        ids, wts = moe_router_kernel(x, w, bias, k, 2.0, shared_expert=shared, splits=splits)
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
    ids, _ = moe_router_kernel(x, w, None, 12, 1.0, splits=splits)
    assert (ids[0, :2] == torch.tensor([4, 9], dtype=torch.int32)).all()
    assert torch.equal(ids.sort(dim=1).values, torch.arange(12, dtype=torch.int32).expand(5, 12))
    assert torch.equal(ids, moe_router_ref(x, w, None, 12, 1.0)[0])


@pytest.mark.parametrize("T", [17, ROUTER_KERNEL_MIN_TOKENS])
def test_moe_layer_routes_bf16_x_without_an_fp32_copy(T):
    """FusedMoE.route (what the M3 MoE layers call) on bf16 x with the Triton MoE backend makes no float32 [T, H]
    tensor on the "triton logits" path (T >= ROUTER_KERNEL_MIN_TOKENS), and its router weight is stored float32 (so
    no cast of W either); on the "torch logits" path (fewer tokens, where the copy is cheaper than the kernel) and
    with the torch backend, whose reference casts x.float(), the same probe sees the copy. All route alike."""
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

    x, w, bias = _inputs(T, 8, torch.bfloat16, seed=11)
    moe = FusedMoE(H_TEST, 8, 2, 32, shared_intermediate_size=32, routed_scaling_factor=2.0, dtype=torch.bfloat16)
    assert moe.gate_weight.dtype == torch.float32 and moe.e_score_correction_bias.dtype == torch.float32
    moe.gate_weight.data.copy_(w)
    moe.e_score_correction_bias.data.copy_(bias)
    routes = []
    for backends, expect_copy in ((OpBackends.kernels(), router_path(T) == "torch logits"),
                                  (OpBackends.reference(), True)):
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
        ids, wts = moe_router_kernel(view, w, bias, 3, 2.0, shared_expert=True, splits=splits)
        assert _check_against_float64(x, w, bias, 3, True, ids, wts) >= 17 // 2


@pytest.mark.parametrize("T, path", [(3, "torch logits"), (ROUTER_KERNEL_MIN_TOKENS - 1, "torch logits"),
                                     (ROUTER_KERNEL_MIN_TOKENS, "triton logits")])
def test_path_by_token_count(monkeypatch, T, path):
    """Below ROUTER_KERNEL_MIN_TOKENS the op computes the logits with torch and routes them with the epilogue kernel;
    from there on the Triton logits kernel runs. The dispatch bucket names the path; both keep the bound checks."""
    import ladle.kernels.moe_router as mod
    calls = []
    for name in ("router_logits", "moe_router_kernel"):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _f=fn, **kw: calls.append(_n) or _f(*a, **kw))
    x, w, bias = _inputs(T, 8, torch.bfloat16, seed=T + 31)
    dispatch.reset()
    ids, wts = moe_router(x, w, bias, 3, 2.0, shared_expert=True)
    assert router_path(T) == path
    assert calls == [{"torch logits": "router_logits", "triton logits": "moe_router_kernel"}[path]]
    assert list(dispatch.snapshot()["ops"]["moe_router"]["buckets"]) == [f"{dispatch.tokens_bucket(T)} {path}"]
    assert _check_against_float64(x, w, bias, 3, True, ids, wts) >= T // 2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 128, 2048])
def test_gpu_m3_shape_accuracy_and_graph(T):
    """One TP4 rank of M3 (H 6144, E 128, top-4 + shared) on the path the op takes at T (`router_path`: torch logits
    at 1 and 32 tokens, the Triton kernel, split K at 128 and fused at 2048): the logit bound, ids/weights vs float64,
    and a CUDA-graph replay on new x data equal to the eager call (same launches, so bit for bit)."""
    g = torch.Generator(device="cuda").manual_seed(T)
    H, E, k = 6144, 128, 4
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    w = torch.randn(E, H, generator=g, device="cuda") / H ** 0.5
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    if router_path(T) == "triton logits":
        logits = moe_router_logits_triton(x, w, splits=router_launch(T, H, E, x.device).splits)
    else:
        logits = router_logits(x, w)
    l64 = x.double() @ w.double().T
    assert ((logits.double() - l64).abs() <= LOGIT_TOL * (x.double().abs() @ w.double().abs().T)).all()
    ids, wts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True)
    # As on the CPU, half the tokens must have a clear margin: at H = 6144 with N(0,1) logits the conservative bound
    # (1e-5 x sum_k |x_k W_ek|, ~5e-4) makes many top-4 margins fall below twice it (the H200 compared 25/32,
    # 115/128, 1774/2048 tokens), while the ids of every compared token must still equal the reference's.
    assert _check_against_float64(x.cpu(), w.cpu(), bias.cpu(), k, True, ids.cpu(), wts.cpu()) >= T // 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gids, gwts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True)
    x.copy_(torch.randn(T, H, generator=g, device="cuda").bfloat16())
    graph.replay()
    eids, ewts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True)
    assert torch.equal(gids, eids) and torch.equal(gwts, ewts)
