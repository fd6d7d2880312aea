"""MSA lightning indexer: per (token, group) block scores over the index-K cache, then top-k block selection.

Math (design/minimax_m3.md §3.5): for query token t at absolute position p_t, group g and every cached key
position j <= p_t, s_g(t, j) = index_q[t, g] . index_k[j] (fp32 accumulation, no scaling, no ReLU). Blocks are
anchored at absolute position 0 with width block_size (= the KV block = the MSA block, 128 in the real model):
S_g(t, b) = max_{j in block b, j <= p_t} s_g(t, j) for b = 0 .. b_t, where b_t = p_t // block_size is the local
block. The blocks b_t - l for l < local_blocks (clamped at 0) are forced (+inf); M3 has local_blocks = 1, the
query's own block, which is all the kernel forces (its eligibility rule). The kept blocks are the forced blocks plus
the best other visible blocks, exactly min(topk, b_t + 1) distinct blocks.

Output layout (ARCHITECTURE.md, "MSA selection"): `selected_block_ids [num_kv_heads, num_tokens, topk] int32` of
*logical* block ids (readers map them through `block_table`), valid entries left-packed in ascending block order,
so the local block b_t (the largest visible block) sits in the last valid slot, -1 after:

    token at p_t = 37, block 16, topk 4, visible blocks 0, 1, 2 (b_t = 2):  [0, 1, 2, -1]
    token at p_t = 150, visible 0..9, best others {7, 2, 5}:              [2, 5, 7, 9]

Ties: equal scores are broken toward the LOWER block id (kernel and reference alike), so selections are
deterministic and the kernel equals the reference slot for slot on exact data; comparisons with transformers
(whose torch.topk orders ties arbitrarily) are set-based. Tokens at or past query_start_loc[-1] (CUDA-graph
padding) and tokens with position < 0 get all -1.

`msa_indexer` is the entry point (use_triton + the eligibility rule `msa_indexer_ineligible`, recorded as op
"msa_indexer"); `msa_indexer_ref` the torch reference built from `msa_block_scores` and `msa_select_blocks`.

Kernels (fixed grids for a given (num_tokens, num_reqs, max_blocks) shape, no host sync, so the call can be
captured in a CUDA graph). Two-launch path:
  1. `_index_score_kernel`, grid (cdiv(T, BLOCK_Q) + B, NUM_SPLITS): one program per (query tile of one request,
     split); it walks key blocks b = split, split + NUM_SPLITS, ... up to the tile's last local block, loads the
     [block_size, D] index-K page through the block table once for all BLOCK_Q tokens x num_kv_heads rows (the
     index-K cache has ONE shared head), does one tl.dot and max-pools over the block, writing
     scores [Hkv, T, max_blocks] fp32. Decode (1 token per request) gets its parallelism from NUM_SPLITS.
     Decode-shaped launches (T <= B, launcher argument `prefetch_pages`) load the split's whole block-table slice
     (its page ids) in one vector load next to the pos / q loads and take page i from that register vector, so no
     dependent table load sits in front of a K tile and the pipeliner keeps num_stages - 1 tiles in flight
     (`pages_per_iter` issues several per iteration, the last group masked). Before this, each tile waited on its
     page-id load (two round trips per 16 KiB tile, one tile in flight per program): the B=32 FP8 decode scan ran
     at ~27% of copy bandwidth on an H200. float8_e4m3fn caches are cast to bf16 by `_common.e4m3_to_bf16` (exact
     bit moves, `fp8_bit_cast`), not by Triton's cast, whose two conversion-unit instructions per value made the
     FP8 scan slower than the bf16 one. Tunables (`score_launch`) never change the output.
  2. `_index_topk_kernel`, grid (T, Hkv): forces the local block, masks invisible blocks, and selects the top-k
     (lowest id among equal scores) writing the layout above: for <= 128 blocks (16K context at block 128) by a
     one-pass rank count (an [N, N] comparison; no serial loop), beyond that by repeated argmax.
Fused path (one launch; launcher argument `fused_topk`, default: module flag FUSED_TOPK and num_tokens <= num_reqs,
i.e. decode-shaped launches such as the runner's CUDA-graph buckets): `_index_score_kernel` with FUSED_TOPK. After
its score stores every split program of query tile `pid` increments the arrival counter `counters[pid]` (int32,
`split_counters("msa_indexer", ...)`, acq_rel atomic); the program that sees NUM_SPLITS - 1 arrived last: it runs
the same per-row selection (`_select_row`, shared with `_index_topk_kernel`) for the tile's rows and stores 0 back
into the counter. Reset invariant: the counter buffer is zero before and after every launch (zeroed once at
allocation, never by a host op afterwards; see ladle/kernels/split_counters.py). Tokens at or past
query_start_loc[-1] are written (all -1) by split 0 of the tile programs that lie past every request (the grid has
at least cdiv(padding, BLOCK_Q) of them).
Request lookup: binary search over query_start_loc, or, when B < VEC_SEARCH_MAX_REQS (or `vec_search=True`), one
vector load of it.
FP8 index-K cache (`--kv-cache-dtype fp8*`): the index-K page is cast to index_q's dtype on load (exact) and the
per-tensor float32 `index_k_scale` multiplies the pooled block scores (a positive scale commutes with the max);
the reference dequantizes the gathered keys (stored * index_k_scale). The dispatch bucket carries " kv=fp8_*".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ladle.kernels._common import (check_cache_dtype, decide_triton, cache_tile_to, dequantize_ref, interpreting,
                                   num_sms, pow2_dot_reason, reqs_p2, resolve_fp8_bit_cast, tl, triton, triton_ok)
from ladle.kernels.paged_attention import gather_sequence, reference_dtype
from ladle.kernels.split_counters import arrive, release, split_counters
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "msa_indexer"
# Below this many requests, find a tile's request with one vector load of query_start_loc instead of a binary
# search (log2(B) dependent loads at the head of every program); 0 turns it off. Launcher argument `vec_search`
# overrides it per call (the GPU suite times both).
VEC_SEARCH_MAX_REQS = 4096
# Default of the launcher's `fused_topk` (None): top-k in the last-arriving score program for decode-shaped
# launches (num_tokens <= num_reqs); False: always the two-launch path.
FUSED_TOPK = True
COUNTER_KEY = OP
# Decode launches load a split program's whole block-table slice up front when it holds at most this many ids.
PREFETCH_PAGES_MAX = 256
# Resident score programs per SM that `default_num_splits` sizes the grid for (and the decode register cap keeps).
PROGRAMS_PER_SM = 4
dispatch.register(OP, "triton", "local_blocks == 1; cuda (or cpu+TRITON_INTERPRET); pow2 block_size and index dim")


@triton.jit
def _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr):
    """Request r owning query tile `pid`: the largest r with qsl[r] // BLOCK_Q + r <= pid (vLLM unified-attention
    tiling: request r's tiles are pids [qsl[r] // BLOCK_Q + r, qsl[r+1] // BLOCK_Q + r + 1)). Returns num_reqs when
    pid is past every request."""
    lo = 0
    hi = num_reqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        v = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if v <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _find_request_vec(qsl_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr, REQS_P2: tl.constexpr):
    """Same as `_find_request` with one vector load of query_start_loc instead of a chain of log2(B) dependent
    scalar loads (the chain dominated short decode programs). Returns (r, qsl[r], qsl[r+1])."""
    idx = tl.arange(0, REQS_P2)
    ok = idx <= num_reqs
    qs = tl.load(qsl_ptr + idx, mask=ok, other=0)
    v = qs // BLOCK_Q + idx
    r = tl.sum((ok & (v <= pid)).to(tl.int32), axis=0) - 1
    q_start = tl.sum(tl.where(idx == r, qs, 0), axis=0)
    q_end = tl.sum(tl.where(idx == r + 1, qs, 0), axis=0)
    return r, q_start, q_end


@triton.jit
def _fill_padding(out_ptr, total, ptile, num_tokens, NUM_HEADS: tl.constexpr, BLOCK_Q: tl.constexpr,
                  TOPK: tl.constexpr, TOPK_P2: tl.constexpr):
    """out[:, t, :] = -1 for the padding tokens t = total + ptile * BLOCK_Q + [0, BLOCK_Q), t < num_tokens."""
    offs_m = tl.arange(0, BLOCK_Q * NUM_HEADS)
    t = total + ptile * BLOCK_Q + offs_m // NUM_HEADS
    h = offs_m % NUM_HEADS
    slot = tl.arange(0, TOPK_P2)
    ptr = out_ptr + (h.to(tl.int64) * num_tokens + t)[:, None] * TOPK + slot[None, :]
    minus1 = tl.full([BLOCK_Q * NUM_HEADS, TOPK_P2], -1, tl.int32)
    tl.store(ptr, minus1, mask=(t < num_tokens)[:, None] & (slot < TOPK)[None, :])


@triton.jit
def _select_tile(score_ptr, pos_ptr, out_ptr, t0, n_tok, num_tokens, max_blocks, NUM_HEADS: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, NB_P2: tl.constexpr,
                 RANK_SELECT: tl.constexpr):
    """Top-k of the n_tok * NUM_HEADS rows (tokens t0 .. t0 + n_tok - 1, every head) of one tile, one row at a
    time; scores read through L2 (.cg: other SMs wrote them)."""
    for i in range(0, n_tok * NUM_HEADS):
        t = t0 + i // NUM_HEADS
        h = i % NUM_HEADS
        pos = tl.load(pos_ptr + t)
        n_vis = tl.minimum(tl.where(pos >= 0, pos // BLOCK_SIZE + 1, 0), max_blocks)
        row = (h.to(tl.int64) * num_tokens + t)
        _select_row(score_ptr + row * max_blocks, out_ptr + row * TOPK, n_vis, TOPK, TOPK_P2, NB_P2, RANK_SELECT,
                    ".cg")


@triton.jit
def _select_row(row, out_row, n_vis, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, NB_P2: tl.constexpr,
                RANK_SELECT: tl.constexpr, CACHE: tl.constexpr):
    """Select one row: scores row[0 .. n_vis) (fp32; block n_vis - 1 is the local block, forced), writes
    out_row[0 .. TOPK) in the ascending layout of the module docstring (lowest id among equal scores)."""
    n_valid = tl.minimum(n_vis, TOPK)
    bid = tl.arange(0, NB_P2)
    s = tl.load(row + bid, mask=bid < n_vis, other=float("-inf"), cache_modifier=CACHE)
    s = tl.where(bid == n_vis - 1, float("inf"), s)  # forced local block
    slot = tl.arange(0, TOPK_P2)
    if RANK_SELECT:
        # one pass, no serial loop: rank_j = #{i : s_i > s_j, or s_i == s_j and i < j} (lower id wins ties);
        # the n_valid best ranks are chosen (rank 0 is the local block, the only +inf)
        bid_i = tl.arange(0, NB_P2)
        s_i = tl.load(row + bid_i, mask=bid_i < n_vis, other=float("-inf"), cache_modifier=CACHE)
        s_i = tl.where(bid_i == n_vis - 1, float("inf"), s_i)
        better = (s_i[:, None] > s[None, :]) | ((s_i[:, None] == s[None, :]) & (bid_i[:, None] < bid[None, :]))
        rank = tl.sum(better.to(tl.int32), axis=0)  # [NB_P2] over j
        chosen = rank < n_valid
    else:
        chosen = bid < 0  # all False
        for i in tl.static_range(TOPK):
            best = tl.max(s, axis=0)
            idx = tl.min(tl.where(s == best, bid, NB_P2), axis=0)  # lower block id wins ties
            chosen = chosen | ((bid == idx) & (i < n_valid))
            s = tl.where(bid == idx, float("-inf"), s)
    # ascending layout: a chosen block's slot is the number of chosen blocks below it (the local block, the largest
    # visible id, lands in the last valid slot); one scatter store, then -1 in the n_valid .. TOPK-1 slots
    dst = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(out_row + dst, bid, mask=chosen)
    tl.store(out_row + slot, tl.full([TOPK_P2], -1, tl.int32), mask=(slot >= n_valid) & (slot < TOPK))


@triton.jit
def _score_block(q, k_tile_ptr, ok, b, pos, row_ok, row_blocks, out_row, offs_s, k_scale, BLOCK_SIZE: tl.constexpr,
                 FP32_IEEE: tl.constexpr, FP8_BITS: tl.constexpr):
    """Pooled scores of key block b for the tile's rows: loads the [BLOCK_SIZE, D] index-K page at k_tile_ptr
    (all masked off when `ok` is False: a ragged group's padding slot), one dot with q [BLOCK_M, D], causal mask
    (key j <= pos of the row), max over the block times k_scale; stores out_row[m] + b for rows with b visible."""
    if ok is None:
        k = tl.load(k_tile_ptr)
    else:
        k = tl.load(k_tile_ptr, mask=ok, other=0.0)
    k = cache_tile_to(k, q.dtype, FP8_BITS)  # FP8 cache: raw values (exact cast; bit moves under FP8_BITS)
    if FP32_IEEE:  # fp32 inputs, or the interpreter (whose bf16 tl.dot is wrong): exact fp32 products
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BS] fp32
    j = b * BLOCK_SIZE + offs_s
    s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
    best = tl.max(s, axis=1) * k_scale  # [BLOCK_M]
    tl.store(out_row + b, best, mask=row_ok & (b < row_blocks))


@triton.jit
def _index_score_kernel(
    q_ptr, k_ptr, bt_ptr, pos_ptr, qsl_ptr, score_ptr, out_ptr, cnt_ptr,
    num_reqs, num_tokens, max_blocks,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_bt, k_scale,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, FP32_IEEE: tl.constexpr, REQS_P2: tl.constexpr,
    VEC_SEARCH: tl.constexpr, FUSED_TOPK: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
    NB_P2: tl.constexpr, RANK_SELECT: tl.constexpr, PAGES_P2: tl.constexpr, PAGES_PER_ITER: tl.constexpr,
    FP8_BITS: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if VEC_SEARCH:
        r, q_start, q_end = _find_request_vec(qsl_ptr, pid, num_reqs, BLOCK_Q, REQS_P2)
    else:
        r = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q)
        q_start = tl.load(qsl_ptr + r, mask=r < num_reqs, other=0)
        q_end = tl.load(qsl_ptr + r + 1, mask=r < num_reqs, other=0)
    if r >= num_reqs:
        if FUSED_TOPK:  # padding tokens (past query_start_loc[-1]): this program's share of them gets all -1
            if split == 0:
                total = tl.load(qsl_ptr + num_reqs)
                _fill_padding(out_ptr, total, pid - (total // BLOCK_Q + num_reqs), num_tokens,
                              NUM_HEADS, BLOCK_Q, TOPK, TOPK_P2)
        return
    tile = pid - (q_start // BLOCK_Q + r)
    t0 = q_start + tile * BLOCK_Q
    if t0 >= q_end:
        return
    BLOCK_M: tl.constexpr = BLOCK_Q * NUM_HEADS
    offs_m = tl.arange(0, BLOCK_M)
    t = t0 + offs_m // NUM_HEADS  # [BLOCK_M] token of each row
    h = offs_m % NUM_HEADS  # [BLOCK_M] index head (= kv group) of each row
    row_ok = t < q_end
    bt_row = bt_ptr + r * stride_bt
    if PAGES_P2 > 0:  # decode: this split's whole block-table slice in one vector load, in flight with pos and q
        slot = tl.arange(0, PAGES_P2)
        blk = split + slot * NUM_SPLITS
        pages = tl.load(bt_row + blk, mask=blk < max_blocks, other=0)  # [PAGES_P2] page of slot i
    pos = tl.load(pos_ptr + t, mask=row_ok, other=-1)  # [BLOCK_M] int64
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
    row_blocks = tl.where(pos >= 0, pos // BLOCK_SIZE + 1, 0)  # visible blocks per row
    n_blocks = tl.minimum(tl.max(row_blocks, axis=0), max_blocks)
    offs_s = tl.arange(0, BLOCK_SIZE)
    k_off = offs_s[:, None] * stride_ks + offs_d[None, :]  # [BS, D]
    out_row = score_ptr + h.to(tl.int64) * num_tokens * max_blocks + t.to(tl.int64) * max_blocks
    if PAGES_P2 > 0:  # decode: the split's blocks split, split + NUM_SPLITS, ... are visited by slot i
        n_mine = (n_blocks - split + NUM_SPLITS - 1) // NUM_SPLITS  # >= 0 (split < NUM_SPLITS)
        for i0 in range(0, n_mine, PAGES_PER_ITER):
            for p in tl.static_range(PAGES_PER_ITER):  # the last group may be ragged: its extra slots are masked
                i = i0 + p
                page = tl.sum(tl.where(slot == i, pages, 0), axis=0).to(tl.int64)  # no memory access
                _score_block(q, k_ptr + page * stride_kb + k_off, i < n_mine, split + i * NUM_SPLITS, pos, row_ok,
                             row_blocks, out_row, offs_s, k_scale, BLOCK_SIZE, FP32_IEEE, FP8_BITS)
    else:  # prefill: many blocks per program; walk the block table, the next page id prefetched one block ahead
        page_next = tl.load(bt_row + split, mask=split < n_blocks, other=0).to(tl.int64)
        for b in range(split, n_blocks, NUM_SPLITS):
            page = page_next
            page_next = tl.load(bt_row + b + NUM_SPLITS, mask=b + NUM_SPLITS < n_blocks, other=0).to(tl.int64)
            _score_block(q, k_ptr + page * stride_kb + k_off, None, b, pos, row_ok, row_blocks, out_row, offs_s,
                         k_scale, BLOCK_SIZE, FP32_IEEE, FP8_BITS)
    if FUSED_TOPK:  # the last of the tile's NUM_SPLITS programs selects; counter protocol in split_counters.py
        if NUM_SPLITS == 1:
            tl.debug_barrier()  # this program's own score stores (other threads) before its loads
            _select_tile(score_ptr, pos_ptr, out_ptr, t0, tl.minimum(q_end - t0, BLOCK_Q), num_tokens, max_blocks,
                         NUM_HEADS, BLOCK_SIZE, TOPK, TOPK_P2, NB_P2, RANK_SELECT)
        else:
            cnt = cnt_ptr + pid
            if arrive(cnt, NUM_SPLITS):
                tl.debug_barrier()
                _select_tile(score_ptr, pos_ptr, out_ptr, t0, tl.minimum(q_end - t0, BLOCK_Q), num_tokens,
                             max_blocks, NUM_HEADS, BLOCK_SIZE, TOPK, TOPK_P2, NB_P2, RANK_SELECT)
                release(cnt)


@triton.jit
def _index_topk_kernel(
    score_ptr, pos_ptr, qsl_ptr, out_ptr,
    num_reqs, num_tokens, max_blocks,
    BLOCK_SIZE: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, NB_P2: tl.constexpr,
    RANK_SELECT: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    total = tl.load(qsl_ptr + num_reqs)
    pos = tl.load(pos_ptr + t)
    n_vis = tl.where((pos >= 0) & (t < total), pos // BLOCK_SIZE + 1, 0)
    n_vis = tl.minimum(n_vis, max_blocks)
    row = h.to(tl.int64) * num_tokens + t
    _select_row(score_ptr + row * max_blocks, out_ptr + row * TOPK, n_vis, TOPK, TOPK_P2, NB_P2, RANK_SELECT, "")


def default_num_splits(num_tokens: int, num_reqs: int, max_blocks: int, block_q: int, device: torch.device) -> int:
    """Split count over key blocks from shape constants only (so a CUDA graph bucket always gets the same grid):
    aim for PROGRAMS_PER_SM programs per SM, power of two, at most next_pow2(max_blocks)."""
    tiles = triton.cdiv(num_tokens, block_q) + num_reqs
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms(device), max(tiles, 1))
    return max(1, min(triton.next_power_of_2(want), triton.next_power_of_2(max(max_blocks, 1))))


@dataclass(frozen=True)
class ScoreLaunch:
    """Resolved tunables of one `_index_score_kernel` launch (from shapes and dtypes only: CUDA-graph safe)."""
    num_splits: int
    num_stages: int
    pages_p2: int  # 0: walk the block table in the loop; else the up-front page-id vector length (decode)
    pages_per_iter: int
    fp8_bit_cast: bool
    maxnreg: Optional[int]  # register cap per thread (None: ptxas decides)


def score_launch(index_q: torch.Tensor, index_k_cache: torch.Tensor, block_table: torch.Tensor, block_q: int,
                 num_splits: Optional[int] = None, num_stages: Optional[int] = None,
                 prefetch_pages: Optional[bool] = None, pages_per_iter: int = 1,
                 fp8_bit_cast: Optional[bool] = None, num_warps: int = 4,
                 maxnreg: Optional[int] = None) -> ScoreLaunch:
    """Defaults of the score kernel's tunables (each None is resolved here; see `msa_indexer_triton`).

    Decode-shaped launches (T <= B) load each split program's block-table slice up front (`prefetch_pages`, at most
    PREFETCH_PAGES_MAX ids), so no page-id load sits in front of a K tile, and pipeline the K tiles with num_stages:
    3 for 1-byte caches (two 16 KiB tiles in flight per program at block 128 x dim 128), 2 for 2-byte ones (a second
    32 KiB buffer would leave room for 3 of the PROGRAMS_PER_SM programs); registers are capped at 65536 /
    (PROGRAMS_PER_SM * 32 * num_warps) = 128 for 4 warps (ptxas gave the bf16 variant 136: again 3 per SM;
    maxnreg=0: no cap). Other shapes keep the block-table walk and 3 stages. float8_e4m3fn caches with bf16 queries
    on sm_90+ take the bit-move cast (`e4m3_to_bf16`) at every shape."""
    T, B, max_blocks = index_q.shape[0], block_table.shape[0], block_table.shape[1]
    decode = T <= B
    if num_splits is None:
        num_splits = default_num_splits(T, B, max_blocks, block_q, index_q.device)
    if prefetch_pages is None:
        prefetch_pages = decode and triton.cdiv(max_blocks, num_splits) <= PREFETCH_PAGES_MAX
    if num_stages is None:
        if prefetch_pages:
            num_stages = 3 if index_k_cache.element_size() == 1 else 2
        else:  # H200 sweep (benchmarks/results/m3_suite/run5_msa_sweep.json), block-table walk: decode at 8K ran
            # 23.4 vs 26.8 us at B=32 and 71.2 vs 77.9 us at B=128 with 2 stages instead of 3
            num_stages = 2 if decode else 3
    fp8_bit_cast = resolve_fp8_bit_cast(index_q, index_k_cache, fp8_bit_cast)
    if pages_per_iter < 1:
        raise ValueError(f"pages_per_iter must be >= 1, got {pages_per_iter}")
    pages_p2 = triton.next_power_of_2(triton.cdiv(max_blocks, num_splits)) if prefetch_pages else 0
    if maxnreg is None and prefetch_pages:
        cap = 65536 // (PROGRAMS_PER_SM * 32 * num_warps)
        maxnreg = cap if cap >= 128 else None  # below 128 the tile's registers would spill: no cap
    return ScoreLaunch(num_splits, num_stages, pages_p2, pages_per_iter, bool(fp8_bit_cast), maxnreg or None)


def msa_indexer_triton(
    index_q: torch.Tensor,  # [T, Hkv, D] bf16/fp16/fp32
    index_k_cache: torch.Tensor,  # [num_blocks, block_size, D], same dtype or FP8
    block_table: torch.Tensor,  # [B, max_blocks] int32 physical block ids
    positions: torch.Tensor,  # [T] int64 absolute positions
    query_start_loc: torch.Tensor,  # [B+1] int32
    topk: int,
    num_splits: Optional[int] = None,  # None: `default_num_splits`
    out: Optional[torch.Tensor] = None,  # [Hkv, T, topk] int32, written in full
    scores: Optional[torch.Tensor] = None,  # scratch [Hkv, T, max_blocks] fp32
    num_warps: int = 4,
    num_stages: Optional[int] = None,  # None: see `score_launch`
    fused_topk: Optional[bool] = None,  # None: FUSED_TOPK and T <= B (decode-shaped); True: fused for any shape
    vec_search: Optional[bool] = None,  # None: B < VEC_SEARCH_MAX_REQS
    index_k_scale: float = 1.0,  # per-tensor scale of an FP8 index-K cache (stored * scale)
    prefetch_pages: Optional[bool] = None,  # None: T <= B (split's page ids loaded up front, no in-loop table load)
    pages_per_iter: int = 1,  # K tiles issued per loop iteration on the prefetch path (the last group ragged)
    fp8_bit_cast: Optional[bool] = None,  # None: when `_common.fp8_bit_cast_ineligible` passes
    maxnreg: Optional[int] = None,  # registers per thread; None: see `score_launch`, 0: no cap
) -> torch.Tensor:
    """Triton indexer. Returns `selected_block_ids [Hkv, T, topk] int32` (layout in the module docstring).

    The fused path uses (and leaves zero) the persistent counter buffer `split_counters("msa_indexer", device,
    cdiv(T, BLOCK_Q) + B)`; the first call at a larger shape must be eager (it may allocate), which the runner's
    CUDA-graph warm-up guarantees. Tunables (num_splits .. fp8_bit_cast) change speed only, never the output.

    Preconditions (asserted): the index-K rows of every position <= positions[t] are already in the cache;
    block_size and D are powers of two; T tokens are packed per request as described by query_start_loc.
    """
    T, H, D = index_q.shape
    nb_total, bs, Dk = index_k_cache.shape
    B, max_blocks = block_table.shape
    assert Dk == D, f"index_q dim {D} != index_k_cache dim {Dk}"
    check_cache_dtype(index_q.dtype, index_k_cache.dtype)
    assert index_q.stride(-1) == 1 and index_k_cache.is_contiguous()
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    assert query_start_loc.shape == (B + 1,) and query_start_loc.dtype == torch.int32
    assert positions.shape == (T,)
    assert topk >= 1
    dev = index_q.device
    block_q = triton.next_power_of_2(max(1, 16 // H) if T > 0 else 1)
    cfg = score_launch(index_q, index_k_cache, block_table, block_q, num_splits, num_stages, prefetch_pages,
                       pages_per_iter, fp8_bit_cast, num_warps, maxnreg)
    if scores is None:
        scores = torch.empty((H, T, max_blocks), dtype=torch.float32, device=dev)
    assert scores.shape == (H, T, max_blocks) and scores.dtype == torch.float32 and scores.is_contiguous()
    if out is None:
        out = torch.empty((H, T, topk), dtype=torch.int32, device=dev)
    assert out.shape == (H, T, topk) and out.dtype == torch.int32 and out.is_contiguous()
    if T == 0:
        return out
    positions = positions.to(torch.int64)
    nb_p2 = triton.next_power_of_2(max_blocks)
    grid = (triton.cdiv(T, block_q) + B, cfg.num_splits)
    fused = (FUSED_TOPK and T <= B) if fused_topk is None else fused_topk
    if vec_search is None:
        vec_search = B < VEC_SEARCH_MAX_REQS
    counters = split_counters(COUNTER_KEY, dev, grid[0]) if fused and cfg.num_splits > 1 else out  # else unused
    _index_score_kernel[grid](
        index_q, index_k_cache, block_table, positions, query_start_loc, scores, out, counters,
        B, T, max_blocks,
        index_q.stride(0), index_q.stride(1), index_k_cache.stride(0), index_k_cache.stride(1), block_table.stride(0),
        float(index_k_scale), NUM_HEADS=H, HEAD_DIM=D, BLOCK_SIZE=bs, BLOCK_Q=block_q, NUM_SPLITS=cfg.num_splits,
        REQS_P2=reqs_p2(B), VEC_SEARCH=bool(vec_search),
        FP32_IEEE=index_q.dtype == torch.float32 or interpreting(), FUSED_TOPK=bool(fused), TOPK=topk,
        TOPK_P2=triton.next_power_of_2(topk), NB_P2=nb_p2, RANK_SELECT=nb_p2 <= 128, PAGES_P2=cfg.pages_p2,
        PAGES_PER_ITER=cfg.pages_per_iter, FP8_BITS=cfg.fp8_bit_cast, num_warps=num_warps,
        num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    if fused:
        return out
    _index_topk_kernel[(T, H)](
        scores, positions, query_start_loc, out, B, T, max_blocks,
        BLOCK_SIZE=bs, TOPK=topk, TOPK_P2=triton.next_power_of_2(topk),
        NB_P2=nb_p2, RANK_SELECT=nb_p2 <= 128, num_warps=4,
    )
    return out


def msa_indexer_ineligible(index_q: torch.Tensor, index_k_cache: torch.Tensor,
                           local_blocks: int = 1) -> Optional[str]:
    """Eligibility rule of the Triton path: None when it may run, else the reason."""
    if local_blocks != 1:
        return f"local_blocks {local_blocks} (the kernel forces the own block only)"
    return triton_ok(index_q, index_k_cache) or pow2_dot_reason(index_q, index_k_cache, "index_head_dim")


@timed_op
def msa_indexer(
    index_q: torch.Tensor, index_k_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
    query_start_loc: torch.Tensor, topk: int, *, local_blocks: int = 1, index_k_scale: float = 1.0,
    use_triton: bool = True, **kwargs,
) -> torch.Tensor:
    """Block selection for this step's tokens: `msa_indexer_triton` when asked for (`use_triton`, the backend) and
    `msa_indexer_ineligible` passes, else `msa_indexer_ref`; recorded as op "msa_indexer". Arguments as
    `msa_indexer_triton` plus local_blocks (forced blocks per token); index_k_scale: the FP8 index-K cache's
    per-tensor scale; kwargs are Triton launch options. Returns selected_block_ids [Hkv, T, topk] int32 (module
    docstring layout)."""
    reason = msa_indexer_ineligible(index_q, index_k_cache, local_blocks)
    if decide_triton(OP, index_q.shape[0], use_triton, reason, index_k_cache.dtype):
        return msa_indexer_triton(index_q, index_k_cache, block_table, positions, query_start_loc, topk,
                                  index_k_scale=index_k_scale, **kwargs)
    return msa_indexer_ref(index_q, index_k_cache, block_table, positions, query_start_loc, topk, local_blocks,
                           index_k_scale)


# ----------------------------------------------------------------------------------------------------------------
# torch reference (design/minimax_m3.md §3.5; transformers `MiniMaxM3VLIndexer.forward`)


def msa_block_scores(index_q: torch.Tensor, index_k: torch.Tensor, q_positions: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """Block-pooled index scores S_g(t, b) of one sequence: index_q [Tq, ni, di], index_k [S, di] (keys of positions
    0 .. S-1), q_positions [Tq] int (< S). Returns [ni, Tq, ceil(S / block_size)] float32 (float64 for float64
    inputs), -inf where a block holds no visible key."""
    s = index_k.shape[0]
    ct = torch.float64 if index_q.dtype == torch.float64 else torch.float32
    scores = torch.einsum("tgd,sd->gts", index_q.to(ct), index_k.to(ct))  # [ni, Tq, S]
    future = torch.arange(s, device=index_k.device)[None, :] > q_positions[:, None]  # [Tq, S]
    scores = scores.masked_fill(future[None], float("-inf"))
    nb = -(-s // block_size)
    scores = torch.nn.functional.pad(scores, (0, nb * block_size - s), value=float("-inf"))
    return scores.view(scores.shape[0], scores.shape[1], nb, block_size).amax(dim=-1)


def msa_select_blocks(block_scores: torch.Tensor, q_positions: torch.Tensor, block_size: int, topk: int,
                      local_blocks: int) -> torch.Tensor:
    """Top-k of `msa_block_scores` output [ni, Tq, nb] with blocks b_t - l (l < local_blocks, clamped at 0) forced
    and lower ids winning ties. q_positions [Tq] int (a token with position < 0 selects nothing). Returns
    selected_block_ids [ni, Tq, topk] int32 in the module docstring layout (ascending, local block last, -1)."""
    assert 1 <= local_blocks <= topk, (local_blocks, topk)
    ni, tq, nb = block_scores.shape
    q_block = (q_positions.long() // block_size)[None, :, None]  # [1, Tq, 1]
    blocks = torch.arange(nb, device=block_scores.device)
    forced = (blocks <= q_block) & (blocks > q_block - local_blocks)
    scores = block_scores.masked_fill(forced, float("inf")).masked_fill(blocks > q_block, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # ties: lower block id first
    n_valid = (q_block + 1).clamp(min=0, max=topk)  # [1, Tq, 1]
    k = min(topk, nb)
    top = torch.where(torch.arange(k, device=order.device) < n_valid, order[..., :k], nb)  # nb = "none"
    top = torch.sort(top, dim=-1).values
    out = torch.full((ni, tq, topk), -1, dtype=torch.int32, device=block_scores.device)
    out[..., :k] = torch.where(top < nb, top, -1).to(torch.int32)
    return out


def msa_indexer_ref(
    index_q: torch.Tensor, index_k_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
    query_start_loc: torch.Tensor, topk: int, local_blocks: int = 1, index_k_scale: float = 1.0,
) -> torch.Tensor:
    """Plain-torch `msa_indexer` (same contract; local_blocks >= 1): per request, gather index-K through the block
    table up to its last query position (dequantized: stored * index_k_scale), `msa_block_scores`, `msa_select_blocks`. Reads query_start_loc and
    positions on the host (a sync; reference only). Returns [Hkv, T, topk] int32."""
    T, H, _ = index_q.shape
    out = torch.full((H, T, topk), -1, dtype=torch.int32, device=index_q.device)
    qsl, pos_host = query_start_loc.tolist(), positions.tolist()
    bs = index_k_cache.shape[1]
    for r in range(len(qsl) - 1):
        t0, t1 = qsl[r], qsl[r + 1]
        if t1 == t0 or max(pos_host[t0:t1]) < 0:
            continue
        keys = dequantize_ref(gather_sequence(index_k_cache, block_table[r], max(pos_host[t0:t1]) + 1),
                              index_k_scale, reference_dtype(index_q.dtype))
        pos = positions[t0:t1].long()
        scores = msa_block_scores(index_q[t0:t1], keys, pos, bs)
        out[:, t0:t1] = msa_select_blocks(scores, pos, bs, topk, local_blocks)
    return out
