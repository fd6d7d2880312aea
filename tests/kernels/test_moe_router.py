"""MoE router (ladle/kernels/moe_router.py) vs its reference and vs hand-computed float64 values."""

from __future__ import annotations

import math

import pytest
import torch

from ladle.kernels._common import tl, triton
from ladle.kernels.moe_router import (PRECISIONS, ROUTER_KERNEL_MIN_TOKENS, _tf32_split, moe_router,
                                     moe_router_kernel, moe_router_logits_triton, moe_router_ref, moe_router_triton,
                                     router_launch, router_logits, router_path, router_precision)
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


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("E, with_bias, shared", [(8, True, True), (8, False, False), (12, True, False),
                                                  (12, False, True)])
def test_kernel_logits_ids_weights_vs_float64(dtype, T, E, with_bias, shared, precision):
    """Every precision (the interpreter's dots are "ieee"; "tf32x2w" still splits W into two dots) against float64."""
    x, w, bias = _inputs(T, E, dtype, seed=T * 100 + E + 7 * with_bias + 3 * shared)
    bias = bias if with_bias else None
    k = 3
    compared = 0
    for splits in (1, None):  # fused epilogue, then the launch rule (split K + epilogue kernel)
        cfg = router_launch(T, H_TEST, E, x.device, splits)
        assert (cfg.splits == 1) == (splits == 1), cfg
        logits = moe_router_logits_triton(x, w, splits=splits, precision=precision)
        l64 = x.double() @ w.double().T
        assert ((logits.double() - l64).abs() <= LOGIT_TOL * (x.double().abs() @ w.double().abs().T)).all()
        assert rel_err(logits, l64) < LOGIT_TOL
        ids, wts = moe_router_kernel(x, w, bias, k, 2.0, shared_expert=shared, splits=splits, precision=precision)
        assert ids.shape == wts.shape == (T, k + int(shared))
        compared += _check_against_float64(x, w, bias, k, shared, ids, wts)
    assert compared >= T, "most tokens must have a clear top-k margin (else the id check says nothing)"


def rel_err(out, ref):
    """Relative Frobenius error against a reference that is not all zeros."""
    assert ref.double().norm() > 0
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@triton.jit
def _tf32_split_probe(w_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    w_hi, w_lo = _tf32_split(tl.load(w_ptr + o))
    tl.store(hi_ptr + o, w_hi)
    tl.store(lo_ptr + o, w_lo)


def test_tf32_split_is_exact():
    """`_tf32_split` on fresh random fp32 values over 2^-60..2^60 (plus zeros, TF32 values and subnormals): w_hi has
    its 13 low mantissa bits zero (a TF32 value), w_hi + w_lo == w exactly (checked in float64), w_hi is w truncated
    toward zero (same sign, |w_hi| <= |w|, |w_lo| < 2^-10 |w| for normal w), and w_lo = 0 where w is TF32."""
    n = 4096
    seed = torch.seed() % 2**31  # fresh data each run; the seed is in the failure message
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 61, (n,), generator=g).float())
    w[:4] = torch.tensor([0.0, -0.0, 1.0, -3.0])  # zeros and TF32 values
    w[4:8] = torch.tensor([1e-40, -3e-39, 2**-126, -(2**-126) * 1.5])  # subnormals, smallest normals
    w[8:16] = (w[8:16].view(torch.int32) & ~0x1FFF).view(torch.float32)  # more exact TF32 values
    hi, lo = torch.empty_like(w), torch.empty_like(w)
    _tf32_split_probe[(1,)](w, hi, lo, N=n)
    assert ((hi.view(torch.int32) & 0x1FFF) == 0).all(), seed
    assert torch.equal(hi.double() + lo.double(), w.double()), seed
    assert torch.equal(hi + lo, w), seed
    assert ((hi == 0) | (torch.sign(hi) == torch.sign(w))).all() and (hi.abs() <= w.abs()).all(), seed
    normal = w.abs() >= 2**-126
    assert (lo[normal].abs() < 2**-10 * w[normal].abs()).all(), seed
    assert (lo[:4] == 0).all() and (lo[8:16] == 0).all(), seed
    assert (lo != 0).float().mean() > 0.9, "random fp32 values have non-zero low bits"


def test_tf32x2w_splits_bf16_x_only():
    """"tf32x2w" needs x exact in TF32: a bf16 x runs the W split (its two accumulators sum in another order than
    the one-dot kernel, so the interpreter's logits differ in some last bits), a float32 x runs "tf32x3" (bit for bit
    the same launch). Unknown precisions are refused by name."""
    x, w, _ = _inputs(17, 12, torch.bfloat16, seed=5)
    assert not torch.equal(moe_router_logits_triton(x, w, precision="tf32x2w"),
                           moe_router_logits_triton(x, w, precision="tf32x3"))
    xf = x.float() + 1e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    assert router_precision(17, torch.float32, "tf32x2w") == "tf32x3"
    assert router_path(17, torch.float32, "tf32x2w") == "triton logits tf32x3"
    assert router_path(17, torch.float16, "tf32x2w") == "triton logits tf32x2w"
    assert torch.equal(moe_router_logits_triton(xf, w, precision="tf32x2w"),
                       moe_router_logits_triton(xf, w, precision="tf32x3"))
    with pytest.raises(ValueError, match="tf32x2w"):
        moe_router_kernel(x, w, None, 3, precision="bf16x3")
    with pytest.raises(ValueError, match="ieee"):
        moe_router_triton(x, w, None, 3, precision="tf32")


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
    for backends, expect_copy in ((OpBackends.kernels(), router_path(T, x.dtype) == "torch logits"),
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


@pytest.mark.parametrize("T, small, large, dtype, path", [
    (3, None, "tf32x3", torch.bfloat16, "torch logits"),  # today's rule
    (ROUTER_KERNEL_MIN_TOKENS - 1, None, "tf32x3", torch.bfloat16, "torch logits"),
    (ROUTER_KERNEL_MIN_TOKENS, None, "tf32x3", torch.bfloat16, "triton logits tf32x3"),
    (3, "ieee", "tf32x3", torch.bfloat16, "triton small-t ieee"),  # the switches flipped: one launch up to 64
    (65, "tf32x2w", "tf32x3", torch.bfloat16, "triton logits tf32x2w"),  # split K + epilogue above 64
    (ROUTER_KERNEL_MIN_TOKENS - 1, "ieee", "tf32x2w", torch.bfloat16, "triton logits ieee"),
    (ROUTER_KERNEL_MIN_TOKENS, "ieee", "tf32x2w", torch.bfloat16, "triton logits tf32x2w"),
    (ROUTER_KERNEL_MIN_TOKENS, None, "tf32x2w", torch.float32, "triton logits tf32x3"),  # fp32 x: no W-only split
])
def test_path_by_token_count(monkeypatch, T, small, large, dtype, path):
    """Below ROUTER_KERNEL_MIN_TOKENS the op runs ROUTER_SMALL_T_PRECISION (None: logits by torch, routed by the
    epilogue kernel), from there on the Triton logits kernel at ROUTER_LARGE_T_PRECISION. The dispatch bucket names
    the path and precision that ran; every path keeps the bound checks."""
    import ladle.kernels.moe_router as mod
    monkeypatch.setattr(mod, "ROUTER_SMALL_T_PRECISION", small)
    monkeypatch.setattr(mod, "ROUTER_LARGE_T_PRECISION", large)
    calls = []
    for name in ("router_logits", "moe_router_kernel", "moe_router_small_t"):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _f=fn, **kw: calls.append((_n, kw.get("precision")))
                            or _f(*a, **kw))
    x, w, bias = _inputs(T, 8, dtype, seed=T + 31)
    dispatch.reset()
    ids, wts = moe_router(x, w, bias, 3, 2.0, shared_expert=True)
    assert router_path(T, dtype) == path
    kernel = "moe_router_small_t" if path.startswith("triton small-t") else "moe_router_kernel"
    assert calls == [("router_logits", None) if path == "torch logits" else (kernel, path.split()[-1])]
    assert list(dispatch.snapshot()["ops"]["moe_router"]["buckets"]) == [f"{dispatch.tokens_bucket(T)} {path}"]
    assert _check_against_float64(x, w, bias, 3, True, ids, wts) >= T // 2


def test_precision_argument_forces_the_kernel():
    """`moe_router_triton(precision=...)` runs the kernel at that precision at any T, equal to `moe_router_kernel`'s
    call; precision None keeps the op's rule (the small-T kernel at ROUTER_SMALL_T_PRECISION at 3 tokens)."""
    x, w, bias = _inputs(3, 12, torch.bfloat16, seed=41)
    for precision in PRECISIONS:
        got = moe_router_triton(x, w, bias, 3, 2.0, shared_expert=True, precision=precision)
        want = moe_router_kernel(x, w, bias, 3, 2.0, shared_expert=True, precision=precision)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert _check_against_float64(x, w, bias, 3, True, *got) >= 1
    assert router_precision(3, torch.bfloat16) == "tf32x2w"
    assert router_path(3, torch.bfloat16) == "triton small-t tf32x2w"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [None, "tf32x2w", "ieee"])
@pytest.mark.parametrize("T", [1, 32, 128, 2048])
def test_gpu_m3_shape_accuracy_and_graph(T, precision):
    """One TP4 rank of M3 (H 6144, E 128, top-4 + shared) on the path the op takes at T (precision None,
    `router_path`: the small-T kernel at 1 and 32 tokens (its logits checked on the split-K kernel at the same
    precision), the Triton kernel, split K at 128 and fused at 2048) or on the
    kernel at `precision`: the logit bound, ids/weights vs float64, and a CUDA-graph replay on new x data equal to
    the eager call (same launches, so bit for bit)."""
    g = torch.Generator(device="cuda").manual_seed(T)
    H, E, k = 6144, 128, 4
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    w = torch.randn(E, H, generator=g, device="cuda") / H ** 0.5
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    resolved = router_precision(T, x.dtype, precision)
    if resolved is not None:
        logits = moe_router_logits_triton(x, w, splits=router_launch(T, H, E, x.device).splits, precision=resolved)
    else:
        logits = router_logits(x, w)
    l64 = x.double() @ w.double().T
    assert ((logits.double() - l64).abs() <= LOGIT_TOL * (x.double().abs() @ w.double().abs().T)).all()
    ids, wts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True, precision=precision)
    # As on the CPU, half the tokens must have a clear margin: at H = 6144 with N(0,1) logits the conservative bound
    # (1e-5 x sum_k |x_k W_ek|, ~5e-4) makes many top-4 margins fall below twice it (the H200 compared 25/32,
    # 115/128, 1774/2048 tokens), while the ids of every compared token must still equal the reference's.
    assert _check_against_float64(x.cpu(), w.cpu(), bias.cpu(), k, True, ids.cpu(), wts.cpu()) >= T // 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gids, gwts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True, precision=precision)
    x.copy_(torch.randn(T, H, generator=g, device="cuda").bfloat16())
    graph.replay()
    eids, ewts = moe_router_triton(x, w, bias, k, 2.0, shared_expert=True, precision=precision)
    assert torch.equal(gids, eids) and torch.equal(gwts, ewts)


@pytest.mark.parametrize("H", [1064, 1536])
def test_tf32x2w_promotion_chunks_long_k(H):
    """"tf32x2w" accumulates in chains of TF32X2W_PROMOTE_K and adds each chain in fp32: at K = 1064 (three chains,
    the last one masked: 1064 is no multiple of BLOCK_K) and 1536 (three full chains) the logits of the fused and the
    split-K launches stay within the contract against float64, and the ids and weights match float64's."""
    from ladle.kernels.moe_router import TF32X2W_PROMOTE_K
    assert H > 2 * TF32X2W_PROMOTE_K
    g = torch.Generator().manual_seed(H)
    x = torch.randn(9, H, generator=g).bfloat16()
    w = torch.randn(12, H, generator=g) / H ** 0.5
    l64 = x.double() @ w.double().T
    for splits in (1, 2):
        logits = moe_router_logits_triton(x, w, splits=splits, precision="tf32x2w")
        assert ((logits.double() - l64).abs() <= LOGIT_TOL * (x.double().abs() @ w.double().abs().T)).all()
        assert rel_err(logits, l64) < 1e-6
        ids, wts = moe_router_kernel(x, w, None, 3, 2.0, splits=splits, precision="tf32x2w")
        assert _check_against_float64(x, w, None, 3, False, ids, wts) >= 5


@pytest.mark.parametrize("S, T, E", [(37, 5, 12), (37, 300, 12), (100, 32, 128), (1, 9, 12)])
def test_split_epilogue_sums_every_split(S, T, E):
    """`route_from_logits` on random fp32 partials [S, T, E]: the epilogue's blocked sum (up to 16 splits per load,
    S not a multiple of it; 4 and 16 token rows per program) gives the float64 sum's logits within fp32 rounding,
    hence its top-k ids (where the margin is clear) and weights. Dropping or repeating one split block moves a logit
    by ~1, far outside the bound."""
    from ladle.kernels.moe_router import epilogue_tiles, route_from_logits

    g = torch.Generator().manual_seed(S * 1000 + T)
    parts = torch.randn(S, T, E, generator=g) * (2.0 / S ** 0.5)
    bias = torch.randn(E, generator=g) * 0.1
    k = 4
    ids, wts = route_from_logits(parts, bias, k, 2.0, shared_expert=True)
    l64 = parts.double().sum(0)
    sig = torch.sigmoid(l64)
    choice = sig + bias.double()
    top = torch.sort(choice, dim=1, descending=True, stable=True)
    margin = top.values[:, k - 1] - top.values[:, k]
    clear = margin > 1e-5  # the sum's rounding moves a choice by < 1e-6 here
    assert clear.sum() >= T // 2
    assert torch.equal(ids[clear, :k].long().sort(1).values, top.indices[clear, :k].sort(1).values)
    w64 = sig.gather(1, ids[:, :k].long())
    w64 = w64 / w64.sum(1, keepdim=True) * 2.0
    assert ((wts[:, :k].double() - w64).abs() <= 1e-5 * w64).all()
    assert (ids[:, k] == E).all() and (wts[:, k] == 1.0).all()
    bt, sb = epilogue_tiles(T, S, max(16, triton.next_power_of_2(E)))
    assert S == 1 or (sb > 1 and S % sb != 0), (bt, sb)  # the blocked loop and its masked tail are exercised


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("T, E, H, with_bias, shared", [(1, 12, 256, True, True), (5, 40, 1100, False, True),
                                                        (33, 128, 512, True, False), (64, 20, 1536, True, True)])
def test_small_t_kernel_vs_float64(T, E, H, with_bias, shared, precision):
    """The one-launch small-T kernel (expert blocks of 16 x K splits of 512, ragged E and last split, the two-level
    arrival counters) against float64: ids where the margin is clear, weights; the counters are zero again after
    every call (the reset invariant CUDA-graph replays rely on)."""
    from ladle.kernels.moe_router import COUNTER_KEY, moe_router_small_t
    from ladle.kernels.split_counters import split_counters

    g = torch.Generator().manual_seed(T * 7 + E + H)
    x = torch.randn(T, H, generator=g).bfloat16()
    w = torch.randn(E, H, generator=g) * (0.8 / H ** 0.5)
    bias = torch.randn(E, generator=g) * 0.2 if with_bias else None
    for _ in range(2):  # the second call starts from the counters the first left
        ids, wts = moe_router_small_t(x, w, bias, 4, 2.0, shared_expert=shared, precision=precision)
        assert ids.shape == wts.shape == (T, 4 + int(shared))
        assert _check_against_float64(x, w, bias, 4, shared, ids, wts) >= max(1, T // 2)
        assert not split_counters(COUNTER_KEY, x.device, 1).any()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32x2w", "ieee"])
@pytest.mark.parametrize("T", [1, 32, 64])
def test_gpu_small_t_kernel_m3_shape_and_graph(T, precision):
    """The one-launch small-T kernel at one TP4 rank of M3 (H 6144, E 128, top-4 + shared): ids/weights vs float64,
    replayed in a CUDA graph on new x data equal to the eager call, counters zero after both."""
    from ladle.kernels.moe_router import COUNTER_KEY, moe_router_small_t
    from ladle.kernels.split_counters import split_counters

    g = torch.Generator(device="cuda").manual_seed(T + 5)
    H, E, k = 6144, 128, 4
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    w = torch.randn(E, H, generator=g, device="cuda") / H ** 0.5
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    ids, wts = moe_router_small_t(x, w, bias, k, 2.0, shared_expert=True, precision=precision)
    assert _check_against_float64(x.cpu(), w.cpu(), bias.cpu(), k, True, ids.cpu(), wts.cpu()) >= T // 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gids, gwts = moe_router_small_t(x, w, bias, k, 2.0, shared_expert=True, precision=precision)
    x.copy_(torch.randn(T, H, generator=g, device="cuda").bfloat16())
    graph.replay()
    eids, ewts = moe_router_small_t(x, w, bias, k, 2.0, shared_expert=True, precision=precision)
    assert torch.equal(gids, eids) and torch.equal(gwts, ewts)
    torch.cuda.synchronize()
    assert not split_counters(COUNTER_KEY, x.device, 1).any()
