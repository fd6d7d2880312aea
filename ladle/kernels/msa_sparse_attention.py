"""MSA block-sparse attention over the blocks chosen by the indexer (prefill, chunked prefill and decode alike).

Math (design/minimax_m3.md §3.5 step 10): query head h of token t belongs to group g = h // (Hq / Hkv); it attends
to the keys j with j // block_size in Sel(g, t) and j <= positions[t], softmax(q.k * scale) in fp32, output
sum p_j v_j. `selected_block_ids [Hkv, T, topk] int32` holds logical block ids, valid entries left-packed, -1 after
(ARCHITECTURE.md); the order of the valid entries does not matter here. Rows with no valid entry (padding) give 0.

Per-token kernel (query-major, vLLM `minimax_m3/common/ops/sparse_attn.py` style, written from the description in
design/kernels_and_limits.md §3.2): grid (T, Hkv, NUM_SPLITS). One program loads the G = Hq/Hkv query heads of its
group as the MMA M dimension (padded to >= 16), walks its share of the selected slots (split s takes slots
[s*per, (s+1)*per)), maps each logical block through block_table to a page, loads the [block_size, D] K and V
tiles once for all G heads, and runs an online base-2 softmax. NUM_SPLITS comes from shape constants only, so
decode is CUDA-graph capturable.

With NUM_SPLITS > 1 each program writes a partial (acc, max, sum) to fp32 scratch, and the partials are combined by
the log-sum-exp merge of msa_sparse_attention_merge.py in one of two ways (launcher argument `fused_merge`,
default the module flag FUSED_MERGE = True):
  * fused (one launch): after its partial stores every split program increments the arrival counter of its
    (token, kv-head), `counters[t * Hkv + g]` (int32, `split_counters("msa_sparse_attention", ...)`, acq_rel
    atomic); the program that sees NUM_SPLITS - 1 arrived last: it reads all NUM_SPLITS partials of its G heads,
    writes the output and stores 0 back into the counter. Reset invariant: the counter buffer is zero before and
    after every launch (zeroed once at allocation, then kept zero by the last programs; never re-zeroed by a host
    op, so CUDA-graph replays need nothing extra). See ladle/kernels/split_counters.py.
  * two-launch: `_merge_kernel`, grid (T, Hq), as a second launch.

Query-tile kernel (prefill; `_sparse_attn_tile_kernel`, grid (cdiv(T, TQ), Hkv), no split-K). The per-token
kernel runs M = G = 16 MMAs (mma.sync, no wgmma at this M) and re-reads every K/V tile from L2 once per token: an
8K-token FP8 prefill of one TP4 rank spends 92.9 ms over 57 layers in it, 1.63 ms per layer call, about 8x its FLOP
roofline (benchmarks/results/round6/proxy60_fp8_profile.log). The tile kernel takes TQ consecutive tokens per
program, rows = TQ x G (row i: token t0 + i // G, head g*G + i % G; TQ = 4 at G = 16 gives M = 64, a wgmma tile),
and walks the UNION of the tile's selected keys once, so tokens that share blocks (neighbours mostly do) share
each K/V tile load and MMA. Keys are (request, logical block) pairs, key = r_t * max_blocks + block, so a tile may
straddle requests (mixed batches, chunked prefill). The [TQ * TOPK] keys are loaded once; a [N, N] compare marks
first occurrences, tl.cumsum ranks them, n_union counts them; iteration u picks the key of rank u (and its page,
looked up before the loop) by one masked reduction, so there is no loop-carried state and the K/V tile loads are
cp.async-pipelined (sm_90 compile: wgmma for both dots). Rows whose token did not select key u get s = -inf
(tested against the keys loaded a second time in a [rows, TOPK] layout), plus the causal limit j <= positions[t];
the online softmax, FP8 cast-on-load and scale folding are the per-token kernel's, and an all -inf row stays exact
(m_safe). Out-of-range tokens, positions < 0, tokens outside every request and rows with no selection give 0.

Choice (`launch_plan`, shape constants only, so CUDA graphs replay): the tile kernel with TILE_TOKENS tokens when
num_splits == 1 and T >= TILE_TOKENS * B (about TILE_TOKENS or more tokens per request: prefill and mixed
prefill/decode batches), else the per-token kernel (decode keeps its split-K path). The launcher argument
`query_tile` forces one (None auto, 0 per-token, TQ tile). The dispatch bucket ends in " tile<TQ>" or " token"
(`launch_path`), so a benchmark names what ran. A/B: benchmarks/gpu_msa_sparse_ab.py.

`msa_sparse_attention` is the entry point (use_triton + the eligibility rule `msa_sparse_attention_ineligible`,
recorded as op "msa_sparse_attention"); `msa_sparse_attention_ref` the torch reference.

FP8 KV caches (`--kv-cache-dtype fp8*`): K/V tiles are cast to q's dtype on load (exact; float8_e4m3fn to bf16 on
sm_90 by bit moves, `_common.cache_tile_to`, launcher argument `fp8_bit_cast`; Triton's cast issues two
conversion-unit instructions per value, 2 x 128 x 128 values per key block), k_scale is folded into the softmax
scale and v_scale into the accumulator before it is stored (final output or split partial; the merge is linear in
the accumulators); the reference dequantizes the gathered rows. The dispatch bucket carries " kv=fp8_*".

Request lookup: a program finds its token's request by a binary search over query_start_loc (log2(B) dependent
loads), or, when B < VEC_SEARCH_MAX_REQS (or `vec_search=True`), by one vector load of query_start_loc.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ladle.kernels._common import (LOG2E, cache_tile_to, check_cache_dtype, check_cache_pair, decide_triton,
                                   dequantize_ref, interpreting, num_sms, pow2_dot_reason, reqs_p2,
                                   resolve_fp8_bit_cast, tl, triton, triton_ok)
from ladle.kernels.msa_sparse_attention_merge import _merge_kernel, merge_group
from ladle.kernels.paged_attention import gather_sequence, masked_attention_ref, reference_dtype
from ladle.kernels.split_counters import arrive, release, split_counters
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "msa_sparse_attention"
# Below this many requests, find a token's request with one vector load of query_start_loc instead of a binary
# search (log2(B) dependent loads at the head of every program); 0 turns it off. Launcher argument `vec_search`
# overrides it per call (the GPU suite times both).
VEC_SEARCH_MAX_REQS = 4096
# Default of the launcher's `fused_merge` (None): merge the split-K partials in the last-arriving split program
# (one launch) instead of a separate `_merge_kernel` launch.
FUSED_MERGE = True
# Tokens per program of the tile kernel when the launcher chooses it (`launch_plan`, query_tile=None): 4 (M = 64 at
# G = 16), measured best on the H200 (`_launch_tile`'s docstring; TQ 8 with 8 warps: 1.17x / 2.48x / 0.74x where
# TQ 4 gives 1.47x / 2.78x / 1.04x the per-token kernel).
TILE_TOKENS = 4
COUNTER_KEY = OP
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET), pow2 block_size and head_dim")


@triton.jit
def _token_request(qsl_ptr, t, num_reqs):
    """Request r with qsl[r] <= t < qsl[r+1] (binary search); num_reqs when t is past the last request."""
    lo = 0
    hi = num_reqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _token_request_vec(qsl_ptr, t, num_reqs, REQS_P2: tl.constexpr):
    """`_token_request` with one vector load instead of log2(B) dependent scalar loads."""
    idx = tl.arange(0, REQS_P2)
    ok = (idx >= 1) & (idx <= num_reqs)
    qs = tl.load(qsl_ptr + idx, mask=ok, other=0)
    return tl.sum((ok & (qs <= t)).to(tl.int32), axis=0)


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online base-2 softmax over one key tile: s [R, BS] scores in log2 units (-inf = masked), running max m_i and
    sum l_i [R] -> (new max, new sum, p [R, BS], alpha [R] the rescale of the old accumulator). A row masked so far
    keeps max -inf and sum 0 exactly (its exponent base is 0, not -inf)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def _pv_step(acc, alpha, p, vt, FP32_IEEE: tl.constexpr):
    """acc [R, D] fp32 rescaled by alpha plus p @ vt (p rounded to V's dtype first; fp32 IEEE dots under
    FP32_IEEE)."""
    if FP32_IEEE:
        out = acc * alpha[:, None] + tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), input_precision="ieee")
    else:
        out = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return out


@triton.jit
def _sparse_attn_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, sel_ptr, pos_ptr, qsl_ptr, out_ptr, pacc_ptr, pml_ptr, cnt_ptr,
    num_reqs, num_tokens, sm_scale_log2, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, NUM_SPLITS: tl.constexpr, SLOTS_PER_SPLIT: tl.constexpr,
    FP32_IEEE: tl.constexpr, SPLIT_DECODE: tl.constexpr, REQS_P2: tl.constexpr,
    VEC_SEARCH: tl.constexpr, FUSED_MERGE: tl.constexpr, FP8_BITS: tl.constexpr,
):
    t = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    if VEC_SEARCH:
        r = _token_request_vec(qsl_ptr, t, num_reqs, REQS_P2)
    else:
        r = _token_request(qsl_ptr, t, num_reqs)
    pos = tl.load(pos_ptr + t)
    sel_row = sel_ptr + (g.to(tl.int64) * num_tokens + t) * TOPK
    slots = tl.arange(0, TOPK_P2)
    sel = tl.load(sel_row + slots, mask=slots < TOPK, other=-1)
    n_valid = tl.sum((sel >= 0).to(tl.int32), axis=0)
    n_valid = tl.where((r < num_reqs) & (pos >= 0), n_valid, 0)
    r = tl.minimum(r, num_reqs - 1)
    if SPLIT_DECODE:  # few slots per program: fetch all pages up front, no dependent loads inside the loop
        pages = tl.load(bt_ptr + r * stride_bt + sel, mask=sel >= 0, other=0).to(tl.int64)  # [TOPK_P2]
    lo = split * SLOTS_PER_SPLIT
    hi = tl.minimum(lo + SLOTS_PER_SPLIT, n_valid)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_SIZE)
    head = g * GROUP + offs_g
    g_ok = offs_g < GROUP
    q = tl.load(q_ptr + t * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    kv_off = offs_s[:, None] * stride_ks + g * stride_kh + offs_d[None, :]  # [BS, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for k in range(lo, hi):
        if SPLIT_DECODE:
            b = tl.sum(tl.where(slots == k, sel, 0), axis=0)
            page = tl.sum(tl.where(slots == k, pages, 0), axis=0)
        else:  # many slots per program (prefill): scalar loads pipeline better than per-slot vector reductions
            b = tl.load(sel_row + k)
            page = tl.load(bt_ptr + r * stride_bt + b).to(tl.int64)
        kt = cache_tile_to(tl.load(k_ptr + page * stride_kb + kv_off), q.dtype, FP8_BITS)  # FP8: raw values
        if SPLIT_DECODE:  # decode: issue V with K so both tiles are in flight together (few iterations per program)
            vt = cache_tile_to(tl.load(v_ptr + page * stride_kb + kv_off), q.dtype, FP8_BITS)
        if FP32_IEEE:  # fp32 inputs, or the interpreter (whose bf16 tl.dot is wrong)
            s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kt))
        s = s * sm_scale_log2
        j = b * BLOCK_SIZE + offs_s
        s = tl.where(j[None, :] <= pos, s, float("-inf"))
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
        if not SPLIT_DECODE:
            vt = cache_tile_to(tl.load(v_ptr + page * stride_kb + kv_off), q.dtype, FP8_BITS)
        acc = _pv_step(acc, alpha, p, vt, FP32_IEEE)
    acc = acc * v_scale

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # partials: pacc [T, Hq, NUM_SPLITS, D] fp32, pml [T, Hq, NUM_SPLITS, 2] fp32 (max in log2 units, sum)
        base = (t.to(tl.int64) * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(pacc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_ok[:, None])
        tl.store(pml_ptr + base * 2, m_i, mask=g_ok)
        tl.store(pml_ptr + base * 2 + 1, l_i, mask=g_ok)
        if FUSED_MERGE:  # last of the NUM_SPLITS programs of (t, g) merges; counter protocol in split_counters.py
            cnt = cnt_ptr + t.to(tl.int64) * tl.num_programs(1) + g
            if arrive(cnt, NUM_SPLITS):
                tl.debug_barrier()
                o = merge_group(pacc_ptr, pml_ptr, base - split, g_ok, HEAD_DIM, NUM_SPLITS, BLOCK_G)
                tl.store(out_ptr + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
                release(cnt)


@triton.jit
def _sparse_attn_tile_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, sel_ptr, pos_ptr, qsl_ptr, out_ptr,
    num_reqs, num_tokens, max_blocks, sm_scale_log2, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, FP32_IEEE: tl.constexpr, REQS_P2: tl.constexpr,
    VEC_SEARCH: tl.constexpr, FP8_BITS: tl.constexpr,
):
    """Query-tile program: TQ consecutive tokens x GROUP heads of KV head g as the MMA rows (module docstring)."""
    t0 = tl.program_id(0) * TQ
    g = tl.program_id(1)
    N: tl.constexpr = TQ * TOPK_P2
    NO_KEY: tl.constexpr = 2147483647
    idx = tl.arange(0, N)  # flattened (token, slot) of the tile's selections
    tok_f = idx // TOPK_P2
    rows = tl.arange(0, BLOCK_M)  # row i: token t0 + i // GROUP, head g * GROUP + i % GROUP
    tok_r = rows // GROUP
    req_f = tl.full([N], -1, tl.int32)  # the token's request, -1: no request / position < 0 / past T
    req_r = tl.full([BLOCK_M], -1, tl.int32)
    pos_r = tl.full([BLOCK_M], -1, tl.int64)
    for i in tl.static_range(TQ):
        t = tl.minimum(t0 + i, num_tokens - 1)
        if VEC_SEARCH:
            r = _token_request_vec(qsl_ptr, t, num_reqs, REQS_P2)
        else:
            r = _token_request(qsl_ptr, t, num_reqs)
        pos = tl.load(pos_ptr + t)
        r = tl.where((t0 + i < num_tokens) & (r < num_reqs) & (pos >= 0), r, -1)
        req_f = tl.where(tok_f == i, r, req_f)
        req_r = tl.where(tok_r == i, r, req_r)
        pos_r = tl.where((tok_r == i) & (r >= 0), pos, pos_r)

    # keys (request, logical block) -> r * max_blocks + block; union with ranks in first-occurrence order
    sel_base = sel_ptr + g.to(tl.int64) * num_tokens * TOPK
    slot_f = idx % TOPK_P2
    sel_f = tl.load(sel_base + (t0 + tok_f) * TOPK + slot_f, mask=(slot_f < TOPK) & (t0 + tok_f < num_tokens),
                    other=-1)
    valid_f = (sel_f >= 0) & (req_f >= 0)
    key_f = tl.where(valid_f, req_f * max_blocks + sel_f, NO_KEY)
    page_f = tl.load(bt_ptr + req_f * stride_bt + sel_f, mask=valid_f, other=0).to(tl.int64)
    page_key_f = (page_f << 32) | key_f.to(tl.int64)  # one reduction per iteration fetches both
    earlier = (key_f[:, None] == key_f[None, :]) & (idx[None, :] < idx[:, None])  # [N, N]
    first = valid_f & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    rank = tl.cumsum(first.to(tl.int32), axis=0) - 1
    n_union = tl.sum(first.to(tl.int32), axis=0)
    slots = tl.arange(0, TOPK_P2)  # the same keys per row, to test "row's token selected key u"
    t_r = t0 + tok_r
    in_r = (rows < TQ * GROUP) & (t_r < num_tokens)
    sel_r = tl.load(sel_base + t_r[:, None] * TOPK + slots[None, :], mask=in_r[:, None] & (slots[None, :] < TOPK),
                    other=-1)
    key_r = tl.where((sel_r >= 0) & (req_r[:, None] >= 0), req_r[:, None] * max_blocks + sel_r, NO_KEY)

    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_SIZE)
    head = g * GROUP + rows % GROUP
    q_off = t_r[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=in_r[:, None], other=0.0)
    kv_off = offs_s[:, None] * stride_ks + g * stride_kh + offs_d[None, :]  # [BS, D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for u in range(0, n_union):
        # the unique key of rank u: no loop-carried state, so the pipeliner prefetches the K/V tiles
        page_key = tl.sum(tl.where(first & (rank == u), page_key_f, 0), axis=0)
        page = page_key >> 32
        key_u = (page_key & 0x7FFFFFFF).to(tl.int32)
        b = key_u % max_blocks
        kt = cache_tile_to(tl.load(k_ptr + page * stride_kb + kv_off), q.dtype, FP8_BITS)  # FP8: raw values
        if FP32_IEEE:  # fp32 inputs, or the interpreter (whose bf16 tl.dot is wrong)
            s = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kt))
        s = s * sm_scale_log2
        chosen = tl.max((key_r == key_u).to(tl.int32), axis=1) > 0  # [BLOCK_M]
        j = b * BLOCK_SIZE + offs_s
        s = tl.where(chosen[:, None] & (j[None, :] <= pos_r[:, None]), s, float("-inf"))
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
        vt = cache_tile_to(tl.load(v_ptr + page * stride_kb + kv_off), q.dtype, FP8_BITS)
        acc = _pv_step(acc, alpha, p, vt, FP32_IEEE)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc * v_scale / l_safe[:, None]
    tl.store(out_ptr + t_r[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=in_r[:, None])


def default_num_splits(num_tokens: int, num_kv_heads: int, topk: int, device: torch.device) -> int:
    """Splits over the top-k slots from shape constants only: the largest power of two with about 2 programs
    per SM, at most topk/2 (H200 sweep in benchmarks/gpu_m3_suite.py: B=32 -> 8, B=128 -> 2)."""
    want = max(1, (2 * num_sms(device)) // max(num_tokens * num_kv_heads, 1))
    prev_p2 = 1 << (want.bit_length() - 1)
    return max(1, min(prev_p2, triton.next_power_of_2(topk) // 2 or 1))


def launch_plan(num_tokens: int, num_reqs: int, num_kv_heads: int, topk: int, device: torch.device,
                num_splits: Optional[int] = None, query_tile: Optional[int] = None) -> tuple[int, int]:
    """(num_splits, TQ) of a launch from shape constants only (no host sync); TQ = 0 is the per-token kernel.

    query_tile None (auto): the tile kernel with TILE_TOKENS tokens when num_splits == 1 and num_tokens >=
    TILE_TOKENS * num_reqs (about TILE_TOKENS or more tokens per request: prefill), else the per-token kernel
    (decode); 0 forces the per-token kernel; TQ > 0 (a power of two) forces the tile kernel, which has no split-K
    (num_splits None then means 1, and num_splits > 1 is refused)."""
    if query_tile is not None and (query_tile < 0 or query_tile & (query_tile - 1)):
        raise ValueError(f"query_tile must be None (auto), 0 (per-token kernel) or a power of two, got {query_tile}")
    if num_splits is None:
        num_splits = 1 if query_tile else default_num_splits(num_tokens, num_kv_heads, topk, device)
    if query_tile and num_splits != 1:
        raise ValueError(f"query_tile {query_tile} (tile kernel) has no split-K: use num_splits 1 or None, "
                         f"or query_tile 0 for the per-token kernel with num_splits {num_splits}")
    if query_tile is None:
        query_tile = TILE_TOKENS if num_splits == 1 and num_tokens >= TILE_TOKENS * num_reqs else 0
    return num_splits, query_tile


def launch_path(query_tile: int) -> str:
    """Dispatch-bucket suffix naming the kernel that runs: "tile<TQ>" or "token"."""
    return f"tile{query_tile}" if query_tile else "token"


def tile_stages(q: torch.Tensor, key_cache: torch.Tensor) -> int:
    """Default pipeline stages of the tile kernel: 3 for bf16 / fp16 queries over 1- or 2-byte caches; 1 when either
    is float32 (the fp32 "ieee" path of the GPU oracle tests): its 3-stage K/V buffers overflow the SM's shared
    memory at block 128 x D 128 (H200, session 13, tests/models/test_minimax_m3_gpu_greedy.py's fp32 case: 278,528
    bytes asked, 232,448 available). Stages change no result."""
    return 3 if max(q.element_size(), key_cache.element_size()) <= 2 else 1


def _launch_tile(q, key_cache, value_cache, block_table, selected_block_ids, positions, query_start_loc, out,
                 tq: int, sm_scale_log2: float, v_scale: float, vec_search: bool, num_warps: Optional[int],
                 num_stages: Optional[int], fp8_bits: bool) -> None:
    """Launch `_sparse_attn_tile_kernel` (arguments checked by `msa_sparse_attention_triton`): grid
    (cdiv(T, tq), Hkv), rows tq x G padded to a power of two >= 16; default 4 warps up to 64 rows, else 8, and
    `tile_stages` stages, 3 for bf16 / fp8 (H200, benchmarks/gpu_msa_sparse_ab.py,
    results/round7/kernels/call2_msa_sparse_ab.json: tile 4 with 4 warps and 3 stages 1.47x the per-token kernel on
    an 8K prefill with random selections, 2.78x with local ones, 1.04x on a mixed batch; 2 stages 1.40 / 2.65 /
    1.00; 8 warps 0.6-0.8x)."""
    T, Hq, D = q.shape
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    B, topk = block_table.shape[0], selected_block_ids.shape[-1]
    block_m = max(16, triton.next_power_of_2(tq * (Hq // Hkv)))
    _sparse_attn_tile_kernel[(triton.cdiv(T, tq), Hkv)](
        q, key_cache, value_cache, block_table, selected_block_ids, positions, query_start_loc, out,
        B, T, block_table.shape[1], sm_scale_log2, float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        GROUP=Hq // Hkv, TQ=tq, BLOCK_M=block_m, HEAD_DIM=D, BLOCK_SIZE=bs, TOPK=topk,
        TOPK_P2=triton.next_power_of_2(topk), FP32_IEEE=q.dtype == torch.float32 or interpreting(),
        REQS_P2=reqs_p2(B), VEC_SEARCH=vec_search, FP8_BITS=fp8_bits,
        num_warps=num_warps or (4 if block_m <= 64 else 8), num_stages=num_stages or tile_stages(q, key_cache),
    )


def msa_sparse_attention_ineligible(q: torch.Tensor, key_cache: torch.Tensor) -> Optional[str]:
    """Eligibility rule of the Triton path: None when it may run, else the reason."""
    return triton_ok(q, key_cache) or pow2_dot_reason(q, key_cache, "head_dim")


def msa_sparse_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    selected_block_ids: torch.Tensor,  # [Hkv, T, topk] int32 logical ids, left-packed, -1 after
    positions: torch.Tensor,  # [T] int64
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: Optional[float] = None,  # default 1/sqrt(D)
    num_splits: Optional[int] = None,
    out: Optional[torch.Tensor] = None,  # [T, Hq, D] q.dtype
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,  # default 2 (H200 sweep, gpu_m3_suite run 2)
    fused_merge: Optional[bool] = None,  # None: FUSED_MERGE; only matters when num_splits > 1
    vec_search: Optional[bool] = None,  # None: B < VEC_SEARCH_MAX_REQS
    k_scale: float = 1.0,  # per-tensor scales of FP8 caches (stored * scale)
    v_scale: float = 1.0,
    query_tile: Optional[int] = None,  # None: auto, 0: per-token kernel, TQ: tile kernel (`launch_plan`)
    fp8_bit_cast: Optional[bool] = None,  # None: when `_common.fp8_bit_cast_ineligible` passes; False: Triton's cast
) -> torch.Tensor:
    """Triton sparse attention. Returns out [T, Hq, D] in q.dtype (fp32 softmax and accumulation).

    With num_splits > 1 and the fused merge, uses (and leaves zero) the persistent counter buffer
    `split_counters("msa_sparse_attention", device, T * Hkv)`; the first call at a larger T must be eager (it may
    allocate), which the runner's CUDA-graph warm-up guarantees."""
    check_cache_pair(key_cache, value_cache)
    T, Hq, D = q.shape
    nb, bs, Hkv, Dk = key_cache.shape
    assert Dk == D and Hq % Hkv == 0, f"q {tuple(q.shape)} vs cache {tuple(key_cache.shape)}"
    check_cache_dtype(q.dtype, key_cache.dtype)
    assert q.stride(-1) == 1
    Hs, Ts, topk = selected_block_ids.shape
    assert (Hs, Ts) == (Hkv, T), f"selected_block_ids must be [Hkv={Hkv}, T={T}, topk], got {(Hs, Ts, topk)}"
    assert selected_block_ids.dtype == torch.int32 and selected_block_ids.is_contiguous()
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    assert query_start_loc.dtype == torch.int32 and positions.shape == (T,)
    B = block_table.shape[0]
    assert query_start_loc.shape == (B + 1,)
    G = Hq // Hkv
    dev = q.device
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    num_splits, tq = launch_plan(T, B, Hkv, topk, dev, num_splits, query_tile)
    assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if T == 0:
        return out
    positions = positions.to(torch.int64)
    if vec_search is None:
        vec_search = B < VEC_SEARCH_MAX_REQS
    fp8_bits = resolve_fp8_bit_cast(q, key_cache, fp8_bit_cast)
    if tq:
        _launch_tile(q, key_cache, value_cache, block_table, selected_block_ids, positions, query_start_loc, out,
                     tq, scale * LOG2E * k_scale, v_scale, bool(vec_search), num_warps, num_stages, fp8_bits)
        return out
    per = triton.cdiv(topk, num_splits)
    fused_merge = FUSED_MERGE if fused_merge is None else fused_merge
    if num_splits > 1:
        pacc = torch.empty((T, Hq, num_splits, D), dtype=torch.float32, device=dev)
        pml = torch.empty((T, Hq, num_splits, 2), dtype=torch.float32, device=dev)
    else:
        pacc = pml = out  # unused
    fused = num_splits > 1 and fused_merge
    counters = split_counters(COUNTER_KEY, dev, T * Hkv) if fused else selected_block_ids  # else unused
    big = bs * D >= 128 * 128
    _sparse_attn_kernel[(T, Hkv, num_splits)](
        q, key_cache, value_cache, block_table, selected_block_ids, positions, query_start_loc, out, pacc, pml,
        counters, B, T, scale * LOG2E * k_scale, float(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        GROUP=G, BLOCK_G=max(16, triton.next_power_of_2(G)), HEAD_DIM=D, BLOCK_SIZE=bs,
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), NUM_SPLITS=num_splits, SLOTS_PER_SPLIT=per,
        FP32_IEEE=q.dtype == torch.float32 or interpreting(), SPLIT_DECODE=num_splits > 1,
        REQS_P2=reqs_p2(B), VEC_SEARCH=bool(vec_search), FUSED_MERGE=fused, FP8_BITS=fp8_bits,
        num_warps=num_warps or (8 if big and num_splits == 1 else 4), num_stages=num_stages or 2,
    )
    if num_splits > 1 and not fused:
        _merge_kernel[(T, Hq)](pacc, pml, out, Hq, out.stride(0), out.stride(1),
                               HEAD_DIM=D, NUM_SPLITS=num_splits, num_warps=4)
    return out


@timed_op
def msa_sparse_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
    selected_block_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
    scale: Optional[float] = None, *, k_scale: float = 1.0, v_scale: float = 1.0, use_triton: bool = True,
    **kwargs,
) -> torch.Tensor:
    """Sparse attention over the selected blocks: `msa_sparse_attention_triton` when asked for (`use_triton`, the
    backend) and `msa_sparse_attention_ineligible` passes, else `msa_sparse_attention_ref`; recorded as op
    "msa_sparse_attention". Arguments as `msa_sparse_attention_triton` (k_scale, v_scale: FP8 caches' per-tensor
    scales); kwargs are Triton launch options. Returns [T, Hq, D] in q's dtype."""
    reason = msa_sparse_attention_ineligible(q, key_cache)
    args = (q, key_cache, value_cache, block_table, selected_block_ids, positions, query_start_loc, scale)
    _, tq = launch_plan(q.shape[0], block_table.shape[0], key_cache.shape[2], selected_block_ids.shape[-1],
                        q.device, kwargs.get("num_splits"), kwargs.get("query_tile"))
    if decide_triton(OP, q.shape[0], use_triton, reason, key_cache.dtype, path=launch_path(tq)):
        return msa_sparse_attention_triton(*args, k_scale=k_scale, v_scale=v_scale, **kwargs)
    return msa_sparse_attention_ref(*args, k_scale=k_scale, v_scale=v_scale)


def selection_key_mask(selected_block_ids: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Expand selections to keys: [G, Tq, topk] int block ids (-1 = none) -> [G, Tq, seq_len] bool, True where the
    key's block is selected. Causality is not applied here."""
    nb = -(-seq_len // block_size)
    ids = selected_block_ids.long()
    ids = torch.where((ids < 0) | (ids >= nb), nb, ids)  # none / out of range -> a throwaway column
    keep = torch.zeros(*ids.shape[:2], nb + 1, dtype=torch.bool, device=ids.device)
    keep.scatter_(-1, ids, True)
    return keep[..., :nb].repeat_interleave(block_size, dim=-1)[..., :seq_len]


def msa_sparse_attention_ref(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
    selected_block_ids: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
    scale: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain-torch `msa_sparse_attention` (same contract): per request, gather K/V through the block table up to
    its last query position, dequantize (stored * k_scale / v_scale) and attend under (selected block) AND (j <= p_t), math in float32 (float64 for float64
    inputs; `masked_attention_ref`). Reads query_start_loc and positions on the host (a sync; reference only).
    Tokens outside every request, with position < 0 or with no selected block give 0."""
    T, Hq, D = q.shape
    bs = key_cache.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros((T, Hq, D), dtype=reference_dtype(q.dtype), device=q.device)
    qsl, pos_host = query_start_loc.tolist(), positions.tolist()
    for r in range(len(qsl) - 1):
        t0, t1 = qsl[r], qsl[r + 1]
        if t1 == t0 or max(pos_host[t0:t1]) < 0:
            continue
        seq_len = max(pos_host[t0:t1]) + 1
        k = dequantize_ref(gather_sequence(key_cache, block_table[r], seq_len), k_scale, out.dtype)
        v = dequantize_ref(gather_sequence(value_cache, block_table[r], seq_len), v_scale, out.dtype)
        pos = positions[t0:t1].long()
        causal = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]  # [Tq, S]; pos < 0: nothing
        mask = selection_key_mask(selected_block_ids[:, t0:t1], seq_len, bs) & causal[None]
        out[t0:t1] = masked_attention_ref(q[t0:t1], k, v, mask, scale)
    return out.to(q.dtype)
