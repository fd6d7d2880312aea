"""Paged KV-cache store: write this step's K, V (and MSA index-K) rows into their cache slots.

Layout (ARCHITECTURE.md, fixed): key_cache / value_cache `[num_blocks, block_size, num_kv_heads, head_dim]`,
index_key_cache `[num_blocks, block_size, index_head_dim]`. `slot_mapping[t] = block_id * block_size + offset`;
a slot of -1 marks a padding token (CUDA-graph padding, or a token whose KV must not be written) and is skipped.

Because a block's `[block_size, num_kv_heads, head_dim]` slab is contiguous, slot s is simply row s of the cache
viewed as `[num_blocks * block_size, num_kv_heads * head_dim]` — the kernel copies one row per token, K and V in
the same launch, BLOCK_T tokens per program.
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import check_cache_pair, decide_triton, tl, triton, triton_ok
from ladle.observe import dispatch

dispatch.register(
    "kv_store",
    "triton",
    "CUDA (or TRITON_INTERPRET) tensors, cache row-contiguous, k/v [T, Hkv, D] with unit last stride, same dtype as cache",
)


@triton.jit
def _store_kernel(
    k_ptr, v_ptr,  # [T, W] rows (row strides k_stride / v_stride, unit column stride)
    kc_ptr, vc_ptr,  # [num_slots, W] contiguous rows
    slot_ptr,  # [T] int32/int64
    num_tokens, k_stride, v_stride,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, HAS_V: tl.constexpr,
):
    # One program moves BLOCK_T tokens x W columns of K (and V): enough bytes per program to stream.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    row_ok = slot >= 0
    rows = offs_t.to(tl.int64)
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        mask = row_ok[:, None] & (offs_w[None, :] < W)
        dst = slot[:, None] * W + offs_w[None, :]
        k = tl.load(k_ptr + rows[:, None] * k_stride + offs_w[None, :], mask=mask)
        tl.store(kc_ptr + dst, k, mask=mask)
        if HAS_V:
            v = tl.load(v_ptr + rows[:, None] * v_stride + offs_w[None, :], mask=mask)
            tl.store(vc_ptr + dst, v, mask=mask)


def _launch(k: torch.Tensor, v: Optional[torch.Tensor], k_rows: torch.Tensor, v_rows: Optional[torch.Tensor],
            slot_mapping: torch.Tensor) -> None:
    num_tokens, width = k.shape
    if num_tokens == 0:
        return
    block_w = min(triton.next_power_of_2(width), 1024)
    block_t = max(1, min(64, 4096 // block_w))
    has_v = v is not None
    _store_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v if has_v else k, k_rows, v_rows if has_v else k_rows, slot_mapping, num_tokens, k.stride(0),
        (v if has_v else k).stride(0), W=width, BLOCK_T=block_t, BLOCK_W=block_w, HAS_V=has_v, num_warps=4)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] (unit stride on D, heads packed) -> [T, H*D] view without copying."""
    assert x.stride(-1) == 1, "last dim must be contiguous"
    if x.dim() == 3:
        assert x.stride(1) == x.shape[2], "heads must be packed (stride(1) == head_dim)"
        return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))
    return x


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    use_triton: bool = True,
) -> None:
    """Write k, v into the paged caches in place.

    k, v: [T, num_kv_heads, head_dim] (views into a fused qkv tensor are fine: only the last dim must be
      contiguous and heads packed; another float dtype is cast to the cache's). key_cache, value_cache:
      [num_blocks, block_size, num_kv_heads, head_dim] contiguous. slot_mapping: [>= T] int32/int64 (the first T
      entries are used; CUDA-graph buffers may be longer), -1 = skip. Mutates key_cache and value_cache.
    use_triton: the backend asked for (`OpBackends.triton_attention`). Runs the Triton kernel when asked for and
    eligible (decision recorded in ladle.observe.dispatch as op "kv_store"), else `store_kvcache_ref`.
    """
    check_cache_pair(key_cache, value_cache)
    assert k.shape == v.shape and k.dim() == 3, f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [T, Hkv, D]"
    assert k.shape[1:] == key_cache.shape[2:], f"k heads/dim {tuple(k.shape[1:])} != cache {tuple(key_cache.shape[2:])}"
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] >= k.shape[0], "slot_mapping must be [>= T]"
    assert slot_mapping.dtype in (torch.int32, torch.int64)
    slot_mapping = slot_mapping[: k.shape[0]]
    reason = triton_ok(k, v, key_cache, value_cache, slot_mapping)
    if not decide_triton("kv_store", k.shape[0], use_triton, reason):
        store_kvcache_ref(k, v, key_cache, value_cache, slot_mapping)
        return
    if k.dtype != key_cache.dtype or v.dtype != key_cache.dtype:
        k, v = k.to(key_cache.dtype), v.to(key_cache.dtype)
    width = key_cache.shape[2] * key_cache.shape[3]
    _launch(_rows(k), _rows(v), key_cache.view(-1, width), value_cache.view(-1, width), slot_mapping)


def store_index_kcache(index_k: torch.Tensor, index_key_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                       use_triton: bool = True) -> None:
    """Write MSA index keys in place. index_k [T, index_head_dim] (unit last stride), the cache's dtype;
    index_key_cache [num_blocks, block_size, index_head_dim] contiguous; slot_mapping [>= T] int32/int64 (the first
    T entries are used, as in `store_kvcache`), -1 = skip. Same rule and fallback as `store_kvcache`, recorded as
    op "index_k_store"."""
    assert index_key_cache.dim() == 3 and index_key_cache.is_contiguous()
    assert index_k.dim() == 2 and index_k.shape[1] == index_key_cache.shape[2] and index_k.stride(1) == 1
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] >= index_k.shape[0], "slot_mapping must be [>= T]"
    assert index_k.dtype == index_key_cache.dtype
    slot_mapping = slot_mapping[: index_k.shape[0]]
    reason = triton_ok(index_k, index_key_cache, slot_mapping)
    if not decide_triton("index_k_store", index_k.shape[0], use_triton, reason):
        store_index_kcache_ref(index_k, index_key_cache, slot_mapping)
        return
    _launch(index_k, None, index_key_cache.view(-1, index_key_cache.shape[2]), None, slot_mapping)


# ----------------------------------------------------------------------------------------------------------------
# torch references (the TORCH backend, and the fallback when the Triton rule fails)


def _store_rows_ref(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache [num_blocks, block_size, *row] contiguous; rows [T, *row] (cast to the cache dtype); slot_mapping
    [>= T], -1 = skip. Sync-free (no boolean indexing, so no device-to-host copy of a mask count): a padding row
    rewrites slot 0 with its own current contents. Slot 0 belongs to block 0, the null block that is never
    allocated to a request (ARCHITECTURE.md), so that write changes nothing."""
    flat = cache.view(-1, *cache.shape[2:])
    slots = slot_mapping[: rows.shape[0]].to(torch.int64)
    valid = (slots >= 0).view(-1, *([1] * (rows.dim() - 1)))
    src = torch.where(valid, rows.to(flat.dtype), flat[0])
    flat.index_copy_(0, slots.clamp(min=0), src)


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Plain-torch `store_kvcache` (same arguments, same effect): index_copy_ on the flattened slot axis."""
    _store_rows_ref(k, key_cache, slot_mapping)
    _store_rows_ref(v, value_cache, slot_mapping)


def store_index_kcache_ref(index_k: torch.Tensor, index_key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Plain-torch `store_index_kcache`."""
    _store_rows_ref(index_k, index_key_cache, slot_mapping)


dispatch.register("index_k_store", "triton", "same rule as kv_store")
