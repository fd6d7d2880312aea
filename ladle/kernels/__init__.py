"""Ops, one per file (`ladle/kernels/<op>.py`): a dispatching entry point, its Triton kernel (with a launcher that
asserts shapes/strides/dtypes) and its plain-torch reference. Each entry point takes the backend asked for
(`use_triton`), checks its eligibility rule, records configured / eligible / executed in `ladle.observe.dispatch`,
and runs the reference when Triton was not asked for or the rule fails (visibly). Without Triton installed the
attention ops still import and run their references (ladle/kernels/_common.py).

Public API (T tokens, B requests). The KV store and dense paged attention are re-exported here; the MSA ops are
imported from their modules (`from ladle.kernels.msa_indexer import msa_indexer`: re-exporting a function under
its module's name would shadow the module for `import ladle.kernels.<op> as mod`):
  store_kvcache(k, v, key_cache, value_cache, slot_mapping, *, use_triton=True)        -> None (writes the caches)
  store_index_kcache(index_k, index_key_cache, slot_mapping, *, use_triton=True)       -> None
  paged_attention(q, key_cache, value_cache, attn_metadata, scale, out=None, *, use_triton=True)
                                                                                       -> out [T, Hq, D]
  msa_indexer(index_q, index_k_cache, block_table, positions, query_start_loc, topk, *, local_blocks=1,
              use_triton=True)                                                         -> [Hkv, T, topk] int32
  msa_sparse_attention(q, key_cache, value_cache, block_table, selected_block_ids, positions, query_start_loc,
                       scale=None, *, use_triton=True)                                 -> [T, Hq, D]
  and their references store_kvcache_ref, store_index_kcache_ref, paged_attention_ref, msa_indexer_ref,
  msa_sparse_attention_ref (same arguments, no use_triton).
Norms, RoPE and sampling:
  rms_norm(x, weight, eps, residual=None, weight_offset=0.0)           -> out | (out, residual_out)   (rmsnorm.py)
  apply_rope(q, k, positions, cos_sin_cache, rotary_dim=None)          -> (q, k) rotated in place     (rope.py)
  rope_cos_sin_cache(rotary_dim, max_position, base, device=None)      -> [max_position, rotary_dim] float32
  sample(logits, temperature, top_k, top_p, min_p, seeds, steps, ...) -> token ids [B] int64         (sampling.py)
  filtered_probs, race, race_ref                                                                     (sampling.py)
"""

from __future__ import annotations

from ladle.kernels.kv_store import store_index_kcache, store_index_kcache_ref, store_kvcache, store_kvcache_ref
from ladle.kernels.paged_attention import paged_attention, paged_attention_ref

from ladle.kernels.rmsnorm import rms_norm, rms_norm_ref
from ladle.kernels.rope import apply_rope, apply_rope_ref, rope_cos_sin_cache
from ladle.kernels.sampling import filtered_probs, race, race_ref, sample


__all__ = [
    "store_kvcache", "store_kvcache_ref", "store_index_kcache", "store_index_kcache_ref",
    "paged_attention", "paged_attention_ref", "rms_norm", "rms_norm_ref", "apply_rope", "apply_rope_ref",
    "rope_cos_sin_cache", "sample", "filtered_probs", "race", "race_ref",
]
