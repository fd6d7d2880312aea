"""The dense paged `Attention` layer: stores this step's K/V, then attends over each request's whole context.

Backends (chosen by `ForwardContext.backends.attention`, which the runner resolves from RunnerConfig):
  "TORCH"  — `paged_ref.py` (reference; CPU and fallback everywhere).
  "TRITON_ATTN" — `ladle.kernels.paged_attention.paged_attention(q, key_cache, value_cache, attn_metadata, scale)`
             with the same arguments/returns as `paged_attention_ref`, and, if present,
             `ladle.kernels.kv_store.store_kv(key, value, key_cache, value_cache, slot_mapping)` with the same
             contract as `store_kv_ref`. Both entry points check eligibility and record their dispatch
             decisions themselves; the imports are optional (Triton may be absent): when a module is missing
             the torch reference runs and `ladle.observe.dispatch` records the fallback.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

import torch
from torch import nn

from ladle.layers.attention.metadata import get_forward_context
from ladle.layers.attention.paged_ref import paged_attention_ref, store_kv_ref
from ladle.observe import dispatch

_OPTIONAL_CACHE: dict[str, Any] = {}


def _optional_attr(module: str, name: str) -> Optional[Callable]:
    """`module.name` if importable, else None (cached; a missing optional kernel is not an error)."""
    key = f"{module}:{name}"
    if key not in _OPTIONAL_CACHE:
        try:
            _OPTIONAL_CACHE[key] = getattr(importlib.import_module(module), name, None)
        except ImportError:
            _OPTIONAL_CACHE[key] = None
    return _OPTIONAL_CACHE[key]


class Attention(nn.Module):
    """Paged causal self-attention over the KV cache of layer `layer_idx`.

    Args: num_heads (query heads), num_kv_heads (divides num_heads), head_dim, scale (softmax scale),
    layer_idx (index into `ForwardContext.kv_caches`).

    forward(q [T, Hq*D], k [T, Hkv*D], v [T, Hkv*D]) -> [T, Hq*D] in q's dtype.
    Mutates `ctx.kv_caches[layer_idx]` (writes the new K/V at `slot_mapping`, skipping -1). No parameters.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} % num_kv_heads {num_kv_heads} != 0"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        md = ctx.attn_metadata
        cache = ctx.kv_caches[self.layer_idx]
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)

        store, attend = store_kv_ref, paged_attention_ref
        if ctx.backends.triton_attention:
            store, attend = self._triton_ops(num_tokens, md.is_decode_only)
        store(k, v, cache.key_cache, cache.value_cache, md.slot_mapping)
        out = attend(q, cache.key_cache, cache.value_cache, md, self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    @staticmethod
    def _triton_ops(num_tokens: int, decode: bool) -> tuple[Callable, Callable]:
        """The Triton store/attention entry points where importable, else the references. The kernel entry
        points record their own dispatch decisions; a missing module is recorded here as a fallback."""
        store = _optional_attr("ladle.kernels.kv_store", "store_kv")
        attend = _optional_attr("ladle.kernels.paged_attention", "paged_attention")
        bucket = dispatch.tokens_bucket(num_tokens)
        if store is None:
            dispatch.record("kv_store", bucket, configured=True, eligible=False, executed=False,
                            reason="ladle.kernels.kv_store not importable")
        if attend is None:
            dispatch.record("attn_decode" if decode else "attn_prefill", bucket, configured=True, eligible=False,
                            executed=False, reason="ladle.kernels.paged_attention not importable")
        return store or store_kv_ref, attend or paged_attention_ref

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"layer_idx={self.layer_idx}")
