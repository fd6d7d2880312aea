"""Tensor-parallel shards of the layer kit (ladle/layers/linear.py, vocab_parallel_embedding.py, moe.py) on the CPU.

Each test draws random FULL checkpoint weights, builds the layer for every rank of tp_size 2 and 4 with its
weight_loader slicing that rank's part, and checks that concatenating the ranks' outputs (column-parallel, LM head)
or summing their partial outputs (row-parallel, embedding, MoE) gives the unsharded result computed in float64.
"""

from __future__ import annotations

import pytest
import torch

from ladle.kernels.fused_moe import fused_moe_ref
from ladle.kernels.moe_router import moe_router_ref
from ladle.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                 RowParallelLinear, head_shard)
from ladle.layers.moe import FusedMoE
from ladle.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

F64 = dict(dtype=torch.float64, device="cpu")


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _load(param, tensor, **kw):
    return param.weight_loader(param, tensor, **kw)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_concat_equals_full(tp):
    w, b, x = _rand(24, 10, seed=1), _rand(24, seed=2), _rand(5, 10, seed=3)
    outs = []
    for r in range(tp):
        layer = ColumnParallelLinear(10, 24, bias=True, tp_rank=r, tp_size=tp, **F64)
        assert _load(layer.weight, w) == 24 // tp * 10 and _load(layer.bias, b) == 24 // tp
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), x @ w.T + b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tp", [2, 4])
def test_merged_column_shards_split_per_piece(tp):
    gate, up, x = _rand(16, 12, seed=4), _rand(16, 12, seed=5), _rand(3, 12, seed=6)
    gates, ups = [], []
    for r in range(tp):
        layer = MergedColumnParallelLinear(12, [16, 16], tp_rank=r, tp_size=tp, **F64)
        _load(layer.weight, gate, shard_id=0)
        _load(layer.weight, up, shard_id=1)
        fused = MergedColumnParallelLinear(12, [16, 16], tp_rank=r, tp_size=tp, **F64)
        _load(fused.weight, torch.cat([gate, up]))  # a checkpoint that stores gate_up merged: shard_id None
        assert torch.equal(fused.weight, layer.weight)
        g, u = layer.split(layer(x))
        gates.append(g)
        ups.append(u)
    torch.testing.assert_close(torch.cat(gates, -1), x @ gate.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat(ups, -1), x @ up.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tp", [2, 4])
def test_qkv_heads_split_and_kv_heads_replicated(tp):
    """8 query heads, 2 KV heads (replicated at tp 4), plus M3-style extra shards: 2 index-q heads and 1 index-k
    head (held by every rank)."""
    hidden, d, di = 16, 4, 3
    full = {"q": _rand(8 * d, hidden, seed=7), "k": _rand(2 * d, hidden, seed=8), "v": _rand(2 * d, hidden, seed=9),
            "iq": _rand(2 * di, hidden, seed=10), "ik": _rand(di, hidden, seed=11)}
    bias = {s: _rand(t.shape[0], seed=20 + i) for i, (s, t) in enumerate(full.items())}
    x = _rand(6, hidden, seed=12)
    want = {s: (x @ w.T + bias[s]).view(6, -1, di if s in ("iq", "ik") else d) for s, w in full.items()}
    qs = []
    for r in range(tp):
        layer = QKVParallelLinear(hidden, d, 8, 2, bias=True, extra_heads={"iq": (2, di), "ik": (1, di)},
                                  tp_rank=r, tp_size=tp, **F64)
        for s, w in full.items():
            _load(layer.weight, w, shard_id=s)
        for s, b in bias.items():
            _load(layer.bias, b, shard_id=s)
        q, k, v, iq, ik = layer.split(layer(x))
        assert layer.num_heads == 8 // tp and layer.num_kv_heads == max(1, 2 // tp)
        qs.append(q)
        kv0, nkv = head_shard(2, r, tp)
        assert (kv0, nkv) == ((r // 2, 1) if tp == 4 else (r, 1))
        torch.testing.assert_close(k.view(6, nkv, d), want["k"][:, kv0:kv0 + nkv], rtol=0, atol=1e-12)
        torch.testing.assert_close(v.view(6, nkv, d), want["v"][:, kv0:kv0 + nkv], rtol=0, atol=1e-12)
        torch.testing.assert_close(iq.view(6, nkv, di), want["iq"][:, kv0:kv0 + nkv], rtol=0, atol=1e-12)
        torch.testing.assert_close(ik.view(6, 1, di), want["ik"], rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat(qs, -1), want["q"].reshape(6, -1), rtol=0, atol=1e-12)


def test_qkv_loader_rejects_bad_pieces():
    layer = QKVParallelLinear(16, 4, 4, 2, **F64)
    with pytest.raises(ValueError, match="shape"):
        _load(layer.weight, _rand(4 * 4, 16, seed=1), shard_id="k")
    with pytest.raises(ValueError, match="unknown shard"):
        _load(layer.weight, _rand(3, 16, seed=1), shard_id="iq")
    with pytest.raises(ValueError, match="split evenly"):
        QKVParallelLinear(16, 4, 4, 3, tp_size=2, **F64)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_partial_sums_add_up(tp):
    w, b, x = _rand(7, 20, seed=13), _rand(7, seed=14), _rand(4, 20, seed=15)
    n = 20 // tp
    parts = []
    for r in range(tp):
        layer = RowParallelLinear(20, 7, bias=True, tp_rank=r, tp_size=tp, reduce_results=False, **F64)
        _load(layer.weight, w)
        _load(layer.bias, b)
        parts.append(layer(x[:, r * n:(r + 1) * n]))  # rank r sees its slice of the column-parallel input
    torch.testing.assert_close(sum(parts), x @ w.T + b, rtol=0, atol=1e-12)
    reducing = RowParallelLinear(20, 7, tp_rank=0, tp_size=tp, **F64)
    with pytest.raises(RuntimeError, match="all-reduce"):  # no tensor-parallel group in this process
        reducing(x[:, :n])


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_embedding_and_lm_head_shards(tp):
    vocab, dim = 37, 6  # 37 rows do not split evenly: the last rank carries zero padding
    table, h = _rand(vocab, dim, seed=16), _rand(5, dim, seed=17)
    ids = torch.tensor([0, 36, 9, 18, 19, 27, 5])
    embeds, logits = [], []
    for r in range(tp):
        emb = VocabParallelEmbedding(vocab, dim, tp_rank=r, tp_size=tp, reduce_results=False, **F64)
        head = ParallelLMHead(vocab, dim, tp_rank=r, tp_size=tp, **F64)
        _load(emb.weight, table)
        _load(head.weight, table)
        embeds.append(emb(ids))
        logits.append(head.partial_logits(h))
    assert torch.equal(sum(embeds), table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], h @ table.T, rtol=0, atol=1e-12)
    one = ParallelLMHead(vocab, dim, **F64)
    _load(one.weight, table)
    torch.testing.assert_close(one.compute_logits(h), h @ table.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_moe_intermediate_split_sums_to_full(tp):
    """E=4 routed experts (top 2) + the folded shared expert, I=8 split over ranks; every rank routes the same."""
    hidden, e, inter = 16, 4, 8
    g = torch.Generator().manual_seed(18)
    w1, w3 = torch.randn(e + 1, inter, hidden, generator=g) * 0.3, torch.randn(e + 1, inter, hidden, generator=g) * 0.3
    w2 = torch.randn(e + 1, hidden, inter, generator=g) * 0.3
    router, bias = torch.randn(e, hidden, generator=g), torch.randn(e, generator=g) * 0.5
    x = torch.randn(9, hidden, generator=g)
    parts = []
    for r in range(tp):
        moe = FusedMoE(hidden, e, 2, inter, inter, 2.0, dtype=torch.float32, device="cpu", tp_rank=r, tp_size=tp,
                       reduce_results=False)
        _load(moe.gate_weight, router)
        _load(moe.e_score_correction_bias, bias)
        for j in range(e + 1):  # release layout: one tensor per expert and projection
            eid = j if j < e else "shared"
            _load(moe.w13, w1[j], shard_id="w1", expert_id=eid)
            _load(moe.w13, w3[j], shard_id="w3", expert_id=eid)
            _load(moe.w2, w2[j], shard_id="w2", expert_id=eid)
        fused = FusedMoE(hidden, e, 2, inter, inter, 2.0, dtype=torch.float32, device="cpu", tp_rank=r, tp_size=tp)
        _load(fused.w13, torch.cat([w1[:e], w3[:e]], dim=1), shard_id="w13")  # transformers' [E, 2I, H] table
        _load(fused.w2, w2[:e], shard_id="w2")
        assert torch.equal(fused.w13[:e], moe.w13[:e]) and torch.equal(fused.w2[:e], moe.w2[:e])
        assert moe.w13.shape == (e + 1, 2 * inter // tp, hidden) and moe.w2.shape == (e + 1, hidden, inter // tp)
        parts.append(moe(x))
    ids, wts = moe_router_ref(x, router, bias, 2, 2.0, shared_expert=True)
    want = fused_moe_ref(x.double(), torch.cat([w1, w3], 1).double(), w2.double(), ids, wts)
    torch.testing.assert_close(sum(parts).double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expert"):
        _load(moe.w2, w2[0], shard_id="w2", expert_id=e)  # expert E is the shared row: only as "shared"
