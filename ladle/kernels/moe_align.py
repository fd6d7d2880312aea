"""Align (token, slot) pairs by expert for the fused MoE GEMMs, on the device, with no host sync.

Given topk_ids [T, k] (k includes a packed shared-expert column if the router appended one), the T*k flat pairs
are bucketed by expert and each bucket is padded to a multiple of BLOCK_M (kernels_and_limits.md §1.1, the vLLM
`moe_align_block_size` contract, written from that description):

    sorted_token_ids [max_padded] int32   flat pair index (t*k + slot) of each row; sentinel T*k for padding rows
    expert_ids       [max_padded // BLOCK_M] int32   expert of each BLOCK_M tile; -1 for tiles past the end
    num_tokens_post_padded [1] int32      rows in use (a multiple of BLOCK_M), read by the GEMMs on the device

    max_padded = roundup(min(T*k*BLOCK_M, T*k + min(E, T*k)*(BLOCK_M-1)), BLOCK_M)   (worst case, fixed per shape)

Within one expert, rows come in atomic-arrival order (the kernel) or in flat order (the reference); the GEMMs
compute each row independently, so results do not depend on that order. Tests compare per-tile row sets.

Kernel: `_moe_align_kernel`, grid (1,): histogram -> padded prefix sum -> per-tile expert ids -> sentinel fill ->
barrier -> scatter with per-expert atomic cursors. One launch, fixed shapes: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from ladle.kernels._common import tl, triton


@triton.jit
def _moe_align_kernel(
    ids_ptr, sorted_ptr, expert_ids_ptr, npp_ptr, cursor_ptr,
    numel, num_experts, max_padded,
    BLOCK_M: tl.constexpr, NB_P2: tl.constexpr, CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr,
):
    e = tl.arange(0, NB_P2)
    e_ok = e < num_experts
    counts = tl.zeros([NB_P2], tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        m = offs < numel
        ids = tl.load(ids_ptr + offs, mask=m, other=0)
        ids = tl.where(m, ids, num_experts)  # masked lanes land in the spare bin `num_experts`, ignored below
        counts += tl.histogram(ids, NB_P2)
    counts = tl.where(e_ok, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(cursor_ptr + e, pad_start, mask=e_ok)
    tl.store(npp_ptr, total)
    for start in range(0, max_padded, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, numel, mask=offs < max_padded)
    num_tiles = max_padded // BLOCK_M
    for ts in range(0, num_tiles, TILE_CHUNK):
        tile = ts + tl.arange(0, TILE_CHUNK)
        tstart = tile * BLOCK_M
        before = (pad_end[None, :] <= tstart[:, None]) & e_ok[None, :]
        ex = tl.sum(before.to(tl.int32), axis=1)  # first expert whose padded range ends after tstart
        ex = tl.where(tstart < total, ex, -1)
        tl.store(expert_ids_ptr + tile, ex, mask=tile < num_tiles)
    tl.debug_barrier()  # cursor init and sentinel fill are visible to every thread before the scatter
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        m = offs < numel
        ids = tl.load(ids_ptr + offs, mask=m, other=0)
        dst = tl.atomic_add(cursor_ptr + ids, 1, mask=m)
        tl.store(sorted_ptr + dst, offs, mask=m)


def max_padded_rows(numel: int, num_experts: int, block_m: int) -> int:
    """Worst-case row count of the aligned layout (see module docstring)."""
    bound = min(numel * block_m, numel + min(num_experts, numel) * (block_m - 1))
    return triton.cdiv(max(bound, 1), block_m) * block_m


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Triton align. topk_ids [T, k] int32 with values in [0, num_experts). Returns
    (sorted_token_ids [P] int32, expert_ids [P // block_m] int32, num_tokens_post_padded [1] int32)."""
    assert topk_ids.dtype == torch.int32 and topk_ids.dim() == 2
    ids = topk_ids.contiguous().view(-1)
    numel = ids.numel()
    P = max_padded_rows(numel, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(P // block_m, dtype=torch.int32, device=dev)
    npp = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](
        ids, sorted_ids, expert_ids, npp, cursor, numel, num_experts, P,
        BLOCK_M=block_m, NB_P2=triton.next_power_of_2(num_experts + 1), CHUNK=1024 if numel > 256 else 256,
        TILE_CHUNK=32 if num_experts > 128 else 64, num_warps=8 if numel > 4096 else 4,
    )
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
