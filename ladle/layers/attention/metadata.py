"""Per-step attention metadata and the forward context through which layers reach it.

Built once per step by `ladle/runner/input_batch.py`, never mutated by layers. Layers read it only via
`get_forward_context()`, which asserts that a context is set (ARCHITECTURE.md, "Core types").

KV layout (fixed): per layer, K and V are separate contiguous tensors
`[num_blocks, block_size, num_kv_heads, head_dim]`; sparse MSA layers add index-K
`[num_blocks, block_size, index_head_dim]` sharing the block table. `slot_mapping[t] = block_id *
block_size + offset`, -1 for padding tokens. Block 0 is the null block (never allocated to a request).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch


@dataclass
class LayerKVCache:
    """One layer's cache tensors (see module docstring for shapes) and their per-tensor dequantization scales.

    The tensors hold the model dtype (`--kv-cache-dtype auto`) or an FP8 dtype (float8_e4m3fn / float8_e5m2):
    stores write fp8(clamp(x / scale)), readers use stored * scale (ladle/kernels/kv_store.py). The scales live
    here, beside the tensors they describe, as host floats (float32 values; constant for the cache's life, so a
    CUDA graph may bake them in): 1.0 unless the runner was given calibrated ones. They are ignored for auto caches.
    """

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    index_key_cache: Optional[torch.Tensor] = None  # [num_blocks, block_size, index_head_dim] (MSA layers)
    k_scale: float = 1.0
    v_scale: float = 1.0
    index_k_scale: float = 1.0


@dataclass
class LayerCacheSpec:
    """What one layer needs in the KV cache; the runner sizes and allocates from a list of these."""

    num_kv_heads: int
    head_dim: int
    index_head_dim: int = 0  # > 0 for MSA sparse layers

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return (2 * self.num_kv_heads * self.head_dim + self.index_head_dim) * dtype_bytes


@dataclass
class AttentionMetadata:
    """Batch geometry for one step. B = requests in the step, T = tokens in the step.

    Device tensors (dtypes as built by ladle/runner/input_batch.py and the CUDA-graph buffers of
    ladle/runner/cuda_graph.py):
      query_start_loc [B+1] int32 — token offsets of each request's queries in the flat batch.
      seq_lens        [B]   int32 — context + new tokens per request after this step.
      context_lens    [B]   int32 — tokens already in the cache before this step (= seq_lens - query lens).
      block_table     [B, >= max blocks] int32 — physical block ids, padded with the null block 0; rows are
                      contiguous (the row stride may exceed the width).
      slot_mapping    [T]   int64 — cache slot for each new token, -1 for padding tokens.
      positions       [T]   int64 — absolute position of each token (the model's `positions` tensor).
    Host fields: block_size, max_query_len, max_seq_len (ints); num_actual_tokens (T without CUDA-graph padding).
    Host mirrors (`*_cpu`, Python lists of int) serve the torch reference paths without a device sync. In steps
    built by input_batch.py they equal the device tensors; in CUDA-graph decode metadata (a bucket of B rows, one
    token each) they hold capture-time values, which is why only graph-safe (Triton) paths run inside graphs.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    context_lens_cpu: list[int] = field(default_factory=list)
    num_actual_tokens: int = 0  # T without CUDA-graph padding (0 = not set)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


ATTENTION_BACKENDS = ("TRITON_ATTN", "TORCH")  # ladle's values of vLLM's --attention-backend
MOE_BACKENDS = ("triton", "torch")  # ladle's values of vLLM's --moe-backend


@dataclass(frozen=True)
class OpBackends:
    """Which implementation each op family runs in one forward; the runner resolves it once from RunnerConfig
    (`--attention-backend`, `--moe-backend`, `--fused-norms`) and every layer reads it from the forward context.

    attention: "TRITON_ATTN" (ladle.kernels: KV / index-K store, paged attention, MSA indexer and sparse
      attention; graph-safe, no host mirrors) or "TORCH" (the ops' torch references).
    moe: "triton" (router + fused MoE kernels) or "torch" (their references).
    fused_norms: True runs the Triton residual-add + RMSNorm and per-head norm + RoPE kernels; False the torch
      references (same rounding points).
    Whatever is chosen, each op still checks its eligibility rule and records configured / eligible / executed in
    ladle.observe.dispatch (an ineligible input falls back to the reference, visibly).
    """

    attention: str = "TORCH"
    moe: str = "torch"
    fused_norms: bool = False

    def __post_init__(self) -> None:
        assert self.attention in ATTENTION_BACKENDS, self.attention
        assert self.moe in MOE_BACKENDS, self.moe

    @classmethod
    def kernels(cls) -> "OpBackends":
        """Every Triton fast path (what the runner picks on CUDA by default)."""
        return cls("TRITON_ATTN", "triton", True)

    @classmethod
    def reference(cls) -> "OpBackends":
        """Every torch reference (what the runner picks on CPU by default)."""
        return cls()

    @property
    def triton_attention(self) -> bool:
        return self.attention == "TRITON_ATTN"

    @property
    def triton_moe(self) -> bool:
        return self.moe == "triton"

    @property
    def graph_safe(self) -> bool:
        """Whether a forward with these backends may be captured in a CUDA graph (no host mirrors, no syncs): the torch
        attention references read host mirrors and the torch MoE references sync (`torch.unique(...).tolist()`), so
        both Triton paths are needed."""
        return self.triton_attention and self.triton_moe


@dataclass
class ForwardContext:
    """What layers may read during `model.forward`: the metadata, this step's caches (by layer index) and the
    op backends to run."""

    attn_metadata: AttentionMetadata
    kv_caches: list[LayerKVCache]
    backends: OpBackends = field(default_factory=OpBackends)
    extras: dict = field(default_factory=dict)  # e.g. MSA selections for tests/debug


_CONTEXT: list[ForwardContext] = []


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Install `ctx` for the duration of one forward pass (not thread-shared: one engine thread runs steps)."""
    _CONTEXT.append(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.pop()


def get_forward_context() -> ForwardContext:
    """The current forward context. Raises AssertionError outside `set_forward_context`."""
    assert _CONTEXT, "no forward context: model.forward must run inside set_forward_context()"
    return _CONTEXT[-1]
