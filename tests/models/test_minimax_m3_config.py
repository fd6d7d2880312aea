"""MiniMax-M3 config parsing (both on-disk forms, refusals), the checkpoint tool and its tokenizer, and serving
the tiny preset end to end (LLM.generate; `ladle serve` + the openai client)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest
import torch

from ladle.tools.checkpoint_m3 import main as make_checkpoint_main, make_checkpoint, root_config, text_config
from ladle.models.minimax_m3 import MiniMaxM3ForCausalLM
from ladle.models.minimax_m3_config import parse_m3_config


pytestmark = pytest.mark.usefixtures("one_thread")


def release_root() -> dict:
    return root_config(text_config("tiny"), "bf16")


def transformers_form() -> dict:
    """What MiniMaxM3VLTextConfig.to_dict() writes for the tiny preset (minimax_m3_vs_transformers.md B7)."""
    return {
        "architectures": ["MiniMaxM3VLForCausalLM"], "model_type": "minimax_m3_vl_text", "vocab_size": 512,
        "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "num_experts_per_tok": 2,
        "num_local_experts": 8, "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 5000000,
                                                    "rope_type": "default"},
        "dense_intermediate_size": 256, "intermediate_size": 64, "shared_intermediate_size": 64,
        "routed_scaling_factor": 2.0, "rotary_dim": 16, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "index_n_heads": 2, "index_head_dim": 32,
        "index_block_size": 16, "index_topk_blocks": 4, "index_local_blocks": 1,
        "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "minimax_m3_sparse"],
    }


def test_release_and_transformers_forms_parse_to_the_same_config():
    a, b = parse_m3_config(release_root()), parse_m3_config(transformers_form())
    assert a == b
    assert a.rotary_dim == 16 and a.sparse_layers == (False, True, True, True) and a.moe_layers == a.sparse_layers
    assert (a.index_block_size, a.index_topk_blocks, a.index_n_heads, a.bos_token_id, a.eos_token_id) == (16, 4, 2, 1, 2)
    assert parse_m3_config(release_root()["text_config"]) == a  # root or text config alike


def _tc() -> dict:
    return copy.deepcopy(text_config("tiny"))


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c.update(rotary_dim=32), "rotary_dim=32 disagrees"),
    (lambda c: c.pop("partial_rotary_factor"), "rotary_dim=16 disagrees"),  # transformers would rotate all 32
    (lambda c: c.update(use_gemma_norm=False), "use_gemma_norm"),
    (lambda c: c.update(attention_output_gate=True), "attention_output_gate"),
    (lambda c: c.update(qk_norm_type="per_layer"), "qk_norm_type"),
    (lambda c: c.update(scoring_func="softmax"), "scoring_func"),
    (lambda c: c.update(use_routing_bias=False), "use_routing_bias"),
    (lambda c: c.update(n_shared_experts=2), "n_shared_experts"),
    (lambda c: c["sparse_attention_config"].update(sparse_init_block=1), "sparse_init_block"),
    (lambda c: c["sparse_attention_config"].update(sparse_score_type="sum"), "sparse_score_type"),
    (lambda c: c["sparse_attention_config"].update(use_sparse_attention=False), "use_sparse_attention"),
    (lambda c: c["sparse_attention_config"].update(sparse_disable_index_value=[0, 0, 0, 0]), "index value"),
    (lambda c: c.pop("sparse_attention_config"), "all-dense"),
    (lambda c: c.pop("moe_layer_freq"), "moe_layer_freq"),
    (lambda c: c.update(layer_types=["full_attention"] * 4), "different values"),
    (lambda c: c.update(index_topk_blocks=8), "different values"),
    (lambda c: c["sparse_attention_config"].update(sparse_num_index_heads=1), "must equal kv heads"),
])
def test_unsupported_or_inconsistent_configs_are_refused(mutate, needle):
    c = _tc()
    mutate(c)
    with pytest.raises(ValueError, match=needle):
        parse_m3_config(c)


def test_rotary_dim_alone_equal_to_head_dim_is_accepted():
    c = _tc()
    c.pop("partial_rotary_factor")
    c["rotary_dim"] = 32
    assert parse_m3_config(c).rotary_dim == 32


def test_block_size_and_cache_specs():
    assert MiniMaxM3ForCausalLM.required_block_size(release_root()) == 16
    m = MiniMaxM3ForCausalLM(release_root(), torch.float32, "cpu")
    specs = m.kv_cache_specs()
    assert [s.index_head_dim for s in specs] == [0, 32, 32, 32]
    assert all((s.num_kv_heads, s.head_dim) == (2, 32) for s in specs)
    m.init_dummy_weights(0)
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_loader_skips_vision_and_refuses_unknown_names():
    m = MiniMaxM3ForCausalLM(release_root(), torch.float32, "cpu")
    assert m.load_weights([("vision_tower.vision_model.pre_layrnorm.weight", torch.zeros(32)),
                           ("multi_modal_projector.linear_1.bias", torch.zeros(128))]) == set()
    with pytest.raises(ValueError, match="unknown"):
        m.load_weights([("language_model.model.layers.0.self_attn.gate_proj.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="shape"):
        m.load_weights([("language_model.model.norm.weight", torch.zeros(127))])


def test_checkpoint_layout_and_tokenizer(ckpt):
    from tokenizers import Tokenizer

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "minimax_m3_vl" and "text_config" in cfg and "vision_config" in cfg
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert all(n.startswith("language_model.") for n in index["weight_map"])
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w3.weight" in index["weight_map"]
    from safetensors import safe_open
    shard = os.path.join(ckpt, index["weight_map"]["language_model.model.layers.1.block_sparse_moe.gate.weight"])
    with safe_open(shard, "pt") as f:
        assert f.get_tensor("language_model.model.layers.1.block_sparse_moe.gate.weight").dtype == torch.float32
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id("]~!b[") == 1 and tok.token_to_id("[e~[") == 2
    for i in range(512):
        tok.decode([i], skip_special_tokens=False)  # every id decodes
    text = "Hello, M3! ünïcode ✓"
    assert tok.decode(tok.encode(text).ids) == text


def test_chat_template_renders_m3_roles(ckpt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("]~!b[]~b]system\n") and text.count("]~!b[") == 1
    assert "]~b]developer\nBe brief.[e~[\n]~b]user\nHi[e~[\n]~b]ai\nHello[e~[\n]~b]user\nBye[e~[\n" in text
    assert text.endswith("]~b]ai\n")
    think = tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True, thinking_mode="enabled")
    assert think.endswith("]~b]ai\n<mm:think>") and "You are a helpful assistant." in think


def test_cli_config_only_and_mxfp8(tmp_path):
    out = str(tmp_path / "cfg")
    assert make_checkpoint_main(["--preset", "tp4-rank", "--config-only", out]) == 0
    assert not any(f.endswith(".safetensors") for f in os.listdir(out))
    with open(os.path.join(out, "config.json")) as f:
        tc = json.load(f)["text_config"]
    cfg = parse_m3_config(tc)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.index_n_heads, cfg.intermediate_size) == (16, 1, 1, 768)
    mx = make_checkpoint(str(tmp_path / "mx"), "tiny", dtype="mxfp8")
    with open(os.path.join(mx, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "mxfp8"
    with open(os.path.join(mx, "model.safetensors.index.json")) as f:
        names = json.load(f)["weight_map"]
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale_inv" in names
    assert "language_model.model.layers.1.block_sparse_moe.gate.weight_scale_inv" not in names


# -- end to end through the engine and the server ------------------------------------------------------

def _engine_ready() -> bool:
    return importlib.util.find_spec("ladle.engine.llm") is not None


@pytest.mark.skipif(not _engine_ready(), reason="ladle.engine.llm not written yet")
def test_llm_generate_matches_manual_greedy(ckpt):
    from ladle.core.sampling_params import SamplingParams
    from ladle.engine.llm import LLM
    from drivers.minimax_m3_paged import PagedDriver, load_m3_dir

    llm = LLM(ckpt, kv_cache_memory_bytes=32 << 20)
    prompts = [[5, 6, 7, 8] * 40, list(range(10, 60))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    want = PagedDriver(load_m3_dir(ckpt), num_blocks=40).greedy(dict(enumerate(prompts)), 24)
    assert [o.outputs[0].token_ids for o in outs] == [want[0], want[1]]
    # prefix-cache hit (whole 16-token MSA blocks, index-K included) gives the same continuation
    again = llm.generate([prompts[0][:150] + [9, 9, 9]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    miss = PagedDriver(load_m3_dir(ckpt), num_blocks=20).greedy({0: prompts[0][:150] + [9, 9, 9]}, 8)
    assert again[0].num_cached_tokens == 144 and again[0].outputs[0].token_ids == miss[0]


@pytest.mark.skipif(importlib.util.find_spec("ladle.engine.async_engine") is None, reason="no async engine yet")
def test_serve_tiny_answers_chat(ckpt, tmp_path):
    pytest.importorskip("httpx")
    openai = pytest.importorskip("openai")
    from ladle_serve_process import LadleServeProcess  # tests/ladle_serve_process.py (needs httpx)

    serve = LadleServeProcess([ckpt, "--kv-cache-memory-bytes", "32M"], tmp_path / "serve.log",
                              env=dict(os.environ, OMP_NUM_THREADS="1")).start(timeout=180)
    try:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Say hi"}]
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0,
                                                     stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == r.choices[0].message.content
    finally:
        serve.stop()


def release_text_config() -> dict:
    """The BF16 release's text_config key set and values (design/minimax_m3.md §1.2)."""
    freq = [0, 0, 0] + [1] * 57
    return {
        "architectures": ["MiniMaxM3SparseForCausalLM"], "hidden_size": 6144, "num_hidden_layers": 60,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 200064,
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "use_gemma_norm": True,
        "attention_output_gate": False, "rope_theta": 5000000, "rotary_dim": 64, "partial_rotary_factor": 0.5,
        "hidden_act": "swigluoai", "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "use_qk_norm": True,
        "qk_norm_type": "per_head", "tie_word_embeddings": False, "dense_intermediate_size": 12288,
        "intermediate_size": 3072, "shared_intermediate_size": 3072, "num_local_experts": 128,
        "num_experts_per_tok": 4, "n_shared_experts": 1, "scoring_func": "sigmoid", "use_routing_bias": True,
        "routed_scaling_factor": 2.0, "moe_layer_freq": freq, "num_mtp_modules": 7, "num_nextn_predict_layers": 1,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_num_index_heads": 4, "sparse_index_dim": 128,
            "sparse_block_size": 128, "sparse_topk_blocks": 16, "sparse_local_block": 1, "sparse_init_block": 0,
            "sparse_score_type": "max", "sparse_attention_freq": freq, "sparse_disable_index_value": freq},
    }


def test_release_config_parses_to_the_real_model_shape():
    root = {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "text_config": release_text_config()}
    cfg = parse_m3_config(root)
    assert (cfg.rotary_dim, cfg.num_kv_groups, cfg.index_block_size, cfg.index_topk_blocks) == (64, 16, 128, 16)
    assert sum(cfg.sparse_layers) == 57 and cfg.sparse_layers == cfg.moe_layers and not any(cfg.sparse_layers[:3])
    assert (cfg.bos_token_id, cfg.eos_token_id) == (200034, 200020)  # transformers' defaults, absent in the file
    assert MiniMaxM3ForCausalLM.required_block_size(root) == 128
    with torch.device("meta"):
        m = MiniMaxM3ForCausalLM(root, torch.bfloat16, "meta")
    n_params = sum(p.numel() for p in m.parameters())
    h, attn = 6144, 2 * 6144 + 8192 * 6144 * 2 + 512 * 6144 * 2 + 2 * 128  # norms, q/o, k/v, q/k norms
    dense = attn + 3 * 12288 * h
    moe = attn + (512 + 128) * h + 2 * 128 + 128 * h + 128 + (128 + 1) * 3 * 3072 * h
    assert n_params == 2 * 200064 * h + h + 3 * dense + 57 * moe  # spec §2.1 tensor table, summed by hand
    # ... which is the release's 427,040,140,160 values minus the vision tower, projector and patch merge (~0.87 B)
    assert 0.85e9 < 427_040_140_160 - n_params < 0.88e9
    specs = m.kv_cache_specs()
    assert specs[0].index_head_dim == 0 and specs[3].index_head_dim == 128 and specs[3].num_kv_heads == 4
