"""The MoE combine over the k slots (ladle/kernels/fused_moe.py `moe_combine`): Triton kernel vs a float64 sum, vs
the sequential fp32 order it promises, and vs today's torch expression (`moe_combine_ref`), for float32 and 16-bit
slot rows; the dispatcher; the fused MoE launchers run it, and their slot_dtype option (16-bit slot rows) against
the float32 rows and the float64 references."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels._common import cpu_interpreter
from ladle.kernels.fp8_quant import quantize_fp8_rows, quantize_mxfp4
from ladle.kernels import fused_moe as moe16, fused_moe_fp8 as moe8, fused_moe_mxfp4 as mx4
from ladle.kernels import fused_moe_mxfp4_decode as mx4_decode
from ladle.kernels.fused_moe import (fused_moe_ref, fused_moe_triton, moe_combine, moe_combine_ref, moe_combine_triton,
                                     slot_dtype_for)
from ladle.kernels.fused_moe_fp8 import fused_moe_fp8_ref, fused_moe_fp8_triton
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_ref, fused_moe_mxfp4_triton
from ladle.observe import dispatch

# unit roundoff of round-to-nearest (p = 24, 8, 11 significant bits)
U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _slots(T, k, H, seed=0, device="cpu"):
    """Random slot rows [T*k, H] fp32 with magnitudes over ~4 decades (so the summation order matters)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(T * k, H, generator=g) * torch.exp(torch.randn(T * k, 1, generator=g) * 2)
    return s.to(device)


def _sequential(slots, T, k, out_dtype):
    """The kernel's promised order in torch: ((s0 + s1) + s2) + ... in fp32, one rounding to out_dtype."""
    v = slots.view(T, k, -1)
    acc = v[:, 0].clone()
    for i in range(1, k):
        acc = acc + v[:, i]
    return acc.to(out_dtype)


# (T, k, H, block_t, block_h): T not a multiple of BT, H not a multiple of BH (several H blocks), k = 1 .. 9; None =
# combine_tile's default
SHAPES = [(7, 5, 80, 4, 32), (7, 1, 80, 4, 32), (5, 9, 48, 2, 64), (3, 5, 50, None, None), (9, 2, 1030, None, None),
          (259, 3, 520, None, None)]  # the last: the prefill tile (combine_tile above 256 tokens), odd T and H


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,H,bt,bh", SHAPES)
def test_combine_kernel_against_float64_and_its_order(T, k, H, bt, bh, out_dtype):
    """Elementwise bound against the float64 sum: |out - ref| <= (k-1) u32 S (1 + u) + u_out (|ref| + (k-1) u32 S),
    S = sum_i |s_i| (fp32 summation error, then one rounding to out_dtype); and bitwise the sequential fp32 loop."""
    slots = _slots(T, k, H, seed=T * k + H)
    out = moe_combine_triton(slots, T, k, out_dtype, block_t=bt, block_h=bh)
    assert out.shape == (T, H) and out.dtype == out_dtype
    ref = slots.double().view(T, k, H).sum(1)
    s_abs = slots.double().abs().view(T, k, H).sum(1)
    fp32_err = (k - 1) * U[torch.float32] * s_abs * (1 + 1e-6)
    bound = fp32_err + U[out_dtype] * (ref.abs() + fp32_err)
    assert ((out.double() - ref).abs() <= bound).all()
    assert torch.equal(out, _sequential(slots, T, k, out_dtype))
    assert torch.equal(moe_combine_triton(slots, T, k, out_dtype, block_t=bt, block_h=bh), out)  # deterministic


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_combine_against_todays_torch_expression(k, out_dtype):
    """k <= 2: same values as `moe_combine_ref` (one add commutes; the same RNE cast); k = 5: within the
    summation-order bound of the docstring, 2 (k-1) u32 S, plus one out_dtype ulp where the two roundings differ."""
    T, H = 6, 72
    slots = _slots(T, k, H, seed=k)
    out = moe_combine_triton(slots, T, k, out_dtype, block_t=4, block_h=32)
    ref = moe_combine_ref(slots, T, k, out_dtype)
    if k <= 2:
        assert torch.equal(out, ref)
    else:
        s_abs = slots.double().abs().view(T, k, H).sum(1)
        bound = 2 * (k - 1) * U[torch.float32] * s_abs + 2 * U[out_dtype] * ref.double().abs()
        assert ((out.double() - ref.double()).abs() <= bound).all()


def test_combine_hand_values_ties_nan_inf():
    """bf16 ties round to even (1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6), overflow past bf16's max goes to inf, and
    NaN / inf propagate as in torch (inf + -inf = NaN; nan is CUDA's canonical NaN 0x7FFFFFFF, whose mantissa a bare
    round-up bit trick would carry into the sign)."""
    inf, nan = float("inf"), torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32).item()
    slots = torch.tensor([[1 + 2 ** -8, -(1 + 3 * 2 ** -8), 3.4e38, nan, inf, inf],
                          [0.0, 0.0, 3.4e38, 1.0, 1.0, -inf]])  # T = 1 token, k = 2 slots, H = 6
    for dt in (torch.bfloat16, torch.float32):
        out = moe_combine_triton(slots, 1, 2, dt)
        ref = moe_combine_ref(slots, 1, 2, dt)
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
    out = moe_combine_triton(slots, 1, 2, torch.bfloat16)[0]
    assert out[[0, 1, 2, 4]].tolist() == [1.0, -(1 + 2 ** -6), inf, inf] and out[[3, 5]].isnan().all()


@pytest.mark.parametrize("slot_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,H,bt,bh", SHAPES[:3] + SHAPES[-1:])
def test_combine_16bit_slots(T, k, H, bt, bh, out_dtype, slot_dtype):
    """16-bit slot rows r_i = round(s_i) (GEMM 2's store): bitwise the sequential fp32 sum of the upcast rows, one
    rounding; against the float64 sum of the exact s_i the docstring bound: pre = (u_s + (k-1) u32 (1 + u_s)) S
    (+ k 2^-25 for fp16's subnormals), then the rounding to out_dtype: pre + u_out (|ref| + pre). k <= 2: equal to
    `moe_combine_ref`, which upcasts first too."""
    exact = _slots(T, k, H, seed=T * k + H + 1).clamp(-6e4, 6e4)  # inside fp16's range
    slots = exact.to(slot_dtype)
    out = moe_combine_triton(slots, T, k, out_dtype, block_t=bt, block_h=bh)
    assert out.dtype == out_dtype and torch.equal(out, _sequential(slots.float(), T, k, out_dtype))
    ref = exact.double().view(T, k, H).sum(1)
    s_abs = exact.double().abs().view(T, k, H).sum(1)
    u_s = U[slot_dtype]
    pre = (u_s + (k - 1) * U[torch.float32] * (1 + u_s)) * s_abs * (1 + 1e-6)
    pre += k * 2.0 ** -25 if slot_dtype == torch.float16 else 0.0
    assert ((out.double() - ref).abs() <= pre + U[out_dtype] * (ref.abs() + pre)).all()
    if k <= 2:
        assert torch.equal(out, moe_combine_ref(slots, T, k, out_dtype))


def test_combine_zero_tokens_and_rejects_other_slot_dtypes():
    assert moe_combine_triton(torch.empty(0, 16), 0, 3, torch.bfloat16).shape == (0, 16)
    assert moe_combine_triton(torch.empty(0, 16, dtype=torch.bfloat16), 0, 3, torch.bfloat16).shape == (0, 16)
    with pytest.raises(AssertionError):
        moe_combine_triton(torch.zeros(6, 16, dtype=torch.float64), 2, 3, torch.bfloat16)


def test_combine_dispatch_records_and_falls_back():
    T, k, H = 5, 3, 40
    slots = _slots(T, k, H)
    dispatch.reset()
    out = moe_combine(slots, T, k, torch.bfloat16, use_triton=True)
    assert torch.equal(out, _sequential(slots, T, k, torch.bfloat16))
    with cpu_interpreter(False):
        fallback = moe_combine(slots, T, k, torch.bfloat16, use_triton=True)
    assert torch.equal(fallback, moe_combine_ref(slots, T, k, torch.bfloat16))
    snap = dispatch.snapshot()["ops"]["moe_combine"]
    assert sum(b["executed"] for b in snap["buckets"].values()) == 1
    assert sum(b["calls"] for b in snap["buckets"].values()) == 2 and len(snap["fallback_reasons"]) == 1
    dispatch.reset()


def _launch(fmt, x, w13, w2, ids, wts):
    """One fused MoE launcher: "bf16" (fused_moe.py), "fp8" (fused_moe_fp8.py), "mxfp4" (fused_moe_mxfp4.py)."""
    if fmt == "bf16":
        return fused_moe_triton(x, w13, w2, ids, wts)
    quantize = quantize_fp8_rows if fmt == "fp8" else lambda w: [torch.stack(t) for t in zip(*map(quantize_mxfp4, w))]
    launcher = fused_moe_fp8_triton if fmt == "fp8" else fused_moe_mxfp4_triton
    return launcher(x, *quantize(w13), *quantize(w2), ids, wts)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_fused_moe_launchers_combine_through_the_op(fmt):
    """Each launcher's combine is one op "moe_combine" launch (T tokens bucket), whatever its weight format."""
    torch.manual_seed(0)
    T, E, H, I, k = 5, 4, 64, 32, 3
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H) * 0.2, torch.randn(E, H, I) * 0.2
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    dispatch.reset()
    out = _launch(fmt, x, w13, w2, ids, torch.rand(T, k))
    assert out.shape == (T, H) and out.dtype == x.dtype
    assert sum(b["executed"] for b in dispatch.snapshot()["ops"]["moe_combine"]["buckets"].values()) == 1
    dispatch.reset()


def _mx4_tables(w):
    return [torch.stack(t) for t in zip(*map(quantize_mxfp4, w))]


# family -> (launcher(x, tables, ids, wts, **kw), float64 reference(x, tables, ids, wts), tables from float weights)
FAMILIES = {
    "bf16": (lambda x, t, ids, wts, **kw: fused_moe_triton(x, *t, ids, wts, **kw),
             lambda x, t, ids, wts: fused_moe_ref(x, *t, ids, wts), lambda w13, w2: [w13.bfloat16(), w2.bfloat16()]),
    "fp8": (lambda x, t, ids, wts, **kw: fused_moe_fp8_triton(x, *t, ids, wts, **kw),
            lambda x, t, ids, wts: fused_moe_fp8_ref(x, *t, ids, wts),
            lambda w13, w2: [*quantize_fp8_rows(w13), *quantize_fp8_rows(w2)]),
    "mxfp4": (lambda x, t, ids, wts, **kw: fused_moe_mxfp4_triton(x, *t, ids, wts, path="wide", **kw),
              lambda x, t, ids, wts: fused_moe_mxfp4_ref(x, *t, ids, wts),
              lambda w13, w2: _mx4_tables(w13) + _mx4_tables(w2)),
    "mxfp4_decode": (lambda x, t, ids, wts, **kw: fused_moe_mxfp4_triton(x, *t, ids, wts, path="decode", **kw),
                     lambda x, t, ids, wts: fused_moe_mxfp4_ref(x, *t, ids, wts),
                     lambda w13, w2: _mx4_tables(w13) + _mx4_tables(w2)),
    "w4a8": (lambda x, t, ids, wts, **kw: fused_moe_mxfp4_triton(x, *t, ids, wts, fp8_activations=True, **kw),
             lambda x, t, ids, wts: fused_moe_mxfp4_ref(x, *t, ids, wts, fp8_activations=True),
             lambda w13, w2: _mx4_tables(w13) + _mx4_tables(w2)),
}


def _spy_slots(monkeypatch):
    """Record every out_slots [T*k, H] the launchers hand to `moe_combine` (each module's own reference to it)."""
    seen, real = [], moe16.moe_combine

    def spy(out_slots, *args, **kwargs):
        seen.append(out_slots.clone())
        return real(out_slots, *args, **kwargs)

    for mod in (moe16, moe8, mx4, mx4_decode):
        monkeypatch.setattr(mod, "moe_combine", spy)
    return seen


def _moe_case(fmt, seed, T=7, E=4, H=64, I=64, k_routed=2):
    """bf16 x [T, H], fresh random tables of `fmt` (E routed + the shared row E), ids [T, k_routed + 1] (distinct
    routed experts, then the shared column E with weight 1.0), weights fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16()
    w13 = torch.randn(E + 1, 2 * I, H, generator=g) / H ** 0.5 * 2
    w2 = torch.randn(E + 1, H, I, generator=g) / I ** 0.5
    routed = torch.stack([torch.randperm(E, generator=g)[:k_routed] for _ in range(T)])
    ids = torch.cat([routed, torch.full((T, 1), E)], 1).int()
    wts = torch.cat([torch.rand(T, k_routed, generator=g) + 0.1, torch.ones(T, 1)], 1)
    return x, FAMILIES[fmt][2](w13, w2), ids, wts


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("fmt", list(FAMILIES))
def test_launchers_bf16_slot_rows(fmt, monkeypatch):
    """slot_dtype=bf16 with bf16 x, fresh random inputs. GEMM 2 computes the same fp32 accumulators whatever the
    slot dtype, so: (1) the bf16 slot rows are the float32 rows rounded to nearest even, bitwise; (2) the output is
    the sequential fp32 sum of the upcast bf16 rows, one rounding, bitwise; (3) elementwise against the float32-slot
    output, with S = sum_i |s_i| over the float32 rows: a = fp32 sum of the rounded r_i, b = of the s_i,
    |a - b| <= D = (u16 + (k-1) u32 (2 + u16)) S, and each output is one bf16 rounding of a / b, so
    |out16 - out32| <= D + u16 (1 + 2 u16) (|out16| + |out32|); (4) against the float64 reference (triangle
    inequality): rel(out16) <= rel(out32) + ||that bound|| / ||ref||, i.e. today's error plus the slot rounding."""
    launch, reference, _ = FAMILIES[fmt]
    x, tabs, ids, wts = _moe_case(fmt, seed=len(fmt))
    T, H, k = x.shape[0], x.shape[1], ids.shape[1]
    seen = _spy_slots(monkeypatch)
    out32 = launch(x, tabs, ids, wts)
    out16 = launch(x, tabs, ids, wts, slot_dtype=torch.bfloat16)
    s32, s16 = seen
    assert s32.dtype == torch.float32 and s16.dtype == torch.bfloat16 and s32.abs().min() > 0
    assert torch.equal(s16, s32.to(torch.bfloat16))
    assert out16.dtype == torch.bfloat16 and torch.equal(out16, _sequential(s16.float(), T, k, torch.bfloat16))
    u16, s_abs = U[torch.bfloat16], s32.double().abs().view(T, k, H).sum(1)
    d = (u16 + (k - 1) * U[torch.float32] * (2 + u16)) * s_abs
    bound = d + u16 * (1 + 2 * u16) * (out16.double().abs() + out32.double().abs())
    assert ((out16.double() - out32.double()).abs() <= bound).all()
    ref = reference(x, tabs, ids, wts)
    assert ref.abs().max() > 0
    slack = (bound.norm() / ref.double().norm()).item()
    assert slack < 2e-2 and _rel(out16, ref) <= _rel(out32, ref) + slack
    assert not torch.equal(out16, out32)  # the option changes something at these sizes


def test_slot_dtype_default_and_refusals(monkeypatch):
    """None picks float32 rows below SLOT_HALF_FROM_TOKENS tokens (decode sizes) and x's 16-bit dtype from there
    (SLOT_DTYPE bf16 since round 10); the launchers apply the rule to their own token count (the threshold lowered
    to this case's 7 tokens gives the same output as slot_dtype=bf16); float32 x keeps float32 rows; a slot dtype
    other than float32 or x's 16-bit dtype is refused."""
    assert moe16.SLOT_DTYPE == torch.bfloat16 and moe16.SLOT_HALF_FROM_TOKENS == 257
    assert slot_dtype_for(torch.bfloat16, 256) == torch.float32 and slot_dtype_for(torch.bfloat16, 257) == torch.bfloat16
    assert slot_dtype_for(torch.float16, 4096) == torch.float16 and slot_dtype_for(torch.float32, 4096) == torch.float32
    x, tabs, ids, wts = _moe_case("bf16", seed=11)
    seen = _spy_slots(monkeypatch)
    out32 = fused_moe_triton(x, *tabs, ids, wts, slot_dtype=torch.float32)
    out16 = fused_moe_triton(x, *tabs, ids, wts, slot_dtype=torch.bfloat16)
    assert torch.equal(fused_moe_triton(x, *tabs, ids, wts), out32)  # 7 tokens: float32 rows
    monkeypatch.setattr(moe16, "SLOT_HALF_FROM_TOKENS", x.shape[0])
    assert torch.equal(fused_moe_triton(x, *tabs, ids, wts), out16)
    fused_moe_triton(x.float(), tabs[0].float(), tabs[1].float(), ids, wts)
    assert [s.dtype for s in seen] == [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    assert not torch.equal(out16, out32)
    for x_dtype, bad in ((torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16), (torch.float16, torch.int8)):
        with pytest.raises(ValueError, match="ladle offers None"):
            slot_dtype_for(x_dtype, 4096, bad)
    with pytest.raises(ValueError, match="slot_dtype torch.float16 with x torch.bfloat16"):
        fused_moe_fp8_triton(x[:0], *quantize_fp8_rows(tabs[0].float()), *quantize_fp8_rows(tabs[1].float()),
                             ids[:0], wts[:0], slot_dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 37, 8195])
def test_gpu_combine_order_determinism_and_graph(T):
    """TP4-rank M3 shapes (H 6144, 4 routed + shared = 5 slots): bitwise the sequential fp32 order, repeatable, and
    the same from a CUDA-graph replay."""
    k, H = 5, 6144
    slots = _slots(T, k, H, device="cuda")
    out = moe_combine_triton(slots, T, k, torch.bfloat16)
    assert torch.equal(out, _sequential(slots, T, k, torch.bfloat16))
    ref = moe_combine_ref(slots, T, k, torch.bfloat16)
    s_abs = slots.double().abs().view(T, k, H).sum(1)
    assert ((out.double() - ref.double()).abs() <= 2 * (k - 1) * 2.0 ** -24 * s_abs + 2 * 2.0 ** -8 * ref.double().abs()).all()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = moe_combine_triton(slots, T, k, torch.bfloat16)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)


@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,H,bt,bh", [(7, 5, 80, 4, 32), (259, 3, 520, None, None)])
def test_gathered_combine_is_the_weighted_sequential_sum(T, k, H, bt, bh, row_dtype):
    """Gathered form (GEMM 2's aligned rows): slot t*k + i is weights[t, i] * rows[positions[t*k + i]] in fp32, then
    the sequential order. Rows are a random permutation of the slots plus unread padding rows (NaN, so a stray read
    shows); under the interpreter the kernel equals that loop in torch bit for bit (no FMA there), and the
    reference within fp32 summation order (CPU tensors: the interpreter; a GPU may contract the product and the add
    into an FMA)."""
    g = torch.Generator().manual_seed(T + k)
    slots = _slots(T, k, H, seed=k).to(row_dtype)
    R = T * k + 13
    perm = torch.randperm(R, generator=g)[:T * k]
    rows = torch.full((R, H), float("nan"), dtype=row_dtype)
    rows[perm] = slots
    positions = perm.to(torch.int32)
    weights = torch.rand(T, k, generator=g) + 0.1
    out = moe_combine_triton(rows, T, k, torch.float32, block_t=bt, block_h=bh, positions=positions, weights=weights)
    weighted = slots.float() * weights.reshape(-1, 1)
    assert torch.equal(out, _sequential(weighted, T, k, torch.float32))
    ref = moe_combine_ref(rows, T, k, torch.float32, positions, weights)
    bound = 2 * (k - 1) * U[torch.float32] * weighted.abs().view(T, k, H).sum(1)
    assert ((out - ref).abs() <= bound).all()
    assert torch.equal(moe_combine(rows, T, k, torch.float32, use_triton=True, positions=positions, weights=weights),
                       out)


def test_aligned_positions_invert_the_aligned_order():
    """positions[sorted_ids[p]] = p for every aligned row holding a pair; the padding rows' sentinel is dropped."""
    from ladle.kernels.fused_moe import aligned_positions
    from ladle.kernels.moe_align import moe_align_ref

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (37, 3), generator=g, dtype=torch.int32)
    sorted_ids, _, npp = moe_align_ref(ids, 6, 16)
    pos = aligned_positions(sorted_ids, ids.numel())
    assert pos.shape == (ids.numel(),) and pos.dtype == torch.int32
    assert torch.equal(sorted_ids[pos.long()], torch.arange(ids.numel(), dtype=torch.int32))
    assert (pos < int(npp)).all()


@pytest.mark.parametrize("gathered", [False, True])
def test_combine_writes_into_a_given_out(gathered):
    """`out=`: the combine writes a [T, H] row range of a larger tensor (FusedMoE's chunk rows), leaves the other rows
    alone, returns that tensor, and writes exactly what it returns without `out`; the reference copies into it."""
    T, k, H = 9, 3, 72
    g = torch.Generator().manual_seed(11)
    slots = _slots(T, k, H, seed=4).to(torch.bfloat16)
    kwargs = {}
    rows = slots
    if gathered:
        R = T * k + 5
        perm = torch.randperm(R, generator=g)[:T * k]
        rows = torch.full((R, H), float("nan"), dtype=torch.bfloat16)
        rows[perm] = slots
        kwargs = {"positions": perm.to(torch.int32), "weights": torch.rand(T, k, generator=g) + 0.1}
    fresh = moe_combine(rows, T, k, torch.bfloat16, use_triton=True, **kwargs)
    big = torch.full((T + 6, H), -7.0, dtype=torch.bfloat16)
    got = moe_combine(rows, T, k, torch.bfloat16, use_triton=True, out=big[4:4 + T], **kwargs)
    assert got.data_ptr() == big[4].data_ptr() and torch.equal(got, fresh)
    assert (big[:4] == -7).all() and (big[4 + T:] == -7).all()
    ref_out = torch.empty(T, H, dtype=torch.bfloat16)
    ref = moe_combine_ref(rows, T, k, torch.bfloat16, kwargs.get("positions"), kwargs.get("weights"), out=ref_out)
    assert ref is ref_out and torch.equal(ref, moe_combine_ref(rows, T, k, torch.bfloat16, kwargs.get("positions"),
                                                               kwargs.get("weights")))
    with pytest.raises(AssertionError):
        moe_combine_triton(rows, T, k, torch.bfloat16, out=torch.empty(T, H, dtype=torch.float32), **kwargs)


@pytest.mark.parametrize("aligned", [False, True])
def test_fp8_moe_op_writes_into_a_given_out(aligned):
    """The FP8 op with `out=` (slot rows, and GEMM 2's aligned rows with the gathered combine) returns `out`, holding
    exactly the op's result without it; the reference fallback copies into it."""
    from ladle.kernels.fused_moe_fp8 import Fp8MoEOptions, fused_moe_fp8

    torch.manual_seed(5)
    T, E, H, I, k = 11, 4, 256, 128, 3
    x = torch.randn(T, H)
    tables = FAMILIES["fp8"][2](torch.randn(E, 2 * I, H) * 0.2, torch.randn(E, H, I) * 0.2)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    wts = torch.rand(T, k)
    # 128 x 128 block tables: block-uniform scales, which the aligned rows need
    opts = Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_aligned=True) if aligned else None
    fresh = fused_moe_fp8_triton(x, *tables, ids, wts, options=opts, block_uniform=aligned)
    assert fresh.abs().max() > 0.1
    big = torch.full((T + 3, H), 5.0)
    got = fused_moe_fp8_triton(x, *tables, ids, wts, options=opts, block_uniform=aligned, out=big[2:2 + T])
    assert got.data_ptr() == big[2].data_ptr() and torch.equal(got, fresh)
    assert (big[:2] == 5).all() and (big[2 + T:] == 5).all()
    ref_out = torch.empty(T, H)
    ref = fused_moe_fp8(x, *tables, ids, wts, use_triton=False, out=ref_out)
    assert ref is ref_out and torch.equal(ref, fused_moe_fp8(x, *tables, ids, wts, use_triton=False))
