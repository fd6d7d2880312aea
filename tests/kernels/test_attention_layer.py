"""The `Attention` layer (ladle/layers/attention/layer.py) with an MSA indexer: the Triton backend (CPU interpreter)
against the torch references through the same layer, selection recording, and the cache spec."""

from __future__ import annotations

import torch

from ladle.layers.attention.layer import Attention, MSAParams
from ladle.layers.attention.metadata import (AttentionMetadata, ForwardContext, LayerKVCache, OpBackends,
                                             set_forward_context)
from msa_batch import as_sets, build, rel_err

BS, D, DI, HKV, G, TOPK = 16, 32, 16, 2, 2, 3
# (context, new tokens): a prefill from 0 over 3 blocks, a decode deep in, a chunk straddling a block boundary
REQS = [(0, 40), (90, 1), (20, 15)]


def _step(b, reqs) -> AttentionMetadata:
    """Metadata of one step over the msa_batch geometry (slots from the block table, host mirrors filled)."""
    qsl = b.query_start_loc.tolist()
    slots = [int(b.block_table[r, p // BS]) * BS + p % BS
             for r in range(len(reqs)) for p in b.positions[qsl[r]:qsl[r + 1]].tolist()]
    seq_lens = [c + n for c, n in reqs]
    i32 = dict(dtype=torch.int32)
    return AttentionMetadata(
        query_start_loc=b.query_start_loc, seq_lens=torch.tensor(seq_lens, **i32),
        context_lens=torch.tensor([c for c, _ in reqs], **i32), block_table=b.block_table,
        slot_mapping=torch.tensor(slots), positions=b.positions, block_size=BS, max_query_len=max(n for _, n in reqs),
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        context_lens_cpu=[c for c, _ in reqs], num_actual_tokens=qsl[-1])


def test_msa_layer_kernels_match_references_and_record_selection():
    b = build(REQS, BS, max_blocks=8)
    md = _step(b, REQS)
    g = torch.Generator().manual_seed(4)
    T = b.num_tokens
    caches = [torch.randn(b.num_blocks, BS, HKV, D, generator=g), torch.randn(b.num_blocks, BS, HKV, D, generator=g),
              torch.randn(b.num_blocks, BS, DI, generator=g)]  # earlier context: random rows everywhere
    qkv = torch.randn(T, (HKV * G + 2 * HKV) * D, generator=g)  # q, k, v as row-strided views of one output
    q, k, v = qkv.split([HKV * G * D, HKV * D, HKV * D], dim=1)
    iq, ik = torch.randn(T, HKV, DI, generator=g), torch.randn(T, DI, generator=g)
    layer = Attention(HKV * G, HKV, D, D ** -0.5, layer_idx=1, msa=MSAParams(BS, TOPK, 1, DI))
    outs, sels = [], []
    for backends in (OpBackends.reference(), OpBackends.kernels()):
        cache = LayerKVCache(*[c.clone() for c in caches])
        ctx = ForwardContext(md, [LayerKVCache(*caches), cache], backends=backends,
                             extras={"record_msa_selection": True})
        with set_forward_context(ctx):
            outs.append(layer(q, k, v, iq, ik))
        sels.append(ctx.extras["msa_selected_block_ids"][1])
        assert list(ctx.extras["msa_selected_block_ids"]) == [1]
        slots = md.slot_mapping
        assert torch.equal(cache.key_cache.view(-1, HKV, D)[slots], k.view(T, HKV, D))
        assert torch.equal(cache.index_key_cache.view(-1, DI)[slots], ik)
    assert outs[0].shape == (T, HKV * G * D) and sels[0].shape == (HKV, T, TOPK) and sels[0].dtype == torch.int32
    assert as_sets(sels[0]) == as_sets(sels[1])
    assert rel_err(outs[1], outs[0]) < 1e-5
    assert rel_err(outs[0][:40], outs[0][:40].roll(1, 0)) > 0.1  # not a constant output


def test_cache_spec():
    assert Attention(8, 2, 64, 0.125, 0).kv_cache_spec().index_head_dim == 0
    spec = Attention(8, 2, 64, 0.125, 3, msa=MSAParams(128, 16, 1, 128)).kv_cache_spec()
    assert (spec.num_kv_heads, spec.head_dim, spec.index_head_dim) == (2, 64, 128)
