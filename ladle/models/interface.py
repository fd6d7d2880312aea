"""What every model class offers the runner (LlamaForCausalLM, MiniMaxM3ForCausalLM, ...).

Construction: `cls(hf_config: dict, dtype: torch.dtype, device: torch.device)` where `hf_config` is the
parsed config.json (text config for multimodal wrappers) as a plain dict, overrides already merged.
Weights: `load_weights(iterable of (checkpoint_name, tensor))` maps checkpoint names through the model's one
declared name table to each parameter's `weight_loader` (ladle/models/weights.py: `load_weights_by_table`);
`init_dummy_weights(seed)` calls the one dummy initialiser (`ladle.models.weights.init_dummy_weights`).
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from ladle.layers.attention.metadata import LayerCacheSpec


class CausalLM(Protocol):
    @classmethod
    def required_block_size(cls, hf_config: dict) -> "int | None":
        """The KV block size the model's semantics fix (MiniMax-M3: index_block_size), or None."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden states [T, hidden] in the model dtype.
        Reads the AttentionMetadata and KV caches from `get_forward_context()` and writes the new K/V."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, vocab] float32."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in; return the set of parameter names loaded. Raises on unknown names
        that are not in the model's documented skip list, and on shape mismatches."""

    def init_dummy_weights(self, seed: int) -> None:
        """Random weights that keep a deep stack finite (small uniform values; norms near 1)."""

    def kv_cache_specs(self) -> list[LayerCacheSpec]:
        """One LayerCacheSpec per layer, in layer order (index into ForwardContext.kv_caches)."""
