"""LlamaForCausalLM on tiny random configs against transformers (Llama, Llama-3 RoPE scaling, Qwen2, Mistral).

The transformers model with random weights is the oracle; ladle receives the same state_dict through
`load_weights` and runs through the paged cache (`PagedTestCache`), in float32.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from drivers.paged_test_cache import PagedTestCache
from ladle.models.llama import LlamaForCausalLM

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
TOL = 2e-4


def _pair(cfg: transformers.PretrainedConfig, cls: type, seed: int = 0):
    torch.manual_seed(seed)
    ref = cls(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights and biases so mapping mistakes show
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
    ours = LlamaForCausalLM(cfg.to_dict(), torch.float32, "cpu")
    loaded = ours.load_weights(ref.state_dict().items())
    assert loaded == {n for n, _ in ours.named_parameters()}
    return ref, ours.eval()


def _ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def _prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths[:n]]


CONFIGS = {
    "llama_untied": (transformers.LlamaConfig(**BASE, tie_word_embeddings=False), transformers.LlamaForCausalLM),
    "llama_tied_mha": (transformers.LlamaConfig(**{**BASE, "num_key_value_heads": 4}, tie_word_embeddings=True),
                       transformers.LlamaForCausalLM),
    "llama3_scaling": (transformers.LlamaConfig(**BASE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), transformers.LlamaForCausalLM),
    "qwen2_bias": (transformers.Qwen2Config(**BASE, tie_word_embeddings=False), transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig(**BASE, sliding_window=None), transformers.MistralForCausalLM),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ragged_batch_matches_transformers_every_position(name):
    cfg, cls = CONFIGS[name]
    ref, ours = _pair(cfg, cls)
    prompts = _prompts(3, [23, 5, 70], cfg.vocab_size)
    cache = PagedTestCache(ours.kv_cache_specs(), num_blocks=64, block_size=8)
    chunks = [(i, p) for i, p in enumerate(prompts)]
    with torch.no_grad():
        logits = ours.compute_logits(cache.run(ours, chunks, num_padding=4))
    assert logits.dtype == torch.float32
    offset = 0
    for p in prompts:
        expected = _ref_logits(ref, p)
        assert (logits[offset:offset + len(p)] - expected).abs().max() < TOL
        offset += len(p)


def test_chunked_prefill_then_decode_equals_full_forward():
    cfg, cls = CONFIGS["llama_untied"]
    ref, ours = _pair(cfg, cls, seed=1)
    (seq,) = _prompts(1, [40], cfg.vocab_size, seed=3)
    expected = _ref_logits(ref, seq)
    cache = PagedTestCache(ours.kv_cache_specs(), num_blocks=32, block_size=4)
    got = []
    with torch.no_grad():
        for lo, hi in [(0, 9), (9, 10), (10, 27), (27, 32)]:  # chunked prefill (block-unaligned cuts)
            got.append(ours.compute_logits(cache.run(ours, [("s", seq[lo:hi])])))
        for t in range(32, 40):  # decode, with another sequence prefilling in the same steps
            h = cache.run(ours, [("s", [seq[t]]), (f"other{t}", seq[:3])])
            got.append(ours.compute_logits(h[:1]))
    assert (torch.cat(got) - expected).abs().max() < TOL


def test_unsupported_configs_raise():
    with pytest.raises(ValueError, match="sliding"):
        LlamaForCausalLM(transformers.MistralConfig(**BASE, sliding_window=16).to_dict())
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaForCausalLM({**transformers.LlamaConfig(**BASE).to_dict(), "hidden_act": "gelu"})


def test_load_weights_rejects_unknown_and_misshaped():
    cfg, cls = CONFIGS["llama_untied"]
    ours = LlamaForCausalLM(cfg.to_dict())
    with pytest.raises(KeyError, match="no parameter"):
        ours.load_weights([("model.layers.0.self_attn.rotary_thing.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        ours.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))])
    with pytest.raises(ValueError, match="shape"):
        ours.load_weights([("model.norm.weight", torch.zeros(65))])
    assert ours.load_weights([("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))]) == set()
