"""Paged attention reference for MiniMax-M3: dense causal layers and MSA block-sparse layers.

Plain torch, one loop iteration per request. Every path (prefill, chunked prefill, prefix hit, decode) reads
K, V and index-K back *through the block table* after writing this step's rows, so the cache layout is exercised
the same way whatever the step looks like.

Cache layout (ladle/layers/attention/metadata.py): K/V [num_blocks, block_size, num_kv_heads, head_dim],
index-K [num_blocks, block_size, index_head_dim]; slot = block_id * block_size + offset; slot -1 = padding.
The KV block size equals the MSA block size, so logical block b of a sequence is `block_table[req, b]` for K, V
and index-K alike, and a token's sequence index equals its absolute position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.layers.attention.metadata import AttentionMetadata, LayerKVCache
from ladle.layers.attention.msa import msa_block_scores, msa_select_blocks, selection_key_mask
from ladle.layers.attention.paged_ref import gather_sequence


@dataclass(frozen=True)
class MSAParams:
    """Indexer geometry of a sparse layer."""

    block_size: int
    topk_blocks: int
    local_blocks: int


def write_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [num_blocks, block_size, *row_shape]; slot_mapping [T] int (-1 = skip); rows [T, *row_shape]."""
    flat = cache.view(-1, *cache.shape[2:])
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    flat.index_copy_(0, slots, rows[valid].to(cache.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, nh, d], k/v [S, nkv, d], mask [nkv or 1, Tq, S] bool (True = attend) -> [Tq, nh, d].

    Query head h reads kv head h // (nh / nkv). QKᵀ in the activation dtype, softmax in float32, cast back before
    PV (transformers eager_attention_forward).
    """
    tq, nh, d = q.shape
    nkv = k.shape[1]
    qg = q.view(tq, nkv, nh // nkv, d).permute(1, 2, 0, 3)  # [nkv, G, Tq, d]
    kt = k.permute(1, 2, 0)  # [nkv, d, S]
    logits = torch.matmul(qg, kt[:, None]) * scale  # [nkv, G, Tq, S]
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v.permute(1, 0, 2)[:, None])  # [nkv, G, Tq, d]
    return out.permute(2, 0, 1, 3).reshape(tq, nh, d)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    md: AttentionMetadata, scale: float, index_q: torch.Tensor | None = None,
                    index_k: torch.Tensor | None = None, msa: MSAParams | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One layer's attention over the paged cache, after writing this step's K/V (and index-K).

    q [T, nh, d], k/v [T, nkv, d] post-norm post-RoPE (v raw); index_q [T, ni, di], index_k [T, di] for sparse
    layers (msa given), else None. Mutates the cache rows at `md.slot_mapping`.
    Returns (out [T, nh, d], selected_block_ids [nkv, T, topk] int32 or None). Padding tokens (outside
    query_start_loc) get zeros and -1 selections.
    """
    write_cache(cache.key_cache, md.slot_mapping, k)
    write_cache(cache.value_cache, md.slot_mapping, v)
    sparse = msa is not None
    if sparse:
        assert cache.index_key_cache is not None and index_q is not None and index_k is not None
        assert md.block_size == msa.block_size == cache.key_cache.shape[1], \
            f"KV block size {md.block_size} must equal the MSA block size {msa.block_size}"
        write_cache(cache.index_key_cache, md.slot_mapping, index_k)
    t_all, nh, d = q.shape
    nkv = k.shape[1]
    out = torch.zeros_like(q)
    selected = None
    if sparse:
        selected = torch.full((nkv, t_all, msa.topk_blocks), -1, dtype=torch.int32, device=q.device)
    qsl = md.query_start_loc_cpu
    for r in range(md.num_reqs):
        t0, t1 = qsl[r], qsl[r + 1]
        if t1 == t0:
            continue
        s = md.seq_lens_cpu[r]
        blocks = md.block_table[r]
        pos = md.positions[t0:t1]
        k_seq = gather_sequence(cache.key_cache, blocks, s)
        v_seq = gather_sequence(cache.value_cache, blocks, s)
        causal = torch.arange(s, device=q.device)[None, :] <= pos[:, None]  # [Tq, S]
        if sparse:
            ik_seq = gather_sequence(cache.index_key_cache, blocks, s)
            bscores = msa_block_scores(index_q[t0:t1], ik_seq, pos, msa.block_size)
            sel = msa_select_blocks(bscores, pos, msa.block_size, msa.topk_blocks, msa.local_blocks)
            selected[:, t0:t1] = sel
            mask = selection_key_mask(sel, s, msa.block_size) & causal[None]
        else:
            mask = causal[None]
        out[t0:t1] = _attend(q[t0:t1], k_seq, v_seq, mask, scale)
    return out, selected


def paged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                           md: AttentionMetadata, scale: float, index_q: torch.Tensor | None = None,
                           index_k: torch.Tensor | None = None, msa: MSAParams | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `paged_attention`, through ladle.kernels (Triton where eligible, each op recording its
    dispatch). Graph-safe: no host mirrors, no host syncs. Selections come from the kernel indexer, whose
    non-local entries are in score order (still the documented layout: left-packed, local block last, -1 after).
    The kernel indexer forces only the query's own block, so it serves local_blocks == 1 (M3) only."""
    from ladle.kernels.kv_store import store_index_kcache, store_kvcache
    from ladle.kernels.msa_indexer import msa_indexer
    from ladle.kernels.msa_sparse_attention import msa_sparse_attention
    from ladle.kernels.paged_attention import paged_attention as dense_paged_attention

    store_kvcache(k, v, cache.key_cache, cache.value_cache, md.slot_mapping)
    if msa is None:
        return dense_paged_attention(q, cache.key_cache, cache.value_cache, md, scale), None
    assert msa.local_blocks == 1, "kernel indexer forces the own block only"
    assert md.block_size == msa.block_size == cache.key_cache.shape[1]
    store_index_kcache(index_k.contiguous(), cache.index_key_cache, md.slot_mapping)
    selected = msa_indexer(index_q.contiguous(), cache.index_key_cache, md.block_table, md.positions,
                           md.query_start_loc, msa.topk_blocks)
    out = msa_sparse_attention(q.contiguous(), cache.key_cache, cache.value_cache, md.block_table, selected,
                               md.positions, md.query_start_loc, scale)
    return out, selected
