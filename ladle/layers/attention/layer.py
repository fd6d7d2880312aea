"""The paged `Attention` layer (Llama and MiniMax-M3 alike): stores this step's K/V (and, for MSA layers, index-K),
then attends over each request's context, densely or over the blocks the MSA indexer selects.

The layer calls ops; each op (ladle/kernels/<op>.py) runs its Triton kernel or its torch reference, by the backend
asked for (`ForwardContext.backends.triton_attention`) and its own eligibility rule, and records the decision in
`ladle.observe.dispatch`:
  dense layers: `store_kvcache` -> `paged_attention`
  MSA layers:   `store_kvcache`, `store_index_kcache` -> `msa_indexer` -> `msa_sparse_attention`
A model whose q/k take a per-head norm + RoPE (MiniMax-M3) may call `norm_rope_store` first (op
`qk_norm_rope_store`: the norms, RoPE and the K/V / index-K stores in one launch) and then `forward(...,
stored=True)`, which skips the stores.
With Triton the whole forward is graph-safe (no host mirrors, no host syncs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from ladle.kernels.head_norm_rope import qk_norm_rope_store
from ladle.kernels.kv_store import store_index_kcache, store_kvcache
from ladle.kernels.msa_indexer import msa_indexer
from ladle.kernels.msa_sparse_attention import msa_sparse_attention
from ladle.kernels.paged_attention import paged_attention
from ladle.layers.attention.metadata import LayerCacheSpec, get_forward_context


@dataclass(frozen=True)
class MSAParams:
    """Indexer geometry of an MSA sparse layer (design/minimax_m3.md §3.5): block_size (the MSA block, equal to the
    KV block), topk_blocks (blocks kept per token and KV group), local_blocks (trailing blocks always kept),
    index_head_dim (the index-K row the cache holds; needed by `Attention.kv_cache_spec`, not by forward)."""

    block_size: int
    topk_blocks: int
    local_blocks: int
    index_head_dim: int = 0


class Attention(nn.Module):
    """Paged causal self-attention over the KV cache of layer `layer_idx`, block-sparse when `msa` is given.

    Args: num_heads (query heads), num_kv_heads (divides num_heads), head_dim, scale (softmax scale),
    layer_idx (index into `ForwardContext.kv_caches`), msa (MSA indexer geometry; None for a dense layer).

    forward(q, k, v, index_q=None, index_k=None, stored=False) -> [T, Hq*D] in q's dtype.
      q [T, Hq*D] or [T, Hq, D]; k, v [T, Hkv*D] or [T, Hkv, D] (row-strided views of a fused qkv output are fine);
      index_q [T, ni, di] (ni = num_kv_heads) and index_k [T, di] for MSA layers, post-norm post-RoPE.
      stored=True: `norm_rope_store` already wrote this step's K/V (and index-K); k, v and index_k must be None.
    Writes K/V (and index-K) at `slot_mapping` (skipping -1) into `ctx.kv_caches[layer_idx]`, quantized with the
    cache's per-tensor scales when the cache is FP8 (`LayerKVCache.k_scale` / `v_scale` / `index_k_scale`, passed to
    every store and read op). No parameters.
    MSA layers: when `ctx.extras.get("record_msa_selection")` is truthy, the step's selected_block_ids
    [Hkv, T, topk] int32 (ARCHITECTURE.md "MSA selection") are left in
    `ctx.extras["msa_selected_block_ids"][layer_idx]`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 msa: Optional[MSAParams] = None) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} % num_kv_heads {num_kv_heads} != 0"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.msa = msa
        # per-tensor FP8 KV-cache scales (float32 values) from the checkpoint, 1.0 when it has none; the runner
        # copies them into LayerKVCache (via the model's `kv_cache_scales()`) when --kv-cache-dtype is fp8
        self.k_scale = 1.0
        self.v_scale = 1.0

    def norm_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: nn.Module,
                        k_norm: nn.Module, cos: torch.Tensor, sin: torch.Tensor, index_q: Optional[torch.Tensor] = None,
                        index_k: Optional[torch.Tensor] = None, index_q_norm: Optional[nn.Module] = None,
                        index_k_norm: Optional[nn.Module] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Per-head (1 + w) RMSNorm + partial NeoX RoPE of q and k (and, MSA layers, of index_q and index_k) and this
        step's K/V (+ index-K) cache stores, in one op (`qk_norm_rope_store`, Triton when the attention backend
        asks for it): q [T, Hq, D], k / v [T, Hkv, D], index_q [T, ni, di], index_k [T, di] pre-norm (column views
        are fine); the norms are RMSNorm layers with weight_offset 1; cos / sin [T, r]. Returns (q, index_q) normed
        and roped, for `forward(q, None, None, index_q, None, stored=True)`."""
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer_idx]
        norms = [q_norm, k_norm] + ([index_q_norm, index_k_norm] if self.msa is not None else [])
        assert all(n.weight_offset == 1.0 for n in norms), "qk_norm_rope_store implements the (1 + w) norm"
        index = None
        if self.msa is not None:
            assert index_q is not None and index_k is not None and cache.index_key_cache is not None
            index = (index_q, index_k, index_q_norm.weight, index_k_norm.weight, (index_q_norm.eps, index_k_norm.eps),
                     cache.index_key_cache, cache.index_k_scale)
        return qk_norm_rope_store(q, k, v, q_norm.weight, k_norm.weight, (q_norm.eps, k_norm.eps), cos, sin,
                                  cache.key_cache, cache.value_cache, ctx.attn_metadata.slot_mapping,
                                  k_scale=cache.k_scale, v_scale=cache.v_scale, index=index,
                                  use_triton=ctx.backends.triton_attention)

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                index_q: Optional[torch.Tensor] = None, index_k: Optional[torch.Tensor] = None,
                stored: bool = False) -> torch.Tensor:
        ctx = get_forward_context()
        md = ctx.attn_metadata
        cache = ctx.kv_caches[self.layer_idx]
        use_triton = ctx.backends.triton_attention
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        if stored:
            assert k is None and v is None and index_k is None, "stored=True: norm_rope_store wrote K/V and index-K"
        else:
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
            store_kvcache(k, v, cache.key_cache, cache.value_cache, md.slot_mapping, use_triton=use_triton, **scales)
        if self.msa is None:
            out = paged_attention(q, cache.key_cache, cache.value_cache, md, self.scale, use_triton=use_triton,
                                  **scales)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        msa = self.msa
        assert index_q is not None and (stored or index_k is not None) and cache.index_key_cache is not None
        assert md.block_size == msa.block_size == cache.key_cache.shape[1], \
            f"KV block size {md.block_size} must equal the MSA block size {msa.block_size}"
        if not stored:
            store_index_kcache(index_k, cache.index_key_cache, md.slot_mapping, index_k_scale=cache.index_k_scale,
                               use_triton=use_triton)
        selected = msa_indexer(index_q, cache.index_key_cache, md.block_table, md.positions, md.query_start_loc,
                               msa.topk_blocks, local_blocks=msa.local_blocks, index_k_scale=cache.index_k_scale,
                               use_triton=use_triton)
        if ctx.extras.get("record_msa_selection"):
            ctx.extras.setdefault("msa_selected_block_ids", {})[self.layer_idx] = selected
        out = msa_sparse_attention(q, cache.key_cache, cache.value_cache, md.block_table, selected, md.positions,
                                   md.query_start_loc, self.scale, use_triton=use_triton, **scales)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def kv_cache_spec(self) -> LayerCacheSpec:
        """This layer's cache needs: K/V heads and head_dim, plus the index-K head dim (0 for a dense layer)."""
        index_head_dim = 0 if self.msa is None else self.msa.index_head_dim
        assert self.msa is None or index_head_dim > 0, "MSAParams.index_head_dim is needed for the index-K cache"
        return LayerCacheSpec(self.num_kv_heads, self.head_dim, index_head_dim)

    def extra_repr(self) -> str:
        sparse = f", msa={self.msa}" if self.msa is not None else ""
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"layer_idx={self.layer_idx}{sparse}")


# Checkpoint names of per-tensor KV-cache scales in Hugging Face FP8-KV checkpoints (the names vLLM reads):
# `...layers.N.self_attn.k_scale` / `v_scale`, the older single `kv_scale`, and `k_proj.output_scale` /
# `v_proj.output_scale`.
_KV_SCALE_NAME = re.compile(
    r".*layers\.(?P<layer>\d+)\.self_attn\.(?:(?P<kv>[kv])_scale|kv_scale|(?P<proj>[kv])_proj\.output_scale)")


def take_kv_scales(weights: Iterable[tuple[str, torch.Tensor]],
                   attn_layers: list[Attention]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass every checkpoint tensor through, except KV-cache scales (`_KV_SCALE_NAME`), which are stored as floats
    on `attn_layers[N].k_scale` / `v_scale` (kv_scale: both). A scale must be one positive number (per-head
    scales are refused with ValueError, not averaged)."""
    for name, tensor in weights:
        m = _KV_SCALE_NAME.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        if tensor.numel() != 1 or not float(tensor.reshape(-1)[0]) > 0:
            raise ValueError(f"{name}: a KV-cache scale must be one positive number (per-tensor), got shape "
                             f"{tuple(tensor.shape)}")
        layer = attn_layers[int(m.group("layer"))]
        which = m.group("kv") or m.group("proj") or "kv"
        value = float(tensor.float().reshape(-1)[0])
        if "k" in which:
            layer.k_scale = value
        if "v" in which:
            layer.v_scale = value
