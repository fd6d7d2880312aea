"""FP8 KV / index-K caches (issue 11, persistent plane): every store quantizes, every reader dequantizes on load.

Each kernel runs with float8_e4m3fn and float8_e5m2 caches and non-unit per-tensor scales on fresh random inputs,
against its own torch reference (the one reference per op) evaluated in float64 on the same FP8 cache bytes.
Stated errors (CPU interpreter, float32 queries): relative Frobenius error vs the float64 reference < 1e-5 for
the attention kernels and the indexer's block scores; the store kernel equals its reference byte for byte.
The distance from unquantized float64 attention is also bounded (FP8 rounding: half an ulp is 2^-4 relative
for e4m3, 2^-3 for e5m2, and attention averages it down): < 0.05 (e4m3) and < 0.1 (e5m2).
"""

from __future__ import annotations

import pytest
import torch

from ladle.kernels._common import fp8_max, quantize_fp8_ref
from ladle.kernels.kv_store import store_index_kcache, store_index_kcache_ref, store_kvcache, store_kvcache_ref
from ladle.kernels.msa_indexer import msa_block_scores, msa_indexer_ref, msa_indexer_triton
from ladle.kernels.msa_sparse_attention import msa_sparse_attention, msa_sparse_attention_ref
from ladle.kernels.paged_attention import gather_sequence, paged_attention, paged_attention_ref
from ladle.observe import dispatch
from msa_batch import as_sets
from msa_batch import build as build_msa
from paged_batch import F32_TOL, build, oracle, rel_err

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_ORACLE_TOL = {torch.float8_e4m3fn: 0.05, torch.float8_e5m2: 0.1}
MANTISSA = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
K_SCALE, V_SCALE = 0.37, 1.9


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _junk_cache(shape, dtype, g) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", FP8)
def test_store_quantizes_like_reference_and_saturates(dtype, device):
    """CPU: the interpreter; CUDA (marked): the compiled kernel, same bytes as the reference."""
    g = torch.Generator().manual_seed(11)
    T, hkv, d, nb, bs = 13, 2, 16, 6, 4
    k = torch.randn(T, hkv, d, generator=g) * 3
    v = torch.randn(T, hkv, d, generator=g) * 3
    k[0, 0, :3] = torch.tensor([1e6, -1e6, 1e-7])  # saturate both ways, and a subnormal
    slots = (torch.randperm((nb - 1) * bs, generator=g)[:T] + bs).to(torch.int64)  # never block 0
    slots[[2, 7]] = -1
    kc = _junk_cache((nb, bs, hkv, d), dtype, g)
    vc = _junk_cache((nb, bs, hkv, d), dtype, g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    dev = [t.to(device) for t in (k, v, kc, vc, slots)]
    store_kvcache(*dev, k_scale=K_SCALE, v_scale=V_SCALE, use_triton=True)
    kc, vc = dev[2].cpu(), dev[3].cpu()
    store_kvcache_ref(k, v, kc_ref, vc_ref, slots, K_SCALE, V_SCALE)
    assert torch.equal(_bytes(kc), _bytes(kc_ref)) and torch.equal(_bytes(vc), _bytes(vc_ref))
    flat = kc.view(-1, hkv, d)
    assert flat[slots[0], 0, 0].float() == fp8_max(dtype) and flat[slots[0], 0, 1].float() == -fp8_max(dtype)
    # round to nearest: |stored * scale - x| <= half an ulp (2^-(mantissa+1) relative) for in-range normals
    ok = slots >= 0
    deq = flat[slots[ok]].double() * K_SCALE
    x = k[ok].double()
    normal = (x / K_SCALE).abs().clamp(max=fp8_max(dtype)) >= torch.finfo(dtype).tiny
    in_range = (x / K_SCALE).abs() <= fp8_max(dtype)
    sel = normal & in_range
    assert ((deq - x).abs()[sel] <= x.abs()[sel] * 2.0 ** -(MANTISSA[dtype] + 1)).all()
    # untouched slots keep their junk
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[ok]] = False
    assert torch.equal(_bytes(kc.view(-1, hkv, d)[untouched]), _bytes(kc_ref.view(-1, hkv, d)[untouched]))


@pytest.mark.parametrize("dtype", FP8)
def test_index_k_store_quantizes_like_reference(dtype):
    g = torch.Generator().manual_seed(12)
    T, d, nb, bs = 9, 32, 4, 4
    ik = torch.randn(T, d, generator=g).bfloat16()  # the model's activations need not be float32
    slots = (torch.randperm((nb - 1) * bs, generator=g)[:T] + bs).to(torch.int32)
    slots[4] = -1
    cache = _junk_cache((nb, bs, d), dtype, g)
    ref = cache.clone()
    store_index_kcache(ik, cache, slots, index_k_scale=0.05, use_triton=True)
    store_index_kcache_ref(ik, ref, slots, 0.05)
    assert torch.equal(_bytes(cache), _bytes(ref))
    assert torch.equal(_bytes(ref.view(-1, d)[slots[0].item()]), _bytes(quantize_fp8_ref(ik[0], 0.05, dtype)))


def _fp8_batch(q_lens, ctx_lens, dtype, seed):
    b = build(q_lens, ctx_lens, num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=4, pad_tokens=2, seed=seed)
    b.key_cache = quantize_fp8_ref(b.key_cache, K_SCALE, dtype)
    b.value_cache = quantize_fp8_ref(b.value_cache, V_SCALE, dtype)
    return b


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("q_lens,ctx_lens", [([5, 1, 17, 3], [0, 7, 5, 12]),  # prefill, prefix hit, chunks
                                             ([1, 1, 1, 1], [0, 3, 4, 26])])  # decode at block boundaries
def test_paged_attention_dequantizes_on_load(dtype, q_lens, ctx_lens):
    b = _fp8_batch(q_lens, ctx_lens, dtype, seed=sum(ctx_lens))
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    dispatch.reset()
    out = paged_attention(b.q, b.key_cache, b.value_cache, b.md, 0.3, use_triton=True, **scales)
    op = "attn_decode" if max(q_lens) == 1 else "attn_prefill"
    bucket = f"T<={1 << (b.q.shape[0] - 1).bit_length()} kv={'fp8_e4m3' if dtype == FP8[0] else 'fp8_e5m2'}"
    assert dispatch.snapshot()["ops"][op]["buckets"][bucket]["executed"] == 1
    ref = paged_attention_ref(b.q.double(), b.key_cache, b.value_cache, b.md, 0.3, **scales)
    assert rel_err(out, ref) < F32_TOL
    assert rel_err(out, oracle(b, 0.3)) < FP8_ORACLE_TOL[dtype]  # oracle: the unquantized float64 K/V
    assert torch.count_nonzero(out[b.md.num_actual_tokens:]) == 0


def test_reference_dequantizes_with_the_scales():
    """The reference over an FP8 cache equals the reference over the explicitly dequantized float64 cache."""
    b = _fp8_batch([3, 1], [5, 9], torch.float8_e4m3fn, seed=5)
    ref = paged_attention_ref(b.q.double(), b.key_cache, b.value_cache, b.md, 0.3, k_scale=K_SCALE, v_scale=V_SCALE)
    plain = paged_attention_ref(b.q.double(), b.key_cache.double() * K_SCALE, b.value_cache.double() * V_SCALE,
                                b.md, 0.3)
    assert torch.allclose(ref, plain, rtol=0, atol=1e-12)


MSA_BS, MSA_D = 16, 32
MSA_REQS = [(0, 20), (60, 6), (15, 1), (16, 1), (100, 1)]


@pytest.mark.parametrize("dtype", FP8)
def test_msa_indexer_fp8_index_k(dtype):
    """Selections equal the reference's on the same FP8 bytes; the pooled block scores (scratch) equal the float64
    block scores of the dequantized keys (rel err < 1e-5), so the scale really is applied."""
    g = torch.Generator().manual_seed(21)
    b = build_msa(MSA_REQS, MSA_BS, max_blocks=8, pad_tokens=1)
    T, H, topk, iscale = b.num_tokens, 2, 3, 0.125
    q = torch.randn(T, H, MSA_D, generator=g)
    kc = quantize_fp8_ref(torch.randn(b.num_blocks, MSA_BS, MSA_D, generator=g) * 2, iscale, dtype)
    scores = torch.full((H, T, 8), float("nan"))
    out = msa_indexer_triton(q, kc, b.block_table, b.positions, b.query_start_loc, topk, scores=scores,
                             index_k_scale=iscale, fused_topk=False)
    ref = msa_indexer_ref(q, kc, b.block_table, b.positions, b.query_start_loc, topk, index_k_scale=iscale)
    assert as_sets(out) == as_sets(ref)
    qsl = b.query_start_loc.tolist()
    for r in range(len(MSA_REQS)):
        t0, t1 = qsl[r], qsl[r + 1]
        pos = b.positions[t0:t1]
        keys = gather_sequence(kc, b.block_table[r], int(pos.max()) + 1).double() * iscale
        want = msa_block_scores(q[t0:t1].double(), keys, pos, MSA_BS)  # [H, Tq, nb]
        got = scores[:, t0:t1, : want.shape[-1]]
        vis = torch.isfinite(want)
        assert rel_err(got[vis], want[vis]) < 1e-5


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_msa_sparse_attention_fp8_kv(dtype, num_splits):
    g = torch.Generator().manual_seed(31 + num_splits)
    b = build_msa(MSA_REQS, MSA_BS, max_blocks=8, pad_tokens=1)
    hkv, group = 2, 4
    q = torch.randn(b.num_tokens, hkv * group, MSA_D, generator=g)
    kc = quantize_fp8_ref(torch.randn(b.num_blocks, MSA_BS, hkv, MSA_D, generator=g), K_SCALE, dtype)
    vc = quantize_fp8_ref(torch.randn(b.num_blocks, MSA_BS, hkv, MSA_D, generator=g), V_SCALE, dtype)
    sel = msa_indexer_ref(torch.randn(b.num_tokens, hkv, MSA_D, generator=g),
                          torch.randn(b.num_blocks, MSA_BS, MSA_D, generator=g), b.block_table, b.positions,
                          b.query_start_loc, 3)
    args = (b.block_table, sel, b.positions, b.query_start_loc)
    out = msa_sparse_attention(q, kc, vc, *args, k_scale=K_SCALE, v_scale=V_SCALE, use_triton=True,
                               num_splits=num_splits)
    ref = msa_sparse_attention_ref(q.double(), kc, vc, *args, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(out, ref) < 1e-5
    assert torch.count_nonzero(out[-1]) == 0, "padding token must give zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FP8)
def test_gpu_fp8_kv_real_shapes(dtype):
    """H200, bf16 queries: dense paged attention at SmolLM2 / M3-dense shapes (D 64 / 128, block 16) and MSA at the
    real geometry (block 128, D 128, index dim 128, topk 16) over FP8 caches, against the references."""
    torch.manual_seed(0)
    for hq, hkv, d in ((9, 3, 64), (16, 1, 128)):
        for q_lens, ctx in (([1] * 32, [2000 + 37 * i for i in range(32)]), ([700, 300], [1000, 0])):
            b = build(q_lens, ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=torch.bfloat16,
                      device="cuda", seed=d)
            kc, vc = quantize_fp8_ref(b.key_cache, K_SCALE, dtype), quantize_fp8_ref(b.value_cache, V_SCALE, dtype)
            out = paged_attention(b.q, kc, vc, b.md, d ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
            ref = paged_attention_ref(b.q.float(), kc, vc, b.md, d ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
            assert rel_err(out, ref) < 2e-2
    bs, d, topk = 128, 128, 16
    b = build_msa([(8000, 1)] * 8 + [(0, 600)], bs, max_blocks=64, device="cuda")
    hkv, group = 1, 16
    q = torch.randn(b.num_tokens, hkv * group, d, device="cuda").bfloat16()
    kc = quantize_fp8_ref(torch.randn(b.num_blocks, bs, hkv, d, device="cuda"), K_SCALE, dtype)
    vc = quantize_fp8_ref(torch.randn(b.num_blocks, bs, hkv, d, device="cuda"), V_SCALE, dtype)
    iq = torch.randn(b.num_tokens, hkv, d, device="cuda").bfloat16()
    ikc = quantize_fp8_ref(torch.randn(b.num_blocks, bs, d, device="cuda"), 0.1, dtype)
    sel = msa_indexer_triton(iq, ikc, b.block_table, b.positions, b.query_start_loc, topk, index_k_scale=0.1)
    sel_ref = msa_indexer_ref(iq.float(), ikc, b.block_table, b.positions, b.query_start_loc, topk, index_k_scale=0.1)
    agree = sum(len(a & r) for ha, hr in zip(as_sets(sel), as_sets(sel_ref)) for a, r in zip(ha, hr))
    total = sum(len(r) for hr in as_sets(sel_ref) for r in hr)
    assert agree >= 0.98 * total  # bf16 index q: near-ties may swap
    args = (b.block_table, sel, b.positions, b.query_start_loc)
    out = msa_sparse_attention(q, kc, vc, *args, k_scale=K_SCALE, v_scale=V_SCALE)
    ref = msa_sparse_attention_ref(q.float(), kc, vc, *args, k_scale=K_SCALE, v_scale=V_SCALE)
    assert rel_err(out, ref) < 2e-2
