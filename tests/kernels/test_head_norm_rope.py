"""Fused per-head Gemma RMSNorm + partial NeoX RoPE against a float64 formula and against the M3 torch layers."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels._common import interpreting
from ladle.kernels.head_norm_rope import head_norm_rope, head_norm_rope_ref, qk_norm_rope_store
from ladle.kernels.kv_store import store_index_kcache, store_kvcache
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


# ---------------------------------------------------------------------------------------------------------------
# qk_norm_rope_store: the MiniMax-M3 attention prologue (4 norm + RoPE launches and the K/V / index-K stores) in one


def _prologue_inputs(T, Hq, Hkv, D, Hi, Di, rot, dtype, cache_dtype, seed, device):
    """Column views of one projection output [T, q | k | v | iq | ik + 5 spare], norm weights, cos/sin, caches filled
    with a sentinel (so a skipped slot shows), a slot mapping with padding (-1) tokens."""
    g = torch.Generator().manual_seed(seed)
    widths = [Hq * D, Hkv * D, Hkv * D, Hi * Di, Di]
    proj = (torch.randn(T, sum(widths) + 5, generator=g) * 2 + 0.3).to(dtype)
    cols, start = [], 0
    for w in widths:
        cols.append(proj[:, start:start + w])
        start += w
    q, k, v = cols[0].view(T, Hq, D), cols[1].view(T, Hkv, D), cols[2].view(T, Hkv, D)
    iq, ik = cols[3].view(T, Hi, Di), cols[4]
    weights = [(torch.randn(n, generator=g) * 0.3).to(dtype) for n in (D, D, Di, Di)]
    positions = torch.randint(0, 4096, (T,), generator=g)
    cos, sin = RotaryEmbedding(max(D, Di), rot, 4096, 10000.0, device="cpu").cos_sin(positions, dtype)
    blocks, bs = 4, 8
    sentinel = torch.full((blocks, bs, Hkv, D), 0.75).to(cache_dtype)
    kc, vc = sentinel.clone(), sentinel.clone()
    ikc = torch.full((blocks, bs, Di), -0.5).to(cache_dtype)
    slots = torch.randperm(blocks * bs, generator=g)[:T].to(torch.int32)
    slots[1::3] = -1  # padding tokens: nothing written
    to = lambda x: x.to(device)  # noqa: E731
    return ([to(x) for x in (q, k, v, iq, ik)], [to(w) for w in weights], to(cos), to(sin),
            [to(c) for c in (kc, vc, ikc)], to(slots))


def _run_fused(xs, ws, cos, sin, caches, slots, scales, with_index):
    q, k, v, iq, ik = xs
    kc, vc, ikc = caches
    index = (iq, ik, ws[2], ws[3], (1e-6, 2e-6), ikc, scales[2]) if with_index else None
    return qk_norm_rope_store(q, k, v, ws[0], ws[1], (1e-6, 3e-6), cos, sin, kc, vc, slots, k_scale=scales[0],
                              v_scale=scales[1], index=index)


def _run_unfused(xs, ws, cos, sin, caches, slots, scales, with_index):
    """The ops the fused one replaces, each on its own (their Triton kernels on the same device)."""
    q, k, v, iq, ik = xs
    kc, vc, ikc = caches
    q_out = head_norm_rope(q, ws[0], 1e-6, cos, sin)
    store_kvcache(head_norm_rope(k, ws[1], 3e-6, cos, sin), v, kc, vc, slots, k_scale=scales[0], v_scale=scales[1])
    if not with_index:
        return q_out, None
    ik_n = head_norm_rope(ik.view(ik.shape[0], 1, -1), ws[3], 2e-6, cos, sin).view(ik.shape[0], -1)
    store_index_kcache(ik_n, ikc, slots, index_k_scale=scales[2])
    return q_out, head_norm_rope(iq, ws[2], 1e-6, cos, sin)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype,cache_dtype,scales", [
    (torch.bfloat16, torch.bfloat16, (1.0, 1.0, 1.0)),
    (torch.bfloat16, torch.float8_e4m3fn, (0.9, 1.3, 0.4)),
    (torch.bfloat16, torch.float8_e5m2, (1.0, 1.0, 1.0)),
    (torch.float32, torch.float32, (1.0, 1.0, 1.0))])
@pytest.mark.parametrize("with_index,T,Hq,Hkv,D,Hi,Di,rot", [
    (True, 7, 4, 2, 32, 2, 16, 16),  # M3-like: MSA layer, partial rotary on the index heads' width
    (False, 5, 6, 1, 48, 1, 16, 32)])  # a dense layer; non-pow2 D and Hq
def test_qk_norm_rope_store_equals_the_ops_it_fuses(device, dtype, cache_dtype, scales, with_index, T, Hq, Hkv, D,
                                                    Hi, Di, rot):
    """Bit for bit: the fused launch writes the same q / index q, the same cache bytes (FP8 quantized with the
    per-tensor scales) and leaves padding slots untouched, as head_norm_rope x 4 + store_kvcache +
    store_index_kcache do on the same device (the two share the norm + RoPE body, `_norm_rope_heads`)."""
    args = _prologue_inputs(T, Hq, Hkv, D, Hi, Di, rot, dtype, cache_dtype, seed=T + Hq, device=device)
    xs, ws, cos, sin, caches, slots = args
    before = [c.clone() for c in caches]
    before_exec = sum(b["executed"] for b in dispatch.snapshot()["ops"].get("qk_norm_rope_store", {})
                      .get("buckets", {}).values())
    fused_caches = [c.clone() for c in caches]
    got_q, got_iq = _run_fused(xs, ws, cos, sin, fused_caches, slots, scales, with_index)
    want_q, want_iq = _run_unfused(xs, ws, cos, sin, caches, slots, scales, with_index)
    if device == "cuda" or interpreting():
        after_exec = sum(b["executed"] for b in dispatch.snapshot()["ops"]["qk_norm_rope_store"]["buckets"].values())
        assert after_exec > before_exec
    assert torch.equal(got_q, want_q) and got_q.shape == (T, Hq, D) and got_q.is_contiguous()
    assert (got_iq is None) == (not with_index) and (got_iq is None or torch.equal(got_iq, want_iq))
    for got, want, old in zip(fused_caches, caches, before):
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want)
    pad = (slots < 0).cpu()
    for cache, old in zip(fused_caches, before):
        flat, flat_old = (c.view(-1, *c.shape[2:]).cpu().float() for c in (cache, old))
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[~pad.to(slots.device)].long().cpu()] = False
        assert torch.equal(flat[untouched], flat_old[untouched])  # padding and unused slots keep the sentinel
        if not with_index and cache is fused_caches[2]:
            assert torch.equal(flat, flat_old)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_qk_norm_rope_store_float32_matches_reference(device):
    """float32 with float32 caches, against the composition of the torch references (`use_triton=False`, the
    fallback), the norm + RoPE body also against the float64 formula."""
    T, Hq, Hkv, D, Hi, Di, rot = 9, 4, 1, 32, 2, 32, 16
    args = _prologue_inputs(T, Hq, Hkv, D, Hi, Di, rot, torch.float32, torch.float32, seed=11, device=device)
    xs, ws, cos, sin, caches, slots = args
    ref_caches = [c.clone() for c in caches]
    q, iq = _run_fused(xs, ws, cos, sin, caches, slots, (1.0, 1.0, 1.0), True)
    q_ref, iq_ref = qk_norm_rope_store(*xs[:3], ws[0], ws[1], (1e-6, 3e-6), cos, sin, ref_caches[0], ref_caches[1],
                                       slots, index=(xs[3], xs[4], ws[2], ws[3], (1e-6, 2e-6), ref_caches[2], 1.0),
                                       use_triton=False)
    assert _rel(q.cpu(), q_ref.cpu()) < 1e-6 and _rel(iq.cpu(), iq_ref.cpu()) < 1e-6
    assert _rel(q.cpu(), _formula64(xs[0].cpu(), ws[0].cpu(), 1e-6, cos.cpu(), sin.cpu())) < 1e-6
    for got, want in zip(caches, ref_caches):
        assert _rel(got.cpu(), want.cpu()) < 1e-6
