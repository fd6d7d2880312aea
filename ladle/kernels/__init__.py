"""Triton kernels, one op per file, each with a launcher that asserts shapes/strides/dtypes and a plain torch
reference beside it. Every public entry point checks its eligibility rule, records the decision in
`ladle.observe.dispatch`, and falls back to its reference (visibly) when the rule fails.

Public API:
  store_kvcache(k, v, key_cache, value_cache, slot_mapping)            -> None (writes caches)
  store_index_kcache(index_k, index_key_cache, slot_mapping)           -> None
  paged_attention(q, key_cache, value_cache, attn_metadata, scale)     -> out [T, Hq, D]
  rms_norm(x, weight, eps, residual=None, weight_offset=0.0)           -> out | (out, residual_out)
  apply_rope(q, k, positions, cos_sin_cache, rotary_dim=None)          -> (q, k) rotated in place
  rope_cos_sin_cache(rotary_dim, max_position, base, device=None)      -> [max_position, rotary_dim] float32
  sample(logits, temperature, top_k, top_p, min_p, seeds, steps, ...) -> token ids [B] int64
"""

from ladle.kernels.kv_store import store_index_kcache, store_index_kcache_ref, store_kvcache, store_kvcache_ref
from ladle.kernels.paged_attention import paged_attention, paged_attention_ref
from ladle.kernels.rmsnorm import rms_norm, rms_norm_ref
from ladle.kernels.rope import apply_rope, apply_rope_ref, rope_cos_sin_cache
from ladle.kernels.sampling import filtered_probs, race, race_ref, sample

__all__ = [
    "store_kvcache",
    "store_kvcache_ref",
    "store_index_kcache",
    "store_index_kcache_ref",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "apply_rope",
    "apply_rope_ref",
    "rope_cos_sin_cache",
    "sample",
    "filtered_probs",
    "race",
    "race_ref",
]
