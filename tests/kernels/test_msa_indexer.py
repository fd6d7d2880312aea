"""MSA indexer (ladle/kernels/msa_indexer.py): Triton kernel vs the float64 torch reference, and the output layout
checked against its definition (ARCHITECTURE.md "MSA selection")."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels.msa_indexer import msa_indexer, msa_indexer_ref, msa_indexer_triton
from ladle.observe import dispatch
from msa_batch import as_sets, build, spy_launches

BS, D = 16, 32
# (context, new tokens): prefill from 0 over 3 blocks; decode deep in; chunk straddling blocks; decode at the
# last slot of block 0 (pos 15); decode at the first slot of block 1 (pos 16); decode at a later boundary (pos 48)
RAGGED = [(0, 40), (100, 1), (60, 20), (15, 1), (16, 1), (48, 1)]


def _check_layout(sel: torch.Tensor, positions: torch.Tensor, topk: int, total: int) -> None:
    """Every row: exactly min(topk, p//BS+1) distinct valid ids, left-packed, local block last valid, -1 after."""
    H, T, _ = sel.shape
    for h in range(H):
        for t in range(T):
            row = sel[h, t].tolist()
            p = int(positions[t])
            if p < 0 or t >= total:
                assert row == [-1] * topk
                continue
            n = min(topk, p // BS + 1)
            assert row[n:] == [-1] * (topk - n), row
            assert len(set(row[:n])) == n and all(0 <= b <= p // BS for b in row[:n]), row
            assert row[n - 1] == p // BS, f"local block must be last valid: {row}"


@pytest.mark.parametrize("num_splits,vec_search", [(1, True), (3, False)])
def test_ragged_integer_scores_exact(num_splits, vec_search, monkeypatch):
    """Small-integer data: every score is exact in fp32, many exact ties; tie rule (lower id wins) is shared, so
    the kernel must equal the reference slot for slot."""
    import ladle.kernels.msa_indexer as mod
    monkeypatch.setattr(mod, "VEC_SEARCH_MAX_REQS", 4096 if vec_search else 0)  # else: binary-search path
    torch.manual_seed(1)
    b = build(RAGGED, BS, max_blocks=8, pad_tokens=2)
    T, H, topk = b.num_tokens, 2, 4
    q = torch.randint(-2, 3, (T, H, D)).float()
    kc = torch.randint(-2, 3, (b.num_blocks, BS, D)).float()
    out = torch.full((H, T, topk), 77, dtype=torch.int32)  # poisoned
    msa_indexer_triton(q, kc, b.block_table, b.positions, b.query_start_loc, topk, num_splits=num_splits, out=out)
    ref = msa_indexer_ref(q, kc, b.block_table, b.positions, b.query_start_loc, topk)
    _check_layout(out, b.positions, topk, int(b.query_start_loc[-1]))
    assert torch.equal(out, ref)


def test_random_fp32_sets_and_bf16():
    """Random scores (fp32) compared as sets; bf16 with integer-valued data (exact products) compared as sets."""
    torch.manual_seed(2)
    b = build(RAGGED, BS, max_blocks=8)
    T, H, topk = b.num_tokens, 2, 3
    q = torch.randn(T, H, D)
    kc = torch.randn(b.num_blocks, BS, D)
    out = msa_indexer_triton(q, kc, b.block_table, b.positions, b.query_start_loc, topk)
    ref = msa_indexer_ref(q, kc, b.block_table, b.positions, b.query_start_loc, topk)
    assert as_sets(out) == as_sets(ref)
    _check_layout(out, b.positions, topk, T)
    qb = torch.randint(-3, 4, (T, H, D)).bfloat16()
    kb = torch.randint(-3, 4, (b.num_blocks, BS, D)).bfloat16()
    out = msa_indexer_triton(qb, kb, b.block_table, b.positions, b.query_start_loc, topk)
    ref = msa_indexer_ref(qb, kb, b.block_table, b.positions, b.query_start_loc, topk)
    assert as_sets(out) == as_sets(ref)


def test_layout_trap_tokens_equal_heads():
    """num_tokens == num_kv_heads: a [T, H] vs [H, T] mix-up has the right shape, so only values catch it. The two
    groups' queries are built to pick different blocks."""
    torch.manual_seed(3)
    b = build([(90, 1), (70, 1)], BS, max_blocks=8)
    H, topk = 2, 2
    kc = torch.zeros(b.num_blocks, BS, D)
    q = torch.zeros(2, H, D)
    bt = b.block_table
    # token 0 (req 0, local block 5): group 0 likes block 1, group 1 likes block 3; token 1 (req 1, local 4):
    # group 0 likes block 2, group 1 likes block 0.
    for r, tok, pref in ((0, 0, (1, 3)), (1, 1, (2, 0))):
        for g, blk in enumerate(pref):
            kc[bt[r, blk], 0, g] = 10.0
            q[tok, g, g] = 1.0
    out = msa_indexer_triton(q, kc, bt, b.positions, b.query_start_loc, topk)
    expect = torch.tensor([[[1, 5], [2, 4]], [[3, 5], [0, 4]]], dtype=torch.int32)
    assert torch.equal(out, expect)
    assert torch.equal(msa_indexer_ref(q, kc, bt, b.positions, b.query_start_loc, topk), expect)


def test_fewer_blocks_than_topk_and_ties_lower_id_wins():
    """All scores equal: the lowest ids win; contexts with fewer visible blocks than topk select all of them."""
    b = build([(0, 1), (20, 1), (79, 1)], BS, max_blocks=8)
    q = torch.ones(3, 1, D)
    kc = torch.ones(b.num_blocks, BS, D)
    out = msa_indexer_triton(q, kc, b.block_table, b.positions, b.query_start_loc, 3)
    assert out[0].tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 4]]


def test_dispatch_records_executed():
    dispatch.reset()
    b = build([(5, 3)], BS, max_blocks=2)
    q = torch.randn(3, 1, D)
    kc = torch.randn(b.num_blocks, BS, D)
    msa_indexer(q, kc, b.block_table, b.positions, b.query_start_loc, 2)
    row = dispatch.snapshot()["ops"]["msa_indexer"]["buckets"]["T<=4"]
    assert row["executed"] == 1


@pytest.mark.gpu
def test_gpu_real_block_size_and_graph():
    """Real geometry (block 128, dim 128, bf16) vs the reference as sets; CUDA-graph replay equals eager."""
    torch.manual_seed(4)
    bs = 128
    b = build([(0, 300), (1000, 1), (2047, 1), (640, 64)], bs, max_blocks=17, device="cuda")
    T, topk = b.num_tokens, 4
    q = torch.randint(-3, 4, (T, 1, 128), device="cuda").bfloat16()
    kc = torch.randint(-3, 4, (b.num_blocks, bs, 128), device="cuda").bfloat16()
    args = (q, kc, b.block_table, b.positions, b.query_start_loc, topk)
    out = msa_indexer_triton(*args)
    assert as_sets(out) == as_sets(msa_indexer_ref(*args))
    static = torch.full_like(out, 99)
    g = torch.cuda.CUDAGraph()
    msa_indexer_triton(*args, out=static)
    with torch.cuda.graph(g):
        msa_indexer_triton(*args, out=static)
    static.fill_(99)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)


def test_agrees_with_model_reference_selection():
    """Cross-check with the reference's building blocks applied to the contiguous (unpaged) key sequence
    (`msa_block_scores` + `msa_select_blocks`, the selection the M3 model's torch path runs): same sets per
    (group, token)."""
    import ladle.kernels.msa_indexer as msa
    torch.manual_seed(7)
    b = build([(0, 70)], BS, max_blocks=5)
    T, H, topk = b.num_tokens, 2, 3
    q = torch.randn(T, H, D)
    kc = torch.randn(b.num_blocks, BS, D)
    keys = kc[b.block_table[0].long()].reshape(-1, D)[:T]
    scores = msa.msa_block_scores(q, keys, b.positions, BS)
    theirs = msa.msa_select_blocks(scores, b.positions, BS, topk, 1)
    out = msa_indexer_triton(q, kc, b.block_table, b.positions, b.query_start_loc, topk)
    assert as_sets(out) == as_sets(theirs)


def test_long_context_iterative_topk_path():
    """More than 128 blocks per row switches the top-k from the one-pass rank count to repeated argmax."""
    torch.manual_seed(8)
    b = build([(2050, 1), (1500, 1), (200, 1)], BS, max_blocks=130)
    q = torch.randint(-2, 3, (3, 1, D)).float()
    kc = torch.randint(-2, 3, (b.num_blocks, BS, D)).float()
    args = (q, kc, b.block_table, b.positions, b.query_start_loc, 5)
    out = msa_indexer_triton(*args)
    assert torch.equal(out, msa_indexer_ref(*args))
    _check_layout(out, b.positions, 5, 3)


# ---- fused top-k (last split program selects) vs the two-launch path ------------------------------------------
# small ragged batch: prefill from 0 (2 blocks), decode deep in, chunk straddling blocks, decodes at the last slot of
# block 0 and the first of block 1 (fewer visible blocks than top-k), decode at a later boundary; 2 padding tokens
SMALL_RAGGED = [(0, 20), (100, 1), (40, 9), (15, 1), (16, 1), (48, 1)]
VARIANTS = [pytest.param(f, v, id=f"{'fused' if f else 'two_launch'}-{'vec' if v else 'bsearch'}")
            for f in (True, False) for v in (True, False)]


def _counters_zero() -> bool:
    from ladle.kernels.split_counters import split_counters
    return int(split_counters("msa_indexer", torch.device("cpu"), 1).abs().sum()) == 0


@pytest.mark.parametrize("fused,vec,num_splits", [
    (True, True, 4), (True, False, 4), (True, True, 1), (False, False, 4), (False, True, 1)])
def test_variants_ragged_consecutive_calls(fused, vec, num_splits):
    """Ragged prefill + decode + padding with small-integer data (exact fp32 scores, many ties: lower id wins), two
    consecutive calls with fresh data into a poisoned output: each equals the reference slot for slot. A counter left
    non-zero by call 1 would leave call 2's rows unwritten (poison), so this also proves the reset; the counter
    buffer is checked to be all zero afterwards."""
    b = build(SMALL_RAGGED, BS, max_blocks=8, pad_tokens=2, seed=11)
    T, H, topk = b.num_tokens, 2, 4
    g = torch.Generator().manual_seed(12 + num_splits)
    for call in range(2):
        q = torch.randint(-2, 3, (T, H, D), generator=g).float()
        kc = torch.randint(-2, 3, (b.num_blocks, BS, D), generator=g).float()
        out = torch.full((H, T, topk), 77 + call, dtype=torch.int32)
        msa_indexer_triton(q, kc, b.block_table, b.positions, b.query_start_loc, topk, num_splits=num_splits,
                           out=out, fused_topk=fused, vec_search=vec)
        ref = msa_indexer_ref(q, kc, b.block_table, b.positions, b.query_start_loc, topk)
        _check_layout(out, b.positions, topk, int(b.query_start_loc[-1]))
        assert torch.equal(out, ref), f"call {call}"
    assert _counters_zero()


@pytest.mark.parametrize("fused,vec", VARIANTS)
def test_variants_decode_random_and_tokens_equal_heads(fused, vec):
    """Decode-shaped launches (one token per request, the fused default): random fp32 data compared as sets with
    the reference over 7 requests at assorted depths (some with fewer blocks than top-k), then T == H == 2 with
    random data compared slot for slot (catches a [T, H] / [H, T] mix-up), repeated to exercise the reset."""
    g = torch.Generator().manual_seed(21)
    b = build([(5, 1), (16, 1), (31, 1), (70, 1), (127, 1), (64, 1), (99, 1)], BS, max_blocks=8, seed=22)
    T, H, topk = b.num_tokens, 1, 3
    for _ in range(2):
        q = torch.randn(T, H, D, generator=g)
        kc = torch.randn(b.num_blocks, BS, D, generator=g)
        out = msa_indexer_triton(q, kc, b.block_table, b.positions, b.query_start_loc, topk, num_splits=8,
                                 fused_topk=fused, vec_search=vec)
        assert as_sets(out) == as_sets(msa_indexer_ref(q, kc, b.block_table, b.positions, b.query_start_loc, topk))
        _check_layout(out, b.positions, topk, T)
    b2 = build([(90, 1), (77, 1)], BS, max_blocks=8, seed=23)
    for _ in range(2):
        q = torch.randint(-3, 4, (2, 2, D), generator=g).float()
        kc = torch.randint(-3, 4, (b2.num_blocks, BS, D), generator=g).float()
        args = (q, kc, b2.block_table, b2.positions, b2.query_start_loc, 3)
        out = msa_indexer_triton(*args, num_splits=2, fused_topk=fused, vec_search=vec)
        ref = msa_indexer_ref(*args)
        assert torch.equal(out, ref)
        assert not torch.equal(ref[0], ref[1]), "test data must give the two groups different selections"
    assert _counters_zero()


def test_default_variant_choice(monkeypatch):
    """fused_topk=None: decode-shaped (T <= B) launches never launch `_index_topk_kernel`; others do; the module
    flag FUSED_TOPK=False restores the two-launch path everywhere."""
    import ladle.kernels.msa_indexer as mod
    launched = spy_launches(monkeypatch, mod, "_index_topk_kernel")
    g = torch.Generator().manual_seed(31)
    dec = build([(40, 1), (70, 1)], BS, max_blocks=8, seed=32)
    pre = build([(0, 5)], BS, max_blocks=8, seed=33)
    for bb, expect_two_launch in ((dec, False), (pre, True)):
        q = torch.randn(bb.num_tokens, 1, D, generator=g)
        kc = torch.randn(bb.num_blocks, BS, D, generator=g)
        args = (q, kc, bb.block_table, bb.positions, bb.query_start_loc, 2)
        launched.clear()
        assert as_sets(msa_indexer_triton(*args)) == as_sets(msa_indexer_ref(*args))
        assert bool(launched) == expect_two_launch
    monkeypatch.setattr(mod, "FUSED_TOPK", False)
    launched.clear()
    q = torch.randn(dec.num_tokens, 1, D, generator=g)
    kc = torch.randn(dec.num_blocks, BS, D, generator=g)
    msa_indexer_triton(q, kc, dec.block_table, dec.positions, dec.query_start_loc, 2)
    assert launched


@pytest.mark.gpu
def test_gpu_fused_decode_graph_replays():
    """Decode-shaped launch (fused top-k by default) at real geometry, integer data (exact scores, ties by lower id):
    eager equals the reference slot for slot and the two-launch path, and three CUDA-graph replays into a
    re-poisoned output each equal eager (the counters reset on the device)."""
    torch.manual_seed(9)
    bs = 128
    g = torch.Generator().manual_seed(9)
    ctx = torch.randint(1, 17 * bs - 1, (24,), generator=g).tolist()
    b = build([(c, 1) for c in ctx], bs, max_blocks=17, device="cuda")
    q = torch.randint(-3, 4, (b.num_tokens, 1, 128), device="cuda").bfloat16()  # exact integer scores
    kc = torch.randint(-3, 4, (b.num_blocks, bs, 128), device="cuda").bfloat16()
    args = (q, kc, b.block_table, b.positions, b.query_start_loc, 16)
    out = msa_indexer_triton(*args)
    assert torch.equal(out.cpu(), msa_indexer_ref(*args).cpu())
    assert torch.equal(out, msa_indexer_triton(*args, fused_topk=False))
    static = torch.empty_like(out)
    msa_indexer_triton(*args, out=static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        msa_indexer_triton(*args, out=static)
    for poison in (99, -5, 7):
        static.fill_(poison)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, out)


@pytest.mark.parametrize("local_blocks", [1, 2, 3])
def test_reference_local_blocks_against_brute_force(local_blocks):
    """The reference on a paged ragged batch vs a per-token float64 brute force of the definition: the blocks
    b_t - l (l < local_blocks) are forced, the rest are the best block maxima, ascending layout. local_blocks > 1 is
    not the kernel's case: the entry point records the fallback and runs the reference."""
    torch.manual_seed(11)
    b = build(RAGGED, BS, max_blocks=8, pad_tokens=2)
    T, H, topk = b.num_tokens, 2, 4
    q = torch.randn(T, H, D)
    kc = torch.randn(b.num_blocks, BS, D)
    qsl = b.query_start_loc.tolist()
    want = torch.full((H, T, topk), -1, dtype=torch.int32)
    for r in range(len(qsl) - 1):
        keys = kc[b.block_table[r].long()].reshape(-1, D).double()
        for t in range(qsl[r], qsl[r + 1]):
            p = int(b.positions[t])
            own = p // BS
            forced = {blk for blk in range(own - local_blocks + 1, own + 1) if blk >= 0}
            n = min(topk, own + 1)
            for h in range(H):
                s = keys[: p + 1] @ q[t, h].double()
                block_max = {blk: s[blk * BS: (blk + 1) * BS].max().item() for blk in range(own + 1)}
                others = sorted((blk for blk in block_max if blk not in forced), key=lambda x: (-block_max[x], x))
                chosen = sorted(forced | set(others[: n - len(forced)]))
                want[h, t, :n] = torch.tensor(chosen, dtype=torch.int32)
    dispatch.reset()
    got = msa_indexer(q, kc, b.block_table, b.positions, b.query_start_loc, topk, local_blocks=local_blocks)
    assert torch.equal(got, want)
    (row,) = dispatch.snapshot()["ops"]["msa_indexer"]["buckets"].values()
    assert row["configured"] == 1 and row["executed"] == int(local_blocks == 1)
    _check_layout(got, b.positions, topk, int(b.query_start_loc[-1]))
