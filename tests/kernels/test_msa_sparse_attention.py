"""MSA sparse attention (ladle/kernels/msa_sparse_attention.py) vs the float64 reference, and vs plain dense causal
attention when every visible block is selected (an independent oracle)."""

from __future__ import annotations

import math

import pytest
import torch

from ladle.kernels.msa_indexer import msa_indexer_ref
from ladle.kernels.msa_sparse_attention import (msa_sparse_attention, msa_sparse_attention_ref,
                                                msa_sparse_attention_triton)
from msa_batch import build, rel_err, spy_launches

BS, D = 16, 32


def _inputs(b, hkv, group, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = b.num_tokens
    q = torch.randn(T, hkv * group, D, generator=g).to(dtype)
    kc = torch.randn(b.num_blocks, BS, hkv, D, generator=g).to(dtype)
    vc = torch.randn(b.num_blocks, BS, hkv, D, generator=g).to(dtype)
    return q, kc, vc


def _selection(b, hkv, topk, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    qi = torch.randn(b.num_tokens, hkv, D, generator=g)
    kic = torch.randn(b.num_blocks, BS, D, generator=g)
    return msa_indexer_ref(qi, kic, b.block_table, b.positions, b.query_start_loc, topk)


@pytest.mark.parametrize("num_splits,vec_search", [(1, True), (2, False)])
def test_ragged_fp32_vs_reference(num_splits, vec_search, monkeypatch):
    """Prefill from 0, chunked prefill, decodes at block boundaries, a padding token; two KV groups of 4 heads."""
    import ladle.kernels.msa_sparse_attention as mod
    monkeypatch.setattr(mod, "VEC_SEARCH_MAX_REQS", 4096 if vec_search else 0)  # else: binary-search path
    b = build([(0, 20), (60, 6), (15, 1), (16, 1), (100, 1)], BS, max_blocks=8, pad_tokens=1)
    q, kc, vc = _inputs(b, 2, 4)
    sel = _selection(b, 2, topk=3)
    out = torch.full_like(q, float("nan"))
    msa_sparse_attention_triton(q, kc, vc, b.block_table, sel, b.positions, b.query_start_loc,
                                num_splits=num_splits, out=out)
    ref = msa_sparse_attention_ref(q.double(), kc.double(), vc.double(), b.block_table, sel, b.positions,
                                   b.query_start_loc)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(out[-1], torch.zeros_like(out[-1])), "padding token must give zeros"


def test_all_blocks_selected_equals_dense_causal():
    """With topk >= visible blocks, MSA is dense causal attention: compare with an independent dense softmax."""
    b = build([(0, 24), (33, 1)], BS, max_blocks=4)
    q, kc, vc = _inputs(b, 1, 4, seed=1)
    sel = _selection(b, 1, topk=4)
    out = msa_sparse_attention_triton(q, kc, vc, b.block_table, sel, b.positions, b.query_start_loc)
    qsl = b.query_start_loc.tolist()
    for r in range(2):
        n_ctx = int(b.positions[qsl[r + 1] - 1]) + 1
        pages = b.block_table[r].long()
        k = kc[pages].reshape(-1, 1, D)[:n_ctx, 0].double()
        v = vc[pages].reshape(-1, 1, D)[:n_ctx, 0].double()
        for t in range(qsl[r], qsl[r + 1]):
            p = int(b.positions[t])
            w = torch.softmax(q[t].double() @ k[: p + 1].T / math.sqrt(D), dim=-1)
            assert rel_err(out[t], w @ v[: p + 1]) < 1e-5


def test_layout_trap_and_bf16():
    """num_tokens == num_kv_heads == 2, groups select different blocks; bf16 within bf16 tolerance."""
    b = build([(70, 1), (90, 1)], BS, max_blocks=8)
    q, kc, vc = _inputs(b, 2, 2, seed=2)
    sel = torch.tensor([[[0, 4], [2, 5]], [[1, 4], [5, -1]]], dtype=torch.int32)  # [H, T, k]
    ref = msa_sparse_attention_ref(q.double(), kc.double(), vc.double(), b.block_table, sel, b.positions,
                                   b.query_start_loc)
    out = msa_sparse_attention_triton(q, kc, vc, b.block_table, sel, b.positions, b.query_start_loc)
    assert rel_err(out, ref) < 1e-5
    swapped = msa_sparse_attention_ref(q.double(), kc.double(), vc.double(), b.block_table,
                                       sel.transpose(0, 1).contiguous(), b.positions, b.query_start_loc)
    assert rel_err(swapped, ref) > 1e-2, "test data must distinguish [H, T] from [T, H]"
    out16 = msa_sparse_attention(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), b.block_table, sel, b.positions,
                                 b.query_start_loc)
    assert rel_err(out16, ref) < 2e-2


def _real_geometry_case(reqs, topk: int):
    """CUDA, one TP4 rank's geometry (block 128, head_dim 128, 16 q heads on 1 KV head, bf16) for `reqs` [(context,
    new tokens)]: random caches, selections from the indexer reference. Returns (launch args, float64 reference)."""
    bs, d = 128, 128
    b = build(reqs, bs, max_blocks=17, device="cuda")
    T = b.num_tokens
    q = torch.randn(T, 16, d, device="cuda").bfloat16()
    kc = torch.randn(b.num_blocks, bs, 1, d, device="cuda").bfloat16()
    vc = torch.randn_like(kc)
    qi = torch.randn(T, 1, d, device="cuda").bfloat16()
    kic = torch.randn(b.num_blocks, bs, d, device="cuda").bfloat16()
    sel = msa_indexer_ref(qi, kic, b.block_table, b.positions, b.query_start_loc, topk).cuda()
    args = (q, kc, vc, b.block_table, sel, b.positions, b.query_start_loc)
    return args, msa_sparse_attention_ref(*[a.double() for a in args[:3]], *args[3:])


@pytest.mark.gpu
def test_gpu_real_geometry_and_graph():
    """Block 128, head_dim 128, 16 heads per group, bf16: vs reference; CUDA graph equals eager."""
    torch.manual_seed(5)
    args, ref = _real_geometry_case([(0, 200), (1500, 1), (2047, 1)], topk=4)
    out = msa_sparse_attention_triton(*args)
    assert rel_err(out, ref) < 2e-2
    static = torch.empty_like(out)
    msa_sparse_attention_triton(*args, out=static)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        msa_sparse_attention_triton(*args, out=static)
    static.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)


# ---- fused split merge (last split program merges) vs the two-launch merge ------------------------------------
def _counters_zero() -> bool:
    from ladle.kernels.split_counters import split_counters
    return int(split_counters("msa_sparse_attention", torch.device("cpu"), 1).abs().sum()) == 0


@pytest.mark.parametrize("fused,vec,num_splits", [
    (True, True, 4), (True, False, 2), (False, True, 2), (False, False, 4)])
def test_split_variants_ragged_consecutive_calls(fused, vec, num_splits):
    """Ragged prefill + chunk + decodes (some with fewer visible blocks than top-k, so some splits have no slot and
    merge with weight 0) + a padding token; two consecutive calls with fresh random data into a NaN-poisoned
    output, each vs the float64 reference. A counter left non-zero by one call would leave the next call's output
    unmerged (NaN), so this also proves the reset; the counter buffer is all zero afterwards."""
    b = build([(0, 12), (60, 3), (15, 1), (16, 1), (100, 1)], BS, max_blocks=8, pad_tokens=1, seed=41)
    for call in range(2):
        q, kc, vc = _inputs(b, 2, 4, seed=42 + call)
        sel = _selection(b, 2, topk=4, seed=42 + call)
        out = torch.full_like(q, float("nan"))
        msa_sparse_attention_triton(q, kc, vc, b.block_table, sel, b.positions, b.query_start_loc,
                                    num_splits=num_splits, out=out, fused_merge=fused, vec_search=vec)
        ref = msa_sparse_attention_ref(q.double(), kc.double(), vc.double(), b.block_table, sel, b.positions,
                                       b.query_start_loc)
        assert rel_err(out, ref) < 1e-5, f"call {call}"
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), "padding token must give zeros"
    assert _counters_zero()


@pytest.mark.parametrize("fused", [True, False])
def test_split_variants_tokens_equal_kv_heads(fused):
    """T == Hkv == 2 decode tokens, 4 splits over top-k 4 with random data and random selections that differ per
    group; repeated twice (reset); vs the float64 reference."""
    b = build([(70, 1), (90, 1)], BS, max_blocks=8, seed=51)
    for call in range(2):
        q, kc, vc = _inputs(b, 2, 2, seed=52 + call)
        sel = _selection(b, 2, topk=4, seed=52 + call)
        assert not torch.equal(sel[0], sel[1]), "groups must select differently"
        out = torch.full_like(q, float("nan"))
        msa_sparse_attention_triton(q, kc, vc, b.block_table, sel, b.positions, b.query_start_loc, num_splits=4,
                                    out=out, fused_merge=fused)
        ref = msa_sparse_attention_ref(q.double(), kc.double(), vc.double(), b.block_table, sel, b.positions,
                                       b.query_start_loc)
        assert rel_err(out, ref) < 1e-5
    assert _counters_zero()


def test_default_is_fused_and_flag_restores_two_launch(monkeypatch):
    """fused_merge=None follows FUSED_MERGE: True never launches `_merge_kernel`, False does."""
    import ladle.kernels.msa_sparse_attention as mod
    launched = spy_launches(monkeypatch, mod, "_merge_kernel")
    b = build([(40, 1), (33, 1)], BS, max_blocks=4, seed=61)
    q, kc, vc = _inputs(b, 1, 4, seed=62)
    sel = _selection(b, 1, topk=3, seed=62)
    args = (q, kc, vc, b.block_table, sel, b.positions, b.query_start_loc)
    ref = msa_sparse_attention_ref(*[a.double() for a in args[:3]], *args[3:])
    for flag in (True, False):
        monkeypatch.setattr(mod, "FUSED_MERGE", flag)
        launched.clear()
        assert rel_err(msa_sparse_attention_triton(*args, num_splits=2), ref) < 1e-5
        assert bool(launched) == (not flag)


def test_merge_kernel_vs_reference():
    """The two-launch `_merge_kernel` on random partials (one split per row with no keys: m = -inf, l = 0) vs the
    float64 identity `merge_partials_ref`."""
    from ladle.kernels.msa_sparse_attention_merge import _merge_kernel, merge_partials_ref
    g = torch.Generator().manual_seed(71)
    T, H, S = 3, 2, 4
    pacc = torch.randn(T, H, S, D, generator=g)
    pml = torch.stack([torch.randn(T, H, S, generator=g) * 4, torch.rand(T, H, S, generator=g) + 0.5], dim=-1)
    pml[:, :, 1, 0] = float("-inf")
    pml[:, :, 1, 1] = 0.0
    pacc[:, :, 1] = 0.0
    out = torch.empty(T, H, D)
    _merge_kernel[(T, H)](pacc, pml, out, H, out.stride(0), out.stride(1), HEAD_DIM=D, NUM_SPLITS=S)
    assert rel_err(out, merge_partials_ref(pacc, pml)) < 1e-6


@pytest.mark.gpu
def test_gpu_fused_merge_decode_graph_replays():
    """Decode batch of 24 at real geometry with the default split count (> 1 on an H200) and the fused merge: vs the
    reference, then three CUDA-graph replays into a NaN-poisoned output each equal eager (counters reset)."""
    torch.manual_seed(6)
    ctx = torch.randint(1, 17 * 128 - 1, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    args, ref = _real_geometry_case([(c, 1) for c in ctx], topk=16)
    out = msa_sparse_attention_triton(*args, fused_merge=True)
    assert rel_err(out, ref) < 2e-2
    assert rel_err(msa_sparse_attention_triton(*args, fused_merge=False), ref) < 2e-2
    static = torch.empty_like(out)
    msa_sparse_attention_triton(*args, out=static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        msa_sparse_attention_triton(*args, out=static)
    for _ in range(3):
        static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, out)


# ---- query-tile kernel (TQ tokens x G heads per program over the union of the tile's keys) ---------------------
TILE_CASES = {  # (context, new tokens) per request, padding tokens, KV heads, heads per KV head
    "one_request": ([(0, 22)], 0, 1, 16),  # 22 tokens: the last tile is partial
    "straddling_requests": ([(0, 6), (40, 7), (15, 1), (16, 1), (100, 3)], 1, 2, 2),  # chunks, decodes, padding
    "chunked_prefill": ([(37, 13), (90, 9)], 0, 1, 16),  # positions start past 0 over cached context
    "decode_batch_forced": ([(70, 1), (90, 1), (5, 1), (120, 1), (33, 1)], 0, 2, 2),  # 4 requests per tile
}


def _ref64(q, kc, vc, b, sel):
    return msa_sparse_attention_ref(q.double(), kc.double(), vc.double(), b.block_table, sel, b.positions,
                                    b.query_start_loc)


@pytest.mark.parametrize("tq", [4, 8])
@pytest.mark.parametrize("case", list(TILE_CASES))
def test_tile_kernel_vs_reference(case, tq):
    """Tile kernel on fresh random data vs the float64 reference (relative error < 1e-5 in fp32): indexer
    selections (tokens of a tile repeat blocks; early tokens have fewer visible blocks than top-k, so -1 padding),
    plus two tokens whose selection is all -1 (rows with no valid key give 0), into a NaN-poisoned output."""
    reqs, pad, hkv, group = TILE_CASES[case]
    b = build(reqs, BS, max_blocks=8, pad_tokens=pad, seed=80 + tq)
    q, kc, vc = _inputs(b, hkv, group, seed=81 + tq)
    sel = _selection(b, hkv, topk=4, seed=82 + tq)
    assert (sel < 0).any(), "test data must contain -1 padding"
    none = [1, b.num_tokens - 1 - pad]
    sel[:, none] = -1
    out = torch.full_like(q, float("nan"))
    msa_sparse_attention_triton(q, kc, vc, b.block_table, sel, b.positions, b.query_start_loc, query_tile=tq,
                                out=out)
    assert rel_err(out, _ref64(q, kc, vc, b, sel)) < 1e-5
    assert torch.equal(out[none], torch.zeros_like(out[none])), "rows with no selected block must give zeros"
    if pad:
        assert torch.equal(out[-1], torch.zeros_like(out[-1])), "padding token must give zeros"


def test_tile_kernel_fp8_scales_and_shared_blocks():
    """FP8 e4m3 caches with k_scale 0.5 and v_scale 2 (cast on load, scales folded), G = 16, T = 13 with TQ 4; every
    token of the second request selects the same blocks in a different order (the union is small and shared)."""
    from ladle.kernels._common import quantize_fp8_ref
    fp8 = torch.float8_e4m3fn
    b = build([(0, 5), (60, 8)], BS, max_blocks=8, seed=91)
    q, kc, vc = _inputs(b, 1, 16, seed=92)
    kq, vq = quantize_fp8_ref(kc, 0.5, fp8), quantize_fp8_ref(vc, 2.0, fp8)
    sel = _selection(b, 1, topk=4, seed=93)
    sel[0, 5:] = torch.tensor([[3, 0, 4, 1], [1, 4, 0, 3]], dtype=torch.int32).repeat(4, 1)
    out = msa_sparse_attention_triton(q, kq, vq, b.block_table, sel, b.positions, b.query_start_loc,
                                      query_tile=4, k_scale=0.5, v_scale=2.0)
    ref = msa_sparse_attention_ref(q.double(), kq, vq, b.block_table, sel, b.positions, b.query_start_loc,
                                   k_scale=0.5, v_scale=2.0)
    assert rel_err(out, ref) < 1e-5


def test_auto_choice_tile_for_prefill_token_for_decode(monkeypatch):
    """query_tile=None: a prefill shape runs the tile kernel, a decode shape the per-token kernel; the dispatch
    bucket names it ("tile4" / "token"); the shape rule itself at one TP4 rank's 8K prefill and B=32 decode."""
    import ladle.kernels.msa_sparse_attention as mod
    from ladle.observe import dispatch
    cpu = torch.device("cpu")
    assert mod.launch_plan(8192, 1, 1, 16, cpu) == (1, mod.TILE_TOKENS)
    assert mod.launch_plan(32, 32, 1, 16, cpu)[1] == 0
    assert mod.launch_plan(8224, 36, 1, 16, cpu) == (1, mod.TILE_TOKENS)  # 4 x 2048 prefill + 32 decodes
    tiles = spy_launches(monkeypatch, mod, "_sparse_attn_tile_kernel")
    for reqs, path, tiled in [([(0, 20)], "tile4", True), ([(40, 1), (33, 1), (70, 1)], "token", False)]:
        b = build(reqs, BS, max_blocks=8, seed=95)
        q, kc, vc = _inputs(b, 1, 4, seed=96)
        sel = _selection(b, 1, topk=3, seed=97)
        dispatch.reset()
        tiles.clear()
        out = msa_sparse_attention(q, kc, vc, b.block_table, sel, b.positions, b.query_start_loc)
        assert rel_err(out, _ref64(q, kc, vc, b, sel)) < 1e-5
        buckets = dispatch.snapshot()["ops"]["msa_sparse_attention"]["buckets"]
        assert list(buckets) == [f"{dispatch.tokens_bucket(b.num_tokens)} {path}"], buckets
        assert bool(tiles) == tiled


def test_query_tile_refusals():
    """The tile kernel has no split-K and needs a power-of-two tile: both are refused with the alternative named."""
    import ladle.kernels.msa_sparse_attention as mod
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="num_splits 1"):
        mod.launch_plan(64, 1, 1, 16, cpu, num_splits=2, query_tile=4)
    with pytest.raises(ValueError, match="power of two"):
        mod.launch_plan(64, 1, 1, 16, cpu, query_tile=3)
    assert mod.launch_plan(64, 1, 1, 16, cpu, query_tile=8) == (1, 8)
    assert mod.launch_plan(64, 1, 1, 16, cpu, query_tile=0)[1] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("tq", [0, 4, 8])
def test_gpu_tile_kernel_real_geometry(tq):
    """Block 128, head_dim 128, 16 heads per group, bf16, top-k 16: prefill from 0, a chunk over cached context and
    two decodes (tiles straddle requests), per-token (tq 0) and tile kernels vs the reference."""
    torch.manual_seed(7)
    args, ref = _real_geometry_case([(0, 300), (700, 62), (1500, 1), (2047, 1)], topk=16)
    out = torch.full_like(args[0], float("nan"))
    msa_sparse_attention_triton(*args, out=out, query_tile=tq)
    assert rel_err(out, ref) < 2e-2


def _every_code_fp8_cache(shape, seed: int) -> torch.Tensor:
    """float8_e4m3fn cache [shape] whose bytes are random finite codes, so every code occurs (NaN codes 0x7f / 0xff
    replaced by 0: the store saturates)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes)
    return codes.to(torch.uint8).view(torch.float8_e4m3fn).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("tq,num_splits", [(4, None), (0, 1), (0, 4)])
def test_gpu_fp8_bit_cast_equals_triton_cast(tq, num_splits):
    """H200, float8_e4m3fn K/V caches holding every finite code, bf16 q, per-tensor scales 0.5 / 2.0: the bit-move
    cast (`_common.cache_tile_to`, default) writes the same output bits as Triton's cast (fp8_bit_cast=False) in the
    tile kernel and the per-token kernel with and without split-K, and both match the float64 reference."""
    torch.manual_seed(11)
    args, _ = _real_geometry_case([(0, 300), (700, 62), (1500, 1), (2047, 1)], topk=16)
    q, kc, vc = args[:3]
    kc8, vc8 = _every_code_fp8_cache(kc.shape, 1), _every_code_fp8_cache(vc.shape, 2)
    q = (q * 0.01).bfloat16()  # |k| up to 448: keep the logits in a range where the softmax is not one-hot
    args = (q, kc8, vc8, *args[3:])
    outs = []
    for bit_cast in (None, False):
        out = torch.full_like(q, float("nan"))
        msa_sparse_attention_triton(*args, out=out, query_tile=tq, num_splits=num_splits, k_scale=0.5, v_scale=2.0,
                                    fp8_bit_cast=bit_cast)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = msa_sparse_attention_ref(q.double(), kc8, vc8, *args[3:], k_scale=0.5, v_scale=2.0)
    assert rel_err(outs[0], ref) < 2e-2


def test_fp8_bit_cast_refused_where_it_cannot_run():
    """fp8_bit_cast=True on the CPU interpreter or with a non-e4m3 cache is refused with the reason; None (auto)
    falls back to Triton's cast there."""
    from ladle.kernels._common import fp8_bit_cast_ineligible, resolve_fp8_bit_cast
    q = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    k8 = torch.zeros(3, 16, 1, 16, dtype=torch.float8_e4m3fn)
    assert fp8_bit_cast_ineligible(q, k8) == "no inline PTX in the interpreter"
    assert "float8_e5m2" in fp8_bit_cast_ineligible(q, k8.to(torch.float8_e5m2))
    assert resolve_fp8_bit_cast(q, k8, None) is False and resolve_fp8_bit_cast(q, k8, False) is False
    with pytest.raises(ValueError, match="fp8_bit_cast=True needs"):
        resolve_fp8_bit_cast(q, k8, True)


def test_tile_stages_fp32_single_stage():
    """The tile kernel's default stages: 3 for bf16 q over bf16 / fp8 caches, 1 when q or the cache is float32 (its
    3-stage buffers overflowed an H200's shared memory in the fp32 GPU oracle test)."""
    from ladle.kernels.msa_sparse_attention import tile_stages
    q16, q32 = torch.zeros(1, 1, 8, dtype=torch.bfloat16), torch.zeros(1, 1, 8)
    for cache_dtype, want16 in ((torch.bfloat16, 3), (torch.float8_e4m3fn, 3), (torch.float32, 1)):
        cache = torch.zeros(1, 16, 1, 8, dtype=cache_dtype)
        assert tile_stages(q16, cache) == want16 and tile_stages(q32, cache) == 1
