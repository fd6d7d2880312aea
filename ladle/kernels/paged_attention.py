"""Paged attention entry point: checks shapes, picks decode or varlen kernel, records the dispatch.

`paged_attention(q, key_cache, value_cache, attn_metadata, scale)` is what the generic `Attention` layer calls
when `ForwardContext.backends.attention == "TRITON_ATTN"`. The new tokens' K/V must already be in the cache
(`store_kvcache` first): both kernels read all keys, the step's own included, from the paged cache.

Which kernel (host-side facts only, no device sync):
  attn_metadata.max_query_len == 1  -> decode kernel (GQA-packed, fixed split-KV; CUDA-graph capturable)
  otherwise                         -> varlen causal kernel (prefill, chunked prefill, prefix hits, mixed)
Neither launch grid depends on sequence lengths, so both are capturable given static metadata buffers.

`paged_attention_ref` is the plain-torch reference (float32 math, one Python loop over requests using the host
mirrors `*_cpu`); it is the fallback when the Triton rule fails and the oracle in tests.
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import check_cache_pair, decide_triton, triton_ok
from ladle.kernels.attention_decode import decode_attention
from ladle.kernels.attention_prefill import prefill_attention
from ladle.observe import dispatch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

dispatch.register("attn_decode", "triton", "max_query_len == 1; cuda (or interpreter); fp16/bf16/fp32; D <= 256")
dispatch.register("attn_prefill", "triton", "max_query_len > 1; cuda (or interpreter); fp16/bf16/fp32; D <= 256")


def eligibility(q: torch.Tensor, key_cache: torch.Tensor, attn_metadata) -> Optional[str]:
    """The Triton attention rule: None when the kernels can run these inputs, else the reason."""
    reason = triton_ok(q, key_cache, attn_metadata.block_table, attn_metadata.seq_lens)
    if reason is not None:
        return reason
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype}"
    if q.shape[-1] > 256:
        return f"head_dim {q.shape[-1]} > 256"
    return None


def _check(q, key_cache, value_cache, md) -> None:
    check_cache_pair(key_cache, value_cache)
    assert q.dim() == 3 and q.stride(-1) == 1, f"q must be [T, Hq, D] with contiguous D, got {tuple(q.shape)}"
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = key_cache.shape[2]
    assert key_cache.shape[3] == head_dim, f"head_dim {head_dim} != cache {key_cache.shape[3]}"
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} not a multiple of Hkv {num_kv_heads}"
    assert q.dtype == key_cache.dtype, f"q {q.dtype} != cache {key_cache.dtype}"
    num_seqs = md.seq_lens.shape[0]
    assert md.query_start_loc.shape == (num_seqs + 1,), "query_start_loc must be [B+1]"
    assert md.block_table.dim() == 2 and md.block_table.shape[0] == num_seqs, "block_table must be [B, max_blocks]"
    assert md.block_table.stride(1) == 1, "block_table rows must be contiguous"
    for name in ("query_start_loc", "seq_lens", "block_table"):
        assert getattr(md, name).dtype == torch.int32, f"{name} must be int32"
    assert md.block_size == key_cache.shape[1], f"metadata block_size {md.block_size} != cache {key_cache.shape[1]}"


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata,
    scale: float,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over the paged cache.

    q: [T, Hq, D] (D contiguous; a strided view into fused qkv is fine). key_cache/value_cache:
    [num_blocks, block_size, Hkv, D], q's dtype. attn_metadata: an AttentionMetadata (query_start_loc [B+1],
    seq_lens [B], block_table [B, max_blocks], all int32; block_size; max_query_len; host mirrors for the
    reference). scale: softmax scale (usually D**-0.5). Returns out [T, Hq, D] in q's dtype; padding rows past
    `num_actual_tokens` are zero. Runs Triton when `eligibility` passes (recorded), else `paged_attention_ref`.
    """
    _check(q, key_cache, value_cache, attn_metadata)
    md = attn_metadata
    decode = md.max_query_len == 1
    op = "attn_decode" if decode else "attn_prefill"
    reason = eligibility(q, key_cache, md)
    if not decide_triton(op, q.shape[0], True, reason):
        return paged_attention_ref(q, key_cache, value_cache, md, scale, out=out)
    if out is None:
        out = torch.empty_like(q)
    num_actual = md.num_actual_tokens
    if 0 < num_actual < q.shape[0]:
        out[num_actual:].zero_()
    kernel = decode_attention if decode else prefill_attention
    return kernel(q, key_cache, value_cache, md.block_table, md.query_start_loc, md.seq_lens, scale, out=out)


def paged_attention_ref(q, key_cache, value_cache, attn_metadata, scale, out=None) -> torch.Tensor:
    """Plain-torch reference: gathers each request's keys through its block table and runs causal softmax
    attention in float32. Uses the host mirrors (`query_start_loc_cpu`, `seq_lens_cpu`) when present, else reads
    the device tensors (a sync; reference only). Returns [T, Hq, D] in q's dtype, zeros in uncovered rows."""
    md = attn_metadata
    qsl = md.query_start_loc_cpu or md.query_start_loc.tolist()
    seq_lens = md.seq_lens_cpu or md.seq_lens.tolist()
    num_q_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    res = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0 or seq_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = md.block_table[i, :num_blocks].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qi = q[start:end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        res[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out
