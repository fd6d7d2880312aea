"""KV cache sizing and allocation in the fixed layout (ARCHITECTURE.md "Core types").

Per layer: K and V `[num_blocks, block_size, num_kv_heads, head_dim]` (separate contiguous tensors) and, for
MSA sparse layers (`index_head_dim > 0`), index-K `[num_blocks, block_size, index_head_dim]`. Block 0 is the
null block: it is allocated like the others but never handed to a request (padding rows of the block table
point at it), so the scheduler can use `num_blocks - 1` blocks.
"""

from __future__ import annotations

import torch

from ladle.layers.attention.metadata import LayerCacheSpec, LayerKVCache


class KVCacheTooSmall(ValueError):
    """The KV pool cannot hold one sequence of max_model_len tokens (a startup error, shown to the user)."""


def bytes_per_block(specs: list[LayerCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K + V + index-K)."""
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    return block_size * sum(spec.bytes_per_token(dtype_bytes) for spec in specs)


def num_blocks_for_bytes(specs: list[LayerCacheSpec], block_size: int, dtype: torch.dtype,
                         capacity_bytes: int) -> int:
    """Whole blocks (including the null block 0) that fit in `capacity_bytes`."""
    per_block = bytes_per_block(specs, block_size, dtype)
    assert per_block > 0, "model declared no KV cache"
    return max(0, capacity_bytes // per_block)


def check_fits_max_model_len(num_blocks: int, block_size: int, max_model_len: int, capacity_bytes: int,
                             on_gpu: bool) -> None:
    """Raise KVCacheTooSmall (message names both token counts and the flags) when one max_model_len
    sequence needs more blocks than the pool's usable `num_blocks - 1`."""
    usable_tokens = max(0, num_blocks - 1) * block_size
    if usable_tokens >= max_model_len:
        return
    knob = ("--gpu-memory-utilization" if on_gpu else "--kv-cache-memory-bytes")
    raise KVCacheTooSmall(
        f"The model's max_model_len ({max_model_len} tokens) is larger than the KV cache can hold "
        f"({usable_tokens} tokens in {max(0, num_blocks - 1)} blocks of {block_size} from {capacity_bytes} bytes). "
        f"Lower --max-model-len (to at most {usable_tokens}) or give the cache more memory with {knob}."
    )


def allocate_kv_caches(specs: list[LayerCacheSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[LayerKVCache]:
    """Zero-filled caches, one LayerKVCache per spec (layer order). Zeros keep padding reads finite."""
    caches = []
    for spec in specs:
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        index = None
        if spec.index_head_dim > 0:
            index = torch.zeros(num_blocks, block_size, spec.index_head_dim, dtype=dtype, device=device)
        caches.append(LayerKVCache(
            key_cache=torch.zeros(shape, dtype=dtype, device=device),
            value_cache=torch.zeros(shape, dtype=dtype, device=device),
            index_key_cache=index,
        ))
    return caches
