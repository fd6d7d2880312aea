"""Paged decode attention: one query token per sequence, GQA-packed, fixed split-KV merged by log-sum-exp.

Stage 1, grid (B, num_kv_heads, NUM_SPLITS): a program loads the queries of *all* q heads of one KV head as one
`[BLOCK_H, D]` tile (BLOCK_H = next pow2 of the group size, at least 16 so `tl.dot` has an MMA-sized M), so every
K/V tile it reads from HBM serves the whole group. The sequence's `ceil(seq_len / TILE_N)` key tiles are cut into
NUM_SPLITS contiguous ranges; split j handles range j and writes its partial output (normalised by its own
softmax sum) plus its base-2 log-sum-exp. NUM_SPLITS is a launch constant chosen from shapes only
(batch bucket, KV heads, block-table width, SM count), never from sequence lengths, so a CUDA graph captured for a
batch bucket replays correctly for any lengths.

FP8 caches: K/V tiles are loaded raw and cast to q's dtype (exact: every e4m3/e5m2 value is a bf16/fp16/fp32 value;
float8_e4m3fn to bf16 on sm_90 by bit moves, `_common.cache_tile_to`); the per-tensor scales are folded, k_scale
into the softmax scale (q.(k_scale k) = k_scale (q.k)) and v_scale into each split's normalised output (the merge is
linear in the outputs).

Stage 2, grid (B, num_q_heads): out = sum_j w_j * o_j / sum_j w_j with w_j = 2^(lse_j - max lse) — the standard
split-softmax merge (FlashDecoding, Dao et al. 2023). Empty splits carry lse = -inf and weigh 0; a sequence of
length 0 (CUDA-graph padding row) writes zeros.
"""

from __future__ import annotations

import torch

from ladle.kernels._common import (LOG2E, cache_tile_to, dot_precision, num_sms, resolve_fp8_bit_cast, tl,
                                   triton)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache, v_cache, part_out, part_lse, block_table, query_start_loc, seq_lens,
    q_stride_t, q_stride_h, bt_stride, scale_log2, v_scale,
    GROUP: tl.constexpr, NUM_Q_HEADS: tl.constexpr, HKV_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8_BITS: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    q_row = tl.load(query_start_loc + b).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(q_ptr + q_row * q_stride_t + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t_begin = split * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for t in range(t_begin, t_end):
        offs_n = t * TILE_N + tl.arange(0, TILE_N)
        in_seq = offs_n < seq_len
        blk = tl.load(block_table + b * bt_stride + offs_n // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        row = blk * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_off = row[:, None] * HKV_D + kv_head * HEAD_DIM + offs_d[None, :]
        kv_mask = in_seq[:, None] & mask_d[None, :]
        k = cache_tile_to(tl.load(k_cache + kv_off, mask=kv_mask, other=0.0), q.dtype, FP8_BITS)  # FP8: raw values
        v = cache_tile_to(tl.load(v_cache + kv_off, mask=kv_mask, other=0.0), q.dtype, FP8_BITS)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, TILE_N]
        s = tl.where(in_seq[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    empty = t_begin >= t_end
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None] * v_scale
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    base = (b * NUM_Q_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_H] index into [B, Hq, NUM_SPLITS]
    tl.store(part_out + base[:, None].to(tl.int64) * BLOCK_D + offs_d[None, :], out, mask=mask_h[:, None])
    tl.store(part_lse + base, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    part_out, part_lse, out_ptr, query_start_loc, o_stride_t, o_stride_h,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    base = (b * NUM_Q_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse + base + offs_s)
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # 0 for empty splits
    parts = tl.load(part_out + (base + offs_s)[:, None].to(tl.int64) * BLOCK_D + offs_d[None, :])
    denom = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    q_row = tl.load(query_start_loc + b).to(tl.int64)
    tl.store(out_ptr + q_row * o_stride_t + head * o_stride_h + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, block_size: int, tile_n: int,
                      num_sms: int) -> int:
    """Fixed split count from shapes only: aim for ~4 programs per SM, at most one split per key tile of the
    widest possible sequence, power of two in [1, 64]."""
    max_tiles = max(1, triton.cdiv(max_blocks * block_size, tile_n))
    want = max(1, (4 * num_sms) // max(1, num_seqs * num_kv_heads))
    splits = min(64, triton.next_power_of_2(want), triton.next_power_of_2(max_tiles))
    return max(1, splits)


def default_decode_config(head_dim: int, block_size: int, on_cpu: bool, num_seqs: int = 1, num_kv_heads: int = 1,
                          num_sms: int = 132) -> dict:
    """Launch config from shapes only (so a captured graph keeps it). H200 measurements, 8K contexts
    (benchmarks/gpu_dense_suite.py): while the grid needs splits to fill the chip, TILE_N=64 keeps more K/V loads
    in flight per SM (SmolLM2 shapes, B=32: 72-82% of copy bandwidth vs 65% with 128); once (sequence, KV head)
    pairs alone give >= 2 programs per SM, TILE_N=128 streams better (B=128: 90-92% vs 76% with 64). For D=128
    with one KV head (an M3 dense rank) the two were within 2%."""
    if on_cpu:
        return {"TILE_N": 16, "num_warps": 4, "num_stages": 1}
    tile_n = 128 if num_seqs * num_kv_heads >= 2 * num_sms else 64
    return {"TILE_N": tile_n, "num_warps": 4, "num_stages": 3}


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_bit_cast: bool | None = None,
) -> torch.Tensor:
    """Launch decode attention (shapes already checked by `paged_attention`).

    Each of the B sequences has exactly one query row, `q[query_start_loc[b]]`. q [T, Hq, D] (T >= B);
    block_table [B, max_blocks] int32; seq_lens [B] int32 (0 allowed: writes zeros). Caches in q's dtype or FP8
    with per-tensor k_scale / v_scale (dequantized as stored * scale); fp8_bit_cast as in `prefill_attention`.
    Returns out [T, Hq, D];
    rows not named by query_start_loc[:B] are left unwritten. Scratch: [B, Hq, NUM_SPLITS, BLOCK_D] float32.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    sms = num_sms(q.device)
    cfg = dict(config or default_decode_config(head_dim, block_size, q.device.type == "cpu", num_seqs, num_kv_heads,
                                               sms))
    tile_n = cfg.pop("TILE_N")
    assert num_splits is None or num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, block_table.shape[1], block_size, tile_n, sms)
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_out = torch.empty((num_seqs, num_q_heads, num_splits, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, part_out, part_lse, block_table, query_start_loc, seq_lens,
        q.stride(0), q.stride(1), block_table.stride(0), scale * LOG2E * k_scale, float(v_scale),
        GROUP=group, NUM_Q_HEADS=num_q_heads, HKV_D=num_kv_heads * head_dim, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size, TILE_N=tile_n,
        NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(q.dtype),
        FP8_BITS=resolve_fp8_bit_cast(q, key_cache, fp8_bit_cast), **cfg,
    )
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        part_out, part_lse, out, query_start_loc, out.stride(0), out.stride(1),
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, num_warps=4,
    )
    return out
