"""Paged KV-cache store: write this step's K, V (and MSA index-K) rows into their cache slots.

Layout (ARCHITECTURE.md, fixed): key_cache / value_cache `[num_blocks, block_size, num_kv_heads, head_dim]`,
index_key_cache `[num_blocks, block_size, index_head_dim]`. `slot_mapping[t] = block_id * block_size + offset`;
a slot of -1 marks a padding token (CUDA-graph padding, or a token whose KV must not be written) and is skipped.

Because a block's `[block_size, num_kv_heads, head_dim]` slab is contiguous, slot s is simply row s of the cache
viewed as `[num_blocks * block_size, num_kv_heads * head_dim]` — the kernel copies one row per token, K and V in
the same launch, BLOCK_T tokens per program.

FP8 caches (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`, design/kernels_and_limits.md §5): every store quantizes,
stored = fp8(clamp(x / scale, -max, max)) with the layer's per-tensor float32 scale (`LayerKVCache.k_scale`,
`v_scale`, `index_k_scale`); the cast rounds to nearest even. The kernel rounds with `_round_fp8` (integer
arithmetic on the float32 bits, then an exact cast) instead of the plain `.to(fp8)`: Triton's CPU interpreter
rounds fp32 -> fp8 wrongly when rounding carries into the exponent (499.0 -> 256 in e5m2), and one exact path
serves both. The torch reference is `quantize_fp8_ref` (ladle/kernels/_common.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import (check_cache_pair, decide_triton, fp8_max, is_fp8, quantize_fp8_ref, tl, triton,
                                   triton_ok)
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

dispatch.register(
    "kv_store",
    "triton",
    "CUDA (or TRITON_INTERPRET) tensors, cache row-contiguous, k/v [T, Hkv, D] with unit last stride; an FP8 "
    "cache quantizes in the kernel (bucket suffix kv=fp8_*)",
)

# (mantissa bits, smallest normal, subnormal step) of the FP8 cache formats (OCP FP8 spec: e4m3fn bias 7, e5m2
# bias 15), used by `_round_fp8`.
_FP8_FORMAT = {torch.float8_e4m3fn: (3, 2.0 ** -6, 2.0 ** -9), torch.float8_e5m2: (2, 2.0 ** -14, 2.0 ** -16)}


@triton.jit
def _round_fp8(v, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, QUANTUM: tl.constexpr):
    """float32 v (already clamped to the format's finite range) rounded to nearest even at the FP8 format's
    precision, still float32 (so the following cast is exact). Normals: round the float32 bits to MANT mantissa
    bits (a carry moves into the exponent, as it should); subnormals: round v / QUANTUM to an integer with the
    1.5 * 2^23 add-subtract trick (exact for |v / QUANTUM| < 2^22, float32 adds round to nearest even)."""
    DROP: tl.constexpr = 23 - MANT
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & ~((1 << DROP) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    sub = ((v / QUANTUM + 12582912.0) - 12582912.0) * QUANTUM
    return tl.where(tl.abs(v) >= MIN_NORMAL, normal, sub)


@triton.jit
def _quantize(x, scale, limit, QUANT: tl.constexpr, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr,
              QUANTUM: tl.constexpr):
    """x as stored in the cache: unchanged (QUANT False: cast by the store) or fp8-rounded x / scale (float32)."""
    if QUANT:  # one return after if/else (Triton type-checks an early return against the one after it)
        y = _round_fp8(tl.minimum(tl.maximum(x.to(tl.float32) / scale, -limit), limit), MANT, MIN_NORMAL, QUANTUM)
    else:
        y = x
    return y


@triton.jit
def _store_kernel(
    k_ptr, v_ptr,  # [T, W] rows (row strides k_stride / v_stride, unit column stride)
    kc_ptr, vc_ptr,  # [num_slots, W] contiguous rows
    slot_ptr,  # [T] int32/int64
    num_tokens, k_stride, v_stride, k_scale, v_scale, limit,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, HAS_V: tl.constexpr,
    QUANT: tl.constexpr, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, QUANTUM: tl.constexpr,
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
        k = _quantize(k, k_scale, limit, QUANT, MANT, MIN_NORMAL, QUANTUM)
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
        if HAS_V:
            v = tl.load(v_ptr + rows[:, None] * v_stride + offs_w[None, :], mask=mask)
            v = _quantize(v, v_scale, limit, QUANT, MANT, MIN_NORMAL, QUANTUM)
            tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def cache_quant_args(cache_dtype: torch.dtype) -> tuple[bool, int, float, float, float]:
    """`_quantize`'s arguments for a cache dtype: (QUANT, MANT, MIN_NORMAL, QUANTUM, limit); a cache that is not
    FP8 stores values as they are (QUANT False, the rest unused)."""
    if not is_fp8(cache_dtype):
        return False, 0, 0.0, 0.0, 0.0
    return (True, *_FP8_FORMAT[cache_dtype], fp8_max(cache_dtype))


def _launch(k: torch.Tensor, v: Optional[torch.Tensor], k_rows: torch.Tensor, v_rows: Optional[torch.Tensor],
            slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    num_tokens, width = k.shape
    if num_tokens == 0:
        return
    block_w = min(triton.next_power_of_2(width), 1024)
    block_t = max(1, min(64, 4096 // block_w))
    has_v = v is not None
    quant, mant, min_normal, quantum, limit = cache_quant_args(k_rows.dtype)
    _store_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v if has_v else k, k_rows, v_rows if has_v else k_rows, slot_mapping, num_tokens, k.stride(0),
        (v if has_v else k).stride(0), float(k_scale), float(v_scale), limit,
        W=width, BLOCK_T=block_t, BLOCK_W=block_w, HAS_V=has_v, QUANT=quant, MANT=mant, MIN_NORMAL=min_normal,
        QUANTUM=quantum, num_warps=4)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] (unit stride on D, heads packed) -> [T, H*D] view without copying."""
    assert x.stride(-1) == 1, "last dim must be contiguous"
    if x.dim() == 3:
        assert x.stride(1) == x.shape[2], "heads must be packed (stride(1) == head_dim)"
        return x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))
    return x


@timed_op
def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    use_triton: bool = True,
) -> None:
    """Write k, v into the paged caches in place.

    k, v: [T, num_kv_heads, head_dim] (views into a fused qkv tensor are fine: only the last dim must be
      contiguous and heads packed; another float dtype is cast to the cache's). key_cache, value_cache:
      [num_blocks, block_size, num_kv_heads, head_dim] contiguous, the model dtype or FP8 (float8_e4m3fn /
      float8_e5m2: stored = fp8(clamp(x / scale)), module docstring). slot_mapping: [>= T] int32/int64 (the first T
      entries are used; CUDA-graph buffers may be longer), -1 = skip. k_scale, v_scale: the caches' per-tensor
      float32 scales (used by FP8 caches only). Mutates key_cache and value_cache.
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
    if not decide_triton("kv_store", k.shape[0], use_triton, reason, key_cache.dtype):
        store_kvcache_ref(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    if not is_fp8(key_cache.dtype) and (k.dtype != key_cache.dtype or v.dtype != key_cache.dtype):
        k, v = k.to(key_cache.dtype), v.to(key_cache.dtype)
    width = key_cache.shape[2] * key_cache.shape[3]
    _launch(_rows(k), _rows(v), key_cache.view(-1, width), value_cache.view(-1, width), slot_mapping, k_scale,
            v_scale)


@timed_op
def store_index_kcache(index_k: torch.Tensor, index_key_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                       index_k_scale: float = 1.0, use_triton: bool = True) -> None:
    """Write MSA index keys in place. index_k [T, index_head_dim] (unit last stride), the cache's dtype or any float
    dtype for an FP8 cache (quantized with `index_k_scale`, as in `store_kvcache`); index_key_cache [num_blocks,
    block_size, index_head_dim] contiguous; slot_mapping [>= T] int32/int64 (the first T entries are used, as in
    `store_kvcache`), -1 = skip. Same rule and fallback as `store_kvcache`, recorded as op "index_k_store"."""
    assert index_key_cache.dim() == 3 and index_key_cache.is_contiguous()
    assert index_k.dim() == 2 and index_k.shape[1] == index_key_cache.shape[2] and index_k.stride(1) == 1
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] >= index_k.shape[0], "slot_mapping must be [>= T]"
    assert index_k.dtype == index_key_cache.dtype or is_fp8(index_key_cache.dtype)
    slot_mapping = slot_mapping[: index_k.shape[0]]
    reason = triton_ok(index_k, index_key_cache, slot_mapping)
    if not decide_triton("index_k_store", index_k.shape[0], use_triton, reason, index_key_cache.dtype):
        store_index_kcache_ref(index_k, index_key_cache, slot_mapping, index_k_scale)
        return
    _launch(index_k, None, index_key_cache.view(-1, index_key_cache.shape[2]), None, slot_mapping, index_k_scale)


# ----------------------------------------------------------------------------------------------------------------
# torch references (the TORCH backend, and the fallback when the Triton rule fails)


def _store_rows_ref(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0) -> None:
    """cache [num_blocks, block_size, *row] contiguous; rows [T, *row] (cast to the cache dtype; an FP8 cache gets
    `quantize_fp8_ref(rows, scale)`); slot_mapping [>= T], -1 = skip. Sync-free (no boolean indexing, so no
    device-to-host copy of a mask count): a padding row rewrites slot 0 with its own current contents. Slot 0 belongs to block 0, the null block that is never
    allocated to a request (ARCHITECTURE.md), so that write changes nothing."""
    flat = cache.view(-1, *cache.shape[2:])
    slots = slot_mapping[: rows.shape[0]].to(torch.int64)
    valid = (slots >= 0).view(-1, *([1] * (rows.dim() - 1)))
    if is_fp8(flat.dtype):  # torch has few FP8 kernels on CPU (no where / index_copy_): move the raw bytes
        rows, flat = quantize_fp8_ref(rows, scale, flat.dtype).view(torch.uint8), flat.view(torch.uint8)
    src = torch.where(valid, rows.to(flat.dtype), flat[0])
    flat.index_copy_(0, slots.clamp(min=0), src)


def store_kvcache_ref(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Plain-torch `store_kvcache` (same arguments, same effect): index_copy_ on the flattened slot axis."""
    _store_rows_ref(k, key_cache, slot_mapping, k_scale)
    _store_rows_ref(v, value_cache, slot_mapping, v_scale)


def store_index_kcache_ref(index_k: torch.Tensor, index_key_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           index_k_scale: float = 1.0) -> None:
    """Plain-torch `store_index_kcache`."""
    _store_rows_ref(index_k, index_key_cache, slot_mapping, index_k_scale)


dispatch.register("index_k_store", "triton", "same rule as kv_store")
