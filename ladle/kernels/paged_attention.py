"""Paged attention entry point: checks shapes, picks decode or varlen kernel, records the dispatch.

`paged_attention(q, key_cache, value_cache, attn_metadata, scale)` is what the generic `Attention` layer calls
when `ForwardContext.backends.attention == "TRITON_ATTN"`. The new tokens' K/V must already be in the cache
(`store_kvcache` first): both kernels read all keys, the step's own included, from the paged cache.

Which kernel (host-side facts only, no device sync):
  attn_metadata.max_query_len == 1  -> decode kernel (GQA-packed, fixed split-KV; CUDA-graph capturable)
  otherwise                         -> varlen causal kernel (prefill, chunked prefill, prefix hits, mixed)
Neither launch grid depends on sequence lengths, so both are capturable given static metadata buffers.

`paged_attention_ref` is the plain-torch reference (see its docstring for the paging rule); it is the TORCH
backend, the fallback when the Triton rule fails and the oracle in tests. `gather_sequence` and
`masked_attention_ref` are shared with the MSA references (ladle/kernels/msa_indexer.py, msa_sparse_attention.py).

FP8 KV (`--kv-cache-dtype fp8*`): the caches may be float8_e4m3fn / float8_e5m2 whatever q's dtype; both kernels
and the reference dequantize on load (stored * k_scale, stored * v_scale, the layer's per-tensor float32 scales),
and the dispatch bucket carries " kv=fp8_e4m3" (or e5m2).
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import check_cache_dtype, check_cache_pair, decide_triton, dequantize_ref, triton_ok
from ladle.kernels.attention_decode import decode_attention
from ladle.kernels.attention_prefill import prefill_attention
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

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
    check_cache_dtype(q.dtype, key_cache.dtype)
    num_seqs = md.seq_lens.shape[0]
    assert md.query_start_loc.shape == (num_seqs + 1,), "query_start_loc must be [B+1]"
    assert md.block_table.dim() == 2 and md.block_table.shape[0] == num_seqs, "block_table must be [B, max_blocks]"
    assert md.block_table.stride(1) == 1, "block_table rows must be contiguous"
    for name in ("query_start_loc", "seq_lens", "block_table"):
        assert getattr(md, name).dtype == torch.int32, f"{name} must be int32"
    assert md.block_size == key_cache.shape[1], f"metadata block_size {md.block_size} != cache {key_cache.shape[1]}"


@timed_op
def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn_metadata,
    scale: float,
    out: Optional[torch.Tensor] = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    use_triton: bool = True,
) -> torch.Tensor:
    """Causal attention of this step's queries over the paged cache.

    q: [T, Hq, D] (D contiguous; a strided view into fused qkv is fine). key_cache/value_cache:
    [num_blocks, block_size, Hkv, D], q's dtype or FP8 (dequantized on load with the per-tensor float32 k_scale /
    v_scale). attn_metadata: an AttentionMetadata (query_start_loc [B+1],
    seq_lens [B], block_table [B, max_blocks], all int32; block_size; max_query_len; host mirrors for the
    reference). scale: softmax scale (usually D**-0.5). Returns out [T, Hq, D] in q's dtype; padding rows past
    `num_actual_tokens` are zero. use_triton: the backend asked for (`OpBackends.triton_attention`); Triton runs
    when asked for and `eligibility` passes (recorded as op "attn_decode" / "attn_prefill"), else
    `paged_attention_ref`.
    """
    _check(q, key_cache, value_cache, attn_metadata)
    md = attn_metadata
    decode = md.max_query_len == 1
    op = "attn_decode" if decode else "attn_prefill"
    reason = eligibility(q, key_cache, md)
    if not decide_triton(op, q.shape[0], use_triton, reason, key_cache.dtype):
        return paged_attention_ref(q, key_cache, value_cache, md, scale, out=out, k_scale=k_scale, v_scale=v_scale)
    if out is None:
        out = torch.empty_like(q)
    num_actual = md.num_actual_tokens
    if 0 < num_actual < q.shape[0]:
        out[num_actual:].zero_()
    kernel = decode_attention if decode else prefill_attention
    return kernel(q, key_cache, value_cache, md.block_table, md.query_start_loc, md.seq_lens, scale, out=out,
                  k_scale=k_scale, v_scale=v_scale)


# ----------------------------------------------------------------------------------------------------------------
# torch reference
#
# Paging rule (ARCHITECTURE.md): request i's context (cached tokens, then this step's, seq_lens[i] in all) lives in
# blocks block_table[i, 0 : ceil(seq_lens[i] / block_size)], logical token j at slot
# block_table[i, j // block_size] * block_size + j % block_size. Query t of request i (t < q_len) is logical token
# context_len + t, context_len = seq_lens[i] - q_len, and attends to logical keys 0 .. context_len + t (causal).
# Prefill, chunked prefill, prefix-cache hits and decode are all this one rule.

# The batched decode path gathers [B, max_seq_len, Hkv, D] at once; above this many elements the reference uses
# the per-request loop instead, to bound memory.
_MAX_BATCHED_GATHER_ELEMS = 1 << 26


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """Math dtype of the attention references: float32, or float64 for float64 inputs (test oracles)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_sequence(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [num_blocks, block_size, *row] + block_ids [>= ceil(seq_len / block_size)] int -> [seq_len, *row]:
    the rows of logical positions 0 .. seq_len-1 in order (K, V or MSA index-K)."""
    bs = cache.shape[1]
    nb = -(-seq_len // bs)
    rows = cache.index_select(0, block_ids[:nb].long())
    return rows.reshape(nb * bs, *cache.shape[2:])[:seq_len]


def masked_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Softmax attention of one request under an explicit key mask, math in `reference_dtype(q.dtype)`.

    q [Tq, Hq, D]; k, v [S, Hkv, D] (Hq a multiple of Hkv; query head h reads KV head h // (Hq / Hkv));
    mask [Hkv or 1, Tq, S] bool, True = attend. Returns [Tq, Hq, D] in the math dtype; a row with no key gives 0.
    """
    tq, hq, d = q.shape
    hkv = k.shape[1]
    ct = reference_dtype(q.dtype)
    qg = q.to(ct).view(tq, hkv, hq // hkv, d)
    scores = torch.einsum("tkgd,skd->kgts", qg, k.to(ct)) * scale  # [Hkv, G, Tq, S]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: NaN -> 0
    out = torch.einsum("kgts,skd->tkgd", probs, v.to(ct))
    return out.reshape(tq, hq, d)


def _decode_batched(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, md,
                    num_reqs: int, scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    """Decode-only steps (query i = request i's last token): one gather and one masked softmax for the whole batch,
    no per-request loop and no host sync (the CPU engine's decode speed). Returns [num_reqs, Hq, D] (math dtype)."""
    _, block_size, hkv, d = key_cache.shape
    hq = q.shape[1]
    ct = reference_dtype(q.dtype)
    num_blocks = -(-md.max_seq_len // block_size)
    block_ids = md.block_table[:num_reqs, :num_blocks].long()  # [B, nb]
    k = dequantize_ref(key_cache[block_ids].reshape(num_reqs, -1, hkv, d), k_scale, ct)  # [B, nb*bs, Hkv, D]
    v = dequantize_ref(value_cache[block_ids].reshape(num_reqs, -1, hkv, d), v_scale, ct)
    qg = q[:num_reqs].to(ct).view(num_reqs, hkv, hq // hkv, d)
    scores = torch.einsum("bhgd,bkhd->bhgk", qg, k) * scale  # [B, Hkv, G, nb*bs]
    k_pos = torch.arange(k.shape[1], device=q.device).view(1, -1)
    valid = (k_pos < md.seq_lens[:num_reqs].long().view(-1, 1)).view(num_reqs, 1, 1, -1)
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    return torch.einsum("bhgk,bkhd->bhgd", probs, v).reshape(num_reqs, hq, d)


def paged_attention_ref(q, key_cache, value_cache, attn_metadata, scale, out=None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    """Plain-torch `paged_attention` (same arguments and result): the paging rule above, softmax attention with
    math in float32 (float64 for float64 inputs) over the dequantized cache (stored * k_scale / v_scale). Decode-only steps take one batched gather (no host sync); other
    steps loop over requests using the host mirrors (`query_start_loc_cpu`, `seq_lens_cpu`) when present, else
    the device tensors (a sync; reference only). Returns [T, Hq, D] in q's dtype; rows outside every request
    (padding) are zero."""
    md = attn_metadata
    _, block_size, hkv, d = key_cache.shape
    assert q.shape[1] % hkv == 0 and block_size == md.block_size, (tuple(q.shape), tuple(key_cache.shape))
    res = torch.zeros(q.shape, dtype=reference_dtype(q.dtype), device=q.device)
    num_reqs = md.num_reqs or md.seq_lens.shape[0]
    if num_reqs == 0:
        pass
    elif md.max_query_len == 1 and num_reqs * md.max_seq_len * hkv * d <= _MAX_BATCHED_GATHER_ELEMS:
        res[:num_reqs] = _decode_batched(q, key_cache, value_cache, md, num_reqs, scale, k_scale, v_scale)
    else:
        qsl = md.query_start_loc_cpu or md.query_start_loc.tolist()
        seq_lens = md.seq_lens_cpu or md.seq_lens.tolist()
        for i in range(num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            if end == start or seq_len == 0:
                continue
            assert seq_len >= end - start, f"request {i}: seq_len {seq_len} < query tokens {end - start}"
            k = dequantize_ref(gather_sequence(key_cache, md.block_table[i], seq_len), k_scale, res.dtype)
            v = dequantize_ref(gather_sequence(value_cache, md.block_table[i], seq_len), v_scale, res.dtype)
            q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
            causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [Tq, S]
            res[start:end] = masked_attention_ref(q[start:end], k, v, causal[None], scale)
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out
