"""Torch reference for the paged KV store and paged causal attention (the oracle for every kernel).

Cache layout (ARCHITECTURE.md): K and V are `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous.
A token's cache slot is `block_id * block_size + offset`; flattening the first two dims gives the slot index:

    key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slot]

Request i's context (cached tokens followed by this step's new tokens, seq_lens[i] in all) lives in the
blocks block_table[i, 0 : ceil(seq_lens[i] / block_size)], in order:

    logical token j  ->  block_table[i, j // block_size] * block_size + j % block_size

Query token t of request i (t = 0 .. q_len-1, q_len = query_start_loc[i+1] - query_start_loc[i]) is logical
token `context_len + t` with `context_len = seq_lens[i] - q_len`, and attends to logical keys 0 .. context_len + t
(causal). Prefill, chunked prefill, prefix-cache hits and decode are all this one rule.
"""

from __future__ import annotations

import torch

from ladle.layers.attention.metadata import AttentionMetadata

# The batched decode path gathers [B, max_seq_len, num_kv_heads, head_dim] at once; above this many elements
# it falls back to the per-request loop to bound memory.
_MAX_BATCHED_GATHER_ELEMS = 1 << 26


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's K/V into the paged cache. Mutates key_cache and value_cache in place.

    key, value [T, num_kv_heads, head_dim] any float dtype (cast to the cache dtype);
    slot_mapping [>= T] int32/int64, -1 = padding token (skipped).
    Sync-free (no boolean indexing): a padding row rewrites slot 0 with its own current contents. Slot 0
    belongs to block 0, the null block that is never allocated to a request, so this is a no-op write.
    """
    num_tokens = key.shape[0]
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "KV cache tensors must be contiguous"
    _, _, num_kv_heads, head_dim = key_cache.shape
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping[:num_tokens].to(torch.int64)
    valid = (slots >= 0).view(-1, 1, 1)
    idx = torch.where(slots >= 0, slots, torch.zeros_like(slots))
    k_src = torch.where(valid, key.to(flat_k.dtype), flat_k[0])
    v_src = torch.where(valid, value.to(flat_v.dtype), flat_v[0])
    flat_k.index_copy_(0, idx, k_src)
    flat_v.index_copy_(0, idx, v_src)


def _host_lists(md: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(query_start_loc, seq_lens) as Python lists, from the host mirrors when the runner filled them."""
    qsl = md.query_start_loc_cpu or md.query_start_loc.tolist()
    seq_lens = md.seq_lens_cpu or md.seq_lens.tolist()
    return [int(x) for x in qsl], [int(x) for x in seq_lens]


def gather_sequence(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [num_blocks, block_size, *row] + block_ids [>= ceil(seq_len/bs)] -> [seq_len, *row] (logical order,
    positions 0..seq_len-1). Shared by the dense reference here and the MSA reference (K, V and index-K)."""
    bs = cache.shape[1]
    nb = -(-seq_len // bs)
    rows = cache.index_select(0, block_ids[:nb].long())
    return rows.reshape(nb * bs, *cache.shape[2:])[:seq_len]


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """q [n_q, Hq, D], k/v [L, Hkv, D] (L = context_len + n_q) -> [n_q, Hq, D] float32. Softmax in float32."""
    n_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    kf = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # [Hq, n_q, L]
    q_pos = torch.arange(n_q, device=q.device) + context_len
    k_pos = torch.arange(seq_len, device=q.device)
    causal = k_pos.view(1, -1) <= q_pos.view(-1, 1)  # [n_q, L]
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf)


def _decode_batched(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    num_reqs: int,
    scale: float,
) -> torch.Tensor:
    """Decode-only steps (one query per request, query i = token i): one gather and one masked softmax for the
    whole batch, no per-request loop and no host sync. Returns [num_reqs, Hq, D] float32."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    num_blocks = (md.max_seq_len + block_size - 1) // block_size
    block_ids = md.block_table[:num_reqs, :num_blocks].to(torch.int64)  # [B, nb]
    k = key_cache[block_ids].reshape(num_reqs, -1, num_kv_heads, head_dim).float()  # [B, nb*bs, Hkv, D]
    v = value_cache[block_ids].reshape(num_reqs, -1, num_kv_heads, head_dim).float()
    qg = q[:num_reqs].float().view(num_reqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bkhd->bhgk", qg, k) * scale  # [B, Hkv, group, nb*bs]
    k_pos = torch.arange(k.shape[1], device=q.device).view(1, -1)
    valid = (k_pos < md.seq_lens[:num_reqs].to(torch.int64).view(-1, 1)).view(num_reqs, 1, 1, -1)
    scores = scores.masked_fill(~valid, torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgk,bkhd->bhgd", probs, v)
    return out.reshape(num_reqs, num_heads, head_dim)


def paged_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's queries over its whole paged context (see module docstring).

    q [T, Hq, D] (T may include trailing padding rows), caches as above (already holding this step's K/V),
    scale: softmax scale (usually head_dim ** -0.5). Hq must be a multiple of num_kv_heads (GQA: query head h
    reads KV head h // (Hq / Hkv)). Returns [T, Hq, D] in q's dtype; rows past the last request are zero.
    Math in float32.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_size == md.block_size, (block_size, md.block_size)
    out = torch.zeros_like(q)
    num_reqs = md.num_reqs or (md.seq_lens.shape[0])
    if num_reqs == 0:
        return out
    if md.max_query_len == 1:
        gather = num_reqs * md.max_seq_len * num_kv_heads * head_dim
        if gather <= _MAX_BATCHED_GATHER_ELEMS:
            out[:num_reqs] = _decode_batched(q, key_cache, value_cache, md, num_reqs, scale).to(q.dtype)
            return out
    qsl, seq_lens = _host_lists(md)
    for i in range(num_reqs):
        start, end = qsl[i], qsl[i + 1]
        n_q, seq_len = end - start, seq_lens[i]
        if n_q == 0:
            continue
        assert seq_len >= n_q, f"request {i}: seq_len {seq_len} < query tokens {n_q}"
        num_blocks = (seq_len + block_size - 1) // block_size
        block_ids = md.block_table[i, :num_blocks].to(torch.int64)
        k = gather_sequence(key_cache, block_ids, seq_len)
        v = gather_sequence(value_cache, block_ids, seq_len)
        out[start:end] = _attend_one(q[start:end], k, v, seq_len - n_q, scale).to(q.dtype)
    return out
