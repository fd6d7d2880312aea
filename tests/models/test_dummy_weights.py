"""The one dummy-weight initialiser (ladle/models/weights.py) on MiniMax-M3: documented bounds per parameter kind,
seeded, and a 24-layer stack (the tiny preset's shapes, every layer MSA + MoE after the first) stays finite."""

from __future__ import annotations

import math

import pytest
import torch

from m3_helpers import prompt

from ladle.layers.norm import RMSNorm
from ladle.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from ladle.tools.checkpoint_m3 import root_config, text_config
from ladle.models.minimax_m3 import MiniMaxM3ForCausalLM
from drivers.minimax_m3_paged import PagedDriver

pytestmark = pytest.mark.usefixtures("one_thread")


def _deep_tiny(num_layers: int) -> dict:
    tc = text_config("tiny")
    plan = [0] + [1] * (num_layers - 1)
    tc.update(num_hidden_layers=num_layers, moe_layer_freq=plan)
    tc["sparse_attention_config"] = dict(tc["sparse_attention_config"], sparse_attention_freq=plan,
                                         sparse_disable_index_value=plan)
    return root_config(tc, "bf16")


def test_m3_dummy_bounds_seed_and_deep_stack_finite():
    model = MiniMaxM3ForCausalLM(_deep_tiny(24), torch.float32, "cpu")
    model.init_dummy_weights(5)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, RMSNorm):  # (1 + w) within 1 ± 0.1, and not all the identity
                assert p.abs().max() <= 0.1 and p.std() > 0.01
            elif isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
                assert p.abs().max() <= 1.0 and p.abs().max() > 0.9
            elif p.dim() >= 2:
                bound = 1 / math.sqrt(p.shape[-1])
                assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound
    again = MiniMaxM3ForCausalLM(_deep_tiny(24), torch.float32, "cpu")
    again.init_dummy_weights(5)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    logits = PagedDriver(model, num_blocks=8).prefill("a", prompt(40, 1))
    assert torch.isfinite(logits).all() and logits.std() > 1e-3
