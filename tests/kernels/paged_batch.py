"""Builds random paged batches for the kernel tests, plus an independent float64 attention oracle.

The oracle never looks at the paged cache: it attends over the *logical* per-sequence K/V that the builder
scattered into randomly chosen physical blocks, so a wrong block-table walk cannot agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.layers.attention.metadata import AttentionMetadata

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton interpreter (tests/conftest.py)
F32_TOL = 1e-5 if DEV == "cpu" else 5e-3  # float32 on GPU: tl.dot uses TF32


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T_padded, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    md: AttentionMetadata
    keys: list  # per sequence [seq_len, Hkv, D] (logical order)
    values: list


def build(q_lens, ctx_lens, *, num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32,
          device=DEV, pad_tokens=0, extra_table_cols=1, seed=0) -> PagedBatch:
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_needed) + 3  # block 0 is the null block; a few spare blocks hold junk
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)  # junk everywhere that is not a sequence's key
    value_cache = torch.randn(shape, generator=g).to(dtype)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(blocks_needed) + extra_table_cols
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for i, s in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(blocks_needed[i])]
        block_table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        for j in range(s):
            key_cache[ids[j // block_size], j % block_size] = k[j]
            value_cache[ids[j // block_size], j % block_size] = v[j]
        keys.append(k)
        values.append(v)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    num_tokens = qsl[-1]
    q = torch.randn(num_tokens + pad_tokens, num_q_heads, head_dim, generator=g).to(dtype)
    positions = torch.cat([torch.arange(c, c + ql) for ql, c in zip(q_lens, ctx_lens)] +
                          [torch.zeros(pad_tokens, dtype=torch.int64)])
    md = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.full((num_tokens + pad_tokens,), -1, dtype=torch.int64, device=device),
        positions=positions.to(device),
        block_size=block_size,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        context_lens_cpu=list(ctx_lens),
        num_actual_tokens=num_tokens,
    )
    return PagedBatch(q.to(device), key_cache.to(device), value_cache.to(device), md, keys, values)


def oracle(batch: PagedBatch, scale: float) -> torch.Tensor:
    """float64 causal attention over the logical K/V; rows past num_actual_tokens are 0. Returns [T_padded, Hq, D]."""
    md = batch.md
    q = batch.q.double().cpu()
    out = torch.zeros_like(q)
    group = q.shape[1] // batch.keys[0].shape[1]
    for i in range(len(md.seq_lens_cpu)):
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        seq_len, q_len = md.seq_lens_cpu[i], end - start
        k = batch.keys[i].double().repeat_interleave(group, dim=1)
        v = batch.values[i].double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[start:end], k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        s = s.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm()).item()
