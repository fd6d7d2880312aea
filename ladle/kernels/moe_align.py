"""Align (token, slot) pairs by expert for the fused MoE GEMMs, on the device, with no host sync.

Given topk_ids [T, k] (k includes a packed shared-expert column if the router appended one), the T*k flat pairs
are bucketed by expert and each bucket is padded to a multiple of BLOCK_M (kernels_and_limits.md §1.1, the vLLM
`moe_align_block_size` contract, written from that description):

    sorted_token_ids [max_padded] int32   flat pair index (t*k + slot) of each row; sentinel T*k for padding rows
    expert_ids       [max_padded // BLOCK_M] int32   expert of each BLOCK_M tile; -1 for tiles past the end
    num_tokens_post_padded [1] int32      rows in use (a multiple of BLOCK_M), read by the GEMMs on the device

    max_padded = roundup(min(T*k*BLOCK_M, T*k + min(E, T*k)*(BLOCK_M-1)), BLOCK_M)   (worst case, fixed per shape)

Within one expert, rows come in an order set by atomic arrival (the kernels) or in flat order (the reference); the
GEMMs compute each row independently, so results do not depend on that order. Tests compare per-tile row sets.

Two paths, chosen by `align_chunk(numel, BLOCK_M)` from shape constants (so a CUDA graph captures one of them):
  * numel = T*k <= SINGLE_MAX_NUMEL and numel / BLOCK_M <= SINGLE_MAX_TILES (decode): `_moe_align_single_kernel`,
    grid (1,). Each pair's rank within its expert comes from one relaxed atomic on a zero-at-rest counter, issued
    right after the ids load so its latency hides behind the histogram, the padded prefix sum, the tile ids (each
    expert stores its own tiles: no reductions) and the sentinel fill; then the scatter (dst = pad_start[e] +
    rank) and the counters go back to 0. Offline sm_90 SASS, B = 32 x k = 5, BM 16: ~1.1K instructions per warp
    executed (loops counted) vs ~4.2K for the kernel it replaced, 3.2K of those in its per-tile reduction loop.
  * larger numel (prefill): two launches over chunks of CHUNK pairs (`align_chunk`: about TARGET_PROGRAMS
    programs of 256..512 pairs), grid (cdiv(numel, CHUNK),).
    `_moe_align_count_kernel`: local histogram, ONE atomic per (chunk, expert) to reserve the chunk's range inside
    the expert (`chunk_off`), and this program's share of the sentinel fill. `_moe_align_scatter_kernel`: every
    program reads the totals, builds the padded prefix sum itself, writes its share of the tile ids, sorts its
    chunk by (expert, position) so each pair's rank inside the chunk is its sorted position minus the chunk's
    start of that expert, and scatters; the last program to arrive zeroes the counters.
The counters are `split_counters("moe_align", device, E + 1)` (E expert counts and one arrival counter; the
zero-at-rest protocol of split_counters.py): no host memset, every launch leaves them zero. Fixed shapes and no
host sync: both paths are capturable in a CUDA graph (after one eager call, which allocates the counters).
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import tl, triton
from ladle.kernels.split_counters import arrive, release, split_counters

COUNTER_KEY = "moe_align"
SINGLE_MAX_NUMEL = 1024  # numel = T*k up to this: one program (B = 32 decode with k = 5 is 160 pairs) ...
SINGLE_MAX_TILES = 64  # ... if one expert has at most this many tiles (its tile-id store is [E, tiles]; BM >= 16)
# pairs per program of the multi-program path (powers of two) ... H200 (benchmarks/gpu_moe_align_ab.py, results/
# round7/kernels/call3_moe_align_ab.log): 40,960 pairs 9.3 us with 256 (today's one program: 228 us); 163,840 pairs
# 14.1-15.4 us with 512, 19.3-21.8 with 1024
MIN_CHUNK, MAX_CHUNK = 256, 512
TARGET_PROGRAMS = 128  # ... the largest that still gives this many programs (an H200 has 132 SMs)


@triton.jit
def _padded_layout(counts, BLOCK_M: tl.constexpr):
    """Per-expert counts [NB_P2] -> (padded, pad_start, pad_end [NB_P2], total rows in use)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    return padded, pad_end - padded, pad_end, tl.sum(padded, axis=0)


@triton.jit
def _chunk_ids(ids_ptr, offs, numel, num_experts):
    """Expert ids of the flat pairs `offs`; lanes past numel get the spare bin `num_experts` (never stored)."""
    m = offs < numel
    return tl.where(m, tl.load(ids_ptr + offs, mask=m, other=0), num_experts), m


@triton.jit
def _moe_align_single_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, npp_ptr, cnt_ptr,
    numel, num_experts, max_padded,
    BLOCK_M: tl.constexpr, NB_P2: tl.constexpr, CH: tl.constexpr, MAX_TILES: tl.constexpr, FILL: tl.constexpr,
):
    i = tl.arange(0, CH)
    ids, m = _chunk_ids(ids_ptr, i, numel, num_experts)
    rank = tl.atomic_add(cnt_ptr + ids, 1, mask=m, sem="relaxed")  # rank within the expert; counters zero at rest
    e = tl.arange(0, NB_P2)
    e_ok = e < num_experts
    counts = tl.where(e_ok, tl.histogram(ids, NB_P2), 0)
    padded, pad_start, pad_end, total = _padded_layout(counts, BLOCK_M)
    tl.store(npp_ptr, total)
    j = tl.arange(0, MAX_TILES)  # expert e owns tiles pad_start/BM + j, j < padded/BM (<= cdiv(numel, BM) tiles)
    tile = pad_start[:, None] // BLOCK_M + j[None, :]
    own = e_ok[:, None] & (j[None, :] * BLOCK_M < padded[:, None])
    tl.store(expert_ids_ptr + tile, e[:, None] + 0 * j[None, :], mask=own)
    num_tiles = max_padded // BLOCK_M
    for ts in range(total // BLOCK_M, num_tiles, FILL):  # tiles past the end; disjoint from the stores above
        t = ts + tl.arange(0, FILL)
        tl.store(expert_ids_ptr + t, -1, mask=t < num_tiles)
    for start in range(0, max_padded, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs, numel, mask=offs < max_padded)
    tl.debug_barrier()  # the sentinel fill lands before the scatter overwrites its rows
    dst = tl.gather(pad_start, ids, 0) + rank
    tl.store(sorted_ptr + dst, i, mask=m)
    tl.debug_barrier()  # every atomic has returned (its rank was used above) before the counters go back to 0
    tl.store(cnt_ptr + e, 0, mask=e_ok)


@triton.jit
def _moe_align_count_kernel(
    ids_ptr, sorted_ptr, cnt_ptr, chunk_off_ptr,
    numel, num_experts, max_padded,
    NB_P2: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
):
    pid = tl.program_id(0)
    ids, m = _chunk_ids(ids_ptr, pid * CHUNK + tl.arange(0, CHUNK), numel, num_experts)
    e = tl.arange(0, NB_P2)
    h = tl.histogram(ids, NB_P2)
    take = (e < num_experts) & (h > 0)
    first = tl.atomic_add(cnt_ptr + e, h, mask=take, sem="relaxed")  # this chunk's rows of e start at `first`
    tl.store(chunk_off_ptr + pid * NB_P2 + e, first, mask=take)
    for start in range(pid * FILL, max_padded, tl.num_programs(0) * FILL):  # grid-stride share of the fill
        offs = tl.multiple_of(start, FILL) + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs, numel, mask=offs < max_padded)


@triton.jit
def _moe_align_scatter_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, npp_ptr, cnt_ptr, chunk_off_ptr,
    numel, num_experts, max_padded,
    BLOCK_M: tl.constexpr, NB_P2: tl.constexpr, CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.arange(0, NB_P2)
    e_ok = e < num_experts
    counts = tl.load(cnt_ptr + e, mask=e_ok, other=0)  # totals: every count-kernel atomic finished before launch
    padded, pad_start, pad_end, total = _padded_layout(counts, BLOCK_M)
    if pid == 0:
        tl.store(npp_ptr, total)
    num_tiles = max_padded // BLOCK_M
    for ts in range(pid * TILE_CHUNK, num_tiles, tl.num_programs(0) * TILE_CHUNK):  # grid-stride share of tiles
        t = ts + tl.arange(0, TILE_CHUNK)
        before = (pad_end[None, :] <= t[:, None] * BLOCK_M) & e_ok[None, :]
        ex = tl.sum(before.to(tl.int32), axis=1)  # first expert whose padded range ends after the tile start
        tl.store(expert_ids_ptr + t, tl.where(t * BLOCK_M < total, ex, -1), mask=t < num_tiles)
    local = tl.arange(0, CHUNK)
    ids, m = _chunk_ids(ids_ptr, pid * CHUNK + local, numel, num_experts)
    h = tl.histogram(ids, NB_P2)
    first = tl.load(chunk_off_ptr + pid * NB_P2 + e, mask=e_ok & (h > 0), other=0)
    base = pad_start + first - (tl.cumsum(h, axis=0) - h)  # row of sorted position p (expert x) = base[x] + p
    key = tl.sort(ids * CHUNK + local)  # by expert, then position (the spare bin sorts last)
    x = key // CHUNK
    tl.store(sorted_ptr + tl.gather(base, x, 0) + local, pid * CHUNK + key % CHUNK, mask=x < num_experts)
    if arrive(cnt_ptr + num_experts, tl.num_programs(0)):  # every program has read the totals: zero them
        tl.store(cnt_ptr + e, 0, mask=e_ok)
        release(cnt_ptr + num_experts)


def max_padded_rows(numel: int, num_experts: int, block_m: int) -> int:
    """Worst-case row count of the aligned layout (see module docstring)."""
    bound = min(numel * block_m, numel + min(num_experts, numel) * (block_m - 1))
    return triton.cdiv(max(bound, 1), block_m) * block_m


def align_chunk(numel: int, block_m: int) -> int:
    """The path rule, from the shape constants numel = T*k and BLOCK_M: 0 (one program) for numel <=
    SINGLE_MAX_NUMEL with at most SINGLE_MAX_TILES tiles of one expert, else the pairs per program of the
    multi-program path: the largest power of two <= numel / TARGET_PROGRAMS, clamped to [MIN_CHUNK, MAX_CHUNK]
    (8K-token prefill, k = 5: 256 pairs x 160 programs; 32K tokens: 512 x 320)."""
    if numel <= SINGLE_MAX_NUMEL and triton.cdiv(numel, block_m) <= SINGLE_MAX_TILES:
        return 0
    per_program = max(numel // TARGET_PROGRAMS, 1)
    return min(MAX_CHUNK, max(MIN_CHUNK, 1 << (per_program.bit_length() - 1)))


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: Optional[int] = None):
    """Triton align. topk_ids [T, k] int32 with values in [0, num_experts). Returns
    (sorted_token_ids [P] int32, expert_ids [P // block_m] int32, num_tokens_post_padded [1] int32).
    chunk: pairs per program of the multi-program path (a power of two), 0 for the single-program path, None for
    `align_chunk(T*k, block_m)`. Uses (and leaves zero) the counters `split_counters("moe_align", device, E + 1)`."""
    assert topk_ids.dtype == torch.int32 and topk_ids.dim() == 2
    ids = topk_ids.contiguous().view(-1)
    numel = ids.numel()
    P = max_padded_rows(numel, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(P // block_m, dtype=torch.int32, device=dev)
    npp = torch.empty(1, dtype=torch.int32, device=dev)
    cnt = split_counters(COUNTER_KEY, dev, num_experts + 1)
    nb = triton.next_power_of_2(num_experts + 1)  # + the spare bin of masked lanes
    chunk = align_chunk(numel, block_m) if chunk is None else chunk
    if chunk == 0:
        assert numel <= 4 * SINGLE_MAX_NUMEL and triton.cdiv(numel, block_m) <= 4 * SINGLE_MAX_TILES, \
            f"the single-program path holds all {numel} pairs and one expert's tiles in registers"
        _moe_align_single_kernel[(1,)](
            ids, sorted_ids, expert_ids, npp, cnt, numel, num_experts, P,
            BLOCK_M=block_m, NB_P2=nb, CH=triton.next_power_of_2(max(numel, 16)),
            MAX_TILES=triton.next_power_of_2(triton.cdiv(max(numel, 1), block_m)), FILL=1024, num_warps=4,
        )
        return sorted_ids, expert_ids, npp
    assert chunk & (chunk - 1) == 0 and chunk >= 16, f"chunk must be a power of two >= 16, got {chunk}"
    grid = (triton.cdiv(max(numel, 1), chunk),)
    chunk_off = torch.empty(grid[0] * nb, dtype=torch.int32, device=dev)
    warps = 8 if chunk >= 2048 else 4
    _moe_align_count_kernel[grid](ids, sorted_ids, cnt, chunk_off, numel, num_experts, P,
                                  NB_P2=nb, CHUNK=chunk, FILL=1024, num_warps=warps)
    _moe_align_scatter_kernel[grid](ids, sorted_ids, expert_ids, npp, cnt, chunk_off, numel, num_experts, P,
                                    BLOCK_M=block_m, NB_P2=nb, CHUNK=chunk, TILE_CHUNK=32, num_warps=warps)
    return sorted_ids, expert_ids, npp


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Torch reference (also sync-free: sort, scatter_add, cumsum, searchsorted). Same outputs, rows within an
    expert in flat order."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    P = max_padded_rows(numel, num_experts, block_m)
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    sorted_e, perm = torch.sort(flat, stable=True)
    dest = pad_start[sorted_e] + torch.arange(numel, device=dev) - cnt_start[sorted_e]
    sorted_ids = torch.full((P,), numel, dtype=torch.int32, device=dev)
    sorted_ids[dest] = perm.to(torch.int32)
    tile_start = torch.arange(P // block_m, device=dev) * block_m
    expert_ids = torch.searchsorted(pad_end, tile_start, right=True)
    expert_ids = torch.where(tile_start < pad_end[-1], expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, pad_end[-1:].to(torch.int32)
