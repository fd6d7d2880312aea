"""KV cache sizing and allocation in the fixed layout (ARCHITECTURE.md "Core types").

Per layer: K and V `[num_blocks, block_size, num_kv_heads, head_dim]` (separate contiguous tensors) and, for
MSA sparse layers (`index_head_dim > 0`), index-K `[num_blocks, block_size, index_head_dim]`. Block 0 is the
null block: it is allocated like the others but never handed to a request (padding rows of the block table
point at it), so the scheduler can use `num_blocks - 1` blocks.

Cache dtype (`--kv-cache-dtype`, resolved by ladle/engine/config_resolve.py): "auto" stores the model dtype;
"fp8" / "fp8_e4m3" store float8_e4m3fn and "fp8_e5m2" float8_e5m2, for K, V and index-K alike, with per-tensor
float32 scales in each LayerKVCache (1.0 unless `allocate_kv_caches` is given calibrated ones). Sizing uses the
cache dtype's real element size, so FP8 holds twice the tokens of bf16 in the same bytes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ladle.layers.attention.metadata import LayerCacheSpec, LayerKVCache


# ladle's values of vLLM's --kv-cache-dtype ("fp8" is vLLM's alias of fp8_e4m3) -> the cache's torch dtype.
KV_CACHE_DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the K/V and index-K caches: the model dtype for "auto", else the FP8 dtype named."""
    assert kv_cache_dtype in KV_CACHE_DTYPES, f"--kv-cache-dtype {kv_cache_dtype} should have been refused"
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


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
                       device: torch.device,
                       scales: Optional[Sequence[tuple[float, float]]] = None) -> list[LayerKVCache]:
    """Zero-filled caches in `dtype` (the model dtype or FP8), one LayerKVCache per spec (layer order). Zeros keep
    padding reads finite. scales: per layer (k_scale, v_scale) float32 values (e.g. a checkpoint's calibrated
    ones), default 1.0; index-K always gets 1.0 (no checkpoint format carries an index-K scale)."""
    assert scales is None or len(scales) == len(specs), "one (k_scale, v_scale) per layer"
    caches = []
    for i, spec in enumerate(specs):
        k_scale, v_scale = scales[i] if scales is not None else (1.0, 1.0)
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        index = None
        if spec.index_head_dim > 0:
            index = torch.zeros(num_blocks, block_size, spec.index_head_dim, dtype=dtype, device=device)
        caches.append(LayerKVCache(
            key_cache=torch.zeros(shape, dtype=dtype, device=device),
            value_cache=torch.zeros(shape, dtype=dtype, device=device),
            index_key_cache=index,
            k_scale=float(k_scale),
            v_scale=float(v_scale),
        ))
    return caches
