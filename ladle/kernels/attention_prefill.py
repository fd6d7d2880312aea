"""Varlen causal attention over the paged KV cache (prefill, chunked prefill, prefix hits, mixed batches).

Every query of the step attends to its sequence's keys at positions `[0, context_len + i]`, all read from the
paged cache (the step's own K/V were stored there first by `store_kvcache`). So a prompt chunk that follows a
prefix-cache hit or an earlier chunk needs nothing special: its context is simply more cached keys.

Grid: (cdiv-upper-bound of query tiles, num_q_heads). Program `pid` finds its sequence by binary search over
`query_start_loc` — sequence s owns tiles `[qsl[s] // BLOCK_M + s, qsl[s+1] // BLOCK_M + s + 1)`, a bound that
always covers its `ceil(qlen / BLOCK_M)` tiles — so the grid depends on (T, B) only, never on host-side lengths.
Within a sequence the tiles run last-first (the causally longest tiles start in the first wave).

        keys ->  0 ........................ ctx ........ ctx+qlen
    query 0      [ visible (full tiles, no mask) ][ diag ]
    query i      [ visible ........................][ i ]
Per tile: keys below `ctx + first_query_of_tile + 1` are visible to every row (unmasked loop); the rest, up to
`min(seq_len, ctx + last_query_of_tile + 1)`, use the causal mask. Softmax is online in base 2
(scale folded with log2(e)); accumulation in float32.
FP8 caches: K/V tiles are cast to q's dtype on load (exact; float8_e4m3fn to bf16 on sm_90 by bit moves,
`_common.cache_tile_to`), k_scale is folded into the softmax scale and v_scale
into the normalised output (as in attention_decode.py).
"""

from __future__ import annotations

import torch

from ladle.kernels._common import LOG2E, cache_tile_to, dot_precision, resolve_fp8_bit_cast, tl, triton


@triton.jit
def _attend_tile(q, acc, m_i, l_i, n0, seq, kv_head, k_cache, v_cache, block_table, bt_stride, seq_len, q_pos,
                 offs_d, mask_d, HKV_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, scale_log2, DOT_PRECISION: tl.constexpr,
                 FP8_BITS: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_seq = offs_n < seq_len
    blk = tl.load(block_table + seq * bt_stride + offs_n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    row = blk * BLOCK_SIZE + offs_n % BLOCK_SIZE  # physical slot of each key
    kv_off = row[:, None] * HKV_D + kv_head * HEAD_DIM + offs_d[None, :]
    kv_mask = in_seq[:, None] & mask_d[None, :]
    k = cache_tile_to(tl.load(k_cache + kv_off, mask=kv_mask, other=0.0), q.dtype, FP8_BITS)  # FP8: raw values
    v = cache_tile_to(tl.load(v_cache + kv_off, mask=kv_mask, other=0.0), q.dtype, FP8_BITS)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N] in log2 units
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & in_seq[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache, v_cache, out_ptr, block_table, query_start_loc, seq_lens,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride, num_seqs, scale_log2, v_scale,
    GROUP: tl.constexpr, HKV_D: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_BITS: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    # Binary search: the last sequence s with qsl[s] // BLOCK_M + s <= pid.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start_tile = tl.load(query_start_loc + mid) // BLOCK_M + mid
        if start_tile <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    num_q_tiles = tl.cdiv(q_len, BLOCK_M)
    slot = pid - (q_start // BLOCK_M + seq)
    if slot >= num_q_tiles:
        return
    tile = num_q_tiles - 1 - slot  # heaviest (last, longest-causal) tiles launch first: shorter tail
    seq_len = tl.load(seq_lens + seq)
    ctx_len = seq_len - q_len

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pos = ctx_len + offs_m

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    first_q = ctx_len + tile * BLOCK_M
    full_end = ((first_q + 1) // BLOCK_N) * BLOCK_N  # keys [0, full_end) are visible to every row of the tile
    kv_end = tl.minimum(seq_len, first_q + BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0, seq, kv_head, k_cache, v_cache, block_table, bt_stride,
                                     seq_len, q_pos, offs_d, mask_d, HKV_D, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False,
                                     scale_log2, DOT_PRECISION, FP8_BITS)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0, seq, kv_head, k_cache, v_cache, block_table, bt_stride,
                                     seq_len, q_pos, offs_d, mask_d, HKV_D, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
                                     scale_log2, DOT_PRECISION, FP8_BITS)
    out = acc / l_i[:, None] * v_scale
    tl.store(out_ptr + q_rows[:, None] * o_stride_t + head * o_stride_h + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def default_prefill_config(head_dim: int, on_cpu: bool) -> dict:
    """Tile sizes. CPU (interpreter): small tiles keep tests fast. GPU: picked from the H200 sweep in
    benchmarks/gpu_dense_suite.py (see its JSON)."""
    if on_cpu:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if head_dim <= 64:  # H200 sweep: 243.6 TFLOP/s at 8K causal, D=64 (best of 6)
        return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}  # 373.7 TFLOP/s, D=128


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_bit_cast: bool | None = None,
) -> torch.Tensor:
    """Launch the varlen paged causal kernel (shapes already checked by `paged_attention`).

    q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_table [B, max_blocks] int32;
    query_start_loc [B+1] int32; seq_lens [B] int32. Caches in q's dtype or FP8 with per-tensor k_scale / v_scale
    (dequantized as stored * scale). fp8_bit_cast: None casts an e4m3 cache with `_common.e4m3_to_bf16` where
    `_common.fp8_bit_cast_ineligible` passes, False with Triton's cast. Returns out [T, Hq, D] in q's dtype.
    Query rows not covered by any sequence (beyond query_start_loc[-1]) are left unwritten.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = dict(config or default_prefill_config(head_dim, q.device.type == "cpu"))
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    grid = (num_tokens // block_m + num_seqs, num_q_heads)
    _prefill_kernel[grid](
        q, key_cache, value_cache, out, block_table, query_start_loc, seq_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0), num_seqs, scale * LOG2E * k_scale,
        float(v_scale), GROUP=num_q_heads // num_kv_heads, HKV_D=num_kv_heads * head_dim, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype),
        FP8_BITS=resolve_fp8_bit_cast(q, key_cache, fp8_bit_cast), **cfg,
    )
    return out
