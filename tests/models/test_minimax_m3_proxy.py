"""The one-GPU TP4-rank proxy (issue 6): fewer layers through `--num-layers` or `--hf-overrides`, the proxy's
parameter bytes against a hand sum of the spec shapes (design/minimax_m3.md §5.2), and the byte / FLOP arithmetic of
benchmarks/gpu_m3_proxy_roofline.py against hand sums and the numbers in design/kernels_and_limits.md §6."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from ladle.config import ModelConfig
from ladle.tools.checkpoint_m3 import (cut_layers, layer_overrides, layer_overrides_json, main as make_checkpoint_main,
                                        root_config, text_config)
from ladle.models.loader import resolve_model_source
from ladle.models.minimax_m3 import MiniMaxM3ForCausalLM
from ladle.models.minimax_m3_config import parse_m3_config

pytestmark = pytest.mark.usefixtures("one_thread")

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_m3_proxy_roofline.py")
_spec = importlib.util.spec_from_file_location("gpu_m3_proxy_roofline", _PATH)
roof = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roof)

GiB = 2**30
H200_TOTAL = int(139.8 * GiB)  # what torch.cuda.mem_get_info reports on an H200 (143771 MiB in nvidia-smi)


def _write_config(path, tc: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(root_config(tc, "bf16"), f)
    return str(path)


def _meta(tc: dict) -> MiniMaxM3ForCausalLM:
    return MiniMaxM3ForCausalLM(root_config(tc, "bf16"), torch.bfloat16, "meta")


def hand_param_bytes(num_layers: int, num_dense: int = 3) -> int:
    """bf16 bytes (router and its bias fp32) of the first `num_layers` layers of one TP4 rank, from spec §5.2."""
    h, v, nh, nkv, hd, ni, di, d_int, inter, e = 6144, 200064, 16, 1, 128, 1, 128, 3072, 768, 128
    total = 2 * v * h * 2 + h * 2  # embed + lm_head + final norm
    for i in range(num_layers):
        total += (2 * h + 2 * hd) * 2  # input/post-attention norms, q/k norms
        total += (nh * hd * h + 2 * nkv * hd * h + h * nh * hd) * 2  # q, k, v, o
        if i < num_dense:
            total += 3 * h * d_int * 2  # gate, up, down
        else:
            total += (ni * di * h + di * h + 2 * di) * 2  # indexer q, k projections and norms
            total += (e * h + e) * 4 + (e + 1) * 3 * inter * h * 2  # router + bias fp32; 128 routed + shared
    return total


def test_num_layers_flag_cuts_the_layer_plan(tmp_path):
    out = tmp_path / "tiny3"
    assert make_checkpoint_main(["--preset", "tiny", "--config-only", "--num-layers", "3", str(out)]) == 0
    tc = json.load(open(out / "config.json"))["text_config"]
    assert tc["num_hidden_layers"] == 3 and tc["moe_layer_freq"] == [0, 1, 1]
    sc = tc["sparse_attention_config"]
    assert sc["sparse_attention_freq"] == [0, 1, 1] == sc["sparse_disable_index_value"]
    assert sc["sparse_topk_blocks"] == 4  # the other keys stay
    cfg = parse_m3_config(json.load(open(out / "config.json")))
    assert cfg.sparse_layers == (False, True, True) and cfg.moe_layers == cfg.sparse_layers
    with pytest.raises(SystemExit):
        make_checkpoint_main(["--preset", "tiny", "--num-layers", "5", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_tp4_rank_text_config_has_one_ranks_shapes():
    cfg = parse_m3_config(root_config(cut_layers(text_config("tp4-rank"), 16), "bf16"))
    shapes = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim,
              cfg.index_n_heads, cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks,
              cfg.dense_intermediate_size, cfg.intermediate_size, cfg.shared_intermediate_size,
              cfg.num_local_experts, cfg.num_experts_per_tok, cfg.vocab_size)
    assert shapes == (6144, 16, 1, 128, 64, 1, 128, 128, 16, 3072, 768, 768, 128, 4, 200064)
    assert cfg.num_hidden_layers == 16 and cfg.sparse_layers == (False,) * 3 + (True,) * 13
    assert cfg.moe_layers == cfg.sparse_layers


def test_hf_overrides_keep_the_first_layers_through_the_loader(tmp_path):
    path = _write_config(tmp_path / "tp4", text_config("tp4-rank"))
    mc = ModelConfig(model=path, load_format="dummy", hf_overrides=layer_overrides_json("tp4-rank", 16))
    cfg = parse_m3_config(resolve_model_source(mc).hf_config)
    assert cfg == parse_m3_config(root_config(cut_layers(text_config("tp4-rank"), 16), "bf16"))
    assert json.loads(layer_overrides_json("tp4-rank", 16)) == layer_overrides("tp4-rank", 16)
    # overriding the layer count alone leaves 60-entry plans: the parser refuses (why the lists are needed)
    bare = ModelConfig(model=path, load_format="dummy", hf_overrides='{"text_config": {"num_hidden_layers": 16}}')
    with pytest.raises(ValueError, match="60/60 entries for 16 layers"):
        parse_m3_config(resolve_model_source(bare).hf_config)


def test_proxy_parameter_bytes_equal_the_hand_sum_and_fit_an_h200():
    full = _meta(text_config("tp4-rank"))
    wb = roof.weight_bytes(full)
    assert wb["total"] == hand_param_bytes(60)
    for n in (16, 28):
        model = _meta(cut_layers(text_config("tp4-rank"), n))
        exact = sum(p.numel() * p.element_size() for p in model.parameters())
        assert exact == hand_param_bytes(n) == roof.stored_bytes(wb, n) == roof.weight_bytes(model)["total"]
    assert round(hand_param_bytes(16) / GiB, 2) == 49.99 and round(hand_param_bytes(28) / GiB, 2) == 91.47
    # KV + index-K per token: 512 B on each layer, + 256 B index-K on each MSA layer (bf16)
    specs = full.kv_cache_specs()
    assert roof.kv_bytes_per_token(specs, 28, 2) == 28 * 512 + 25 * 256 == 20736
    budget, tokens = int(0.9 * H200_TOTAL), 8320  # 128 requests x 65 blocks of 128
    kv28 = 128 * tokens * 20736
    assert hand_param_bytes(28) + kv28 + 6 * GiB < budget  # the default L = 28 leaves > 6 GiB of workspace
    assert roof.pick_layers(wb, specs, budget, 128, tokens, 6 * GiB) == 29
    assert hand_param_bytes(30) + 128 * tokens * roof.kv_bytes_per_token(specs, 30, 2) > budget - 6 * GiB


def test_expected_distinct_experts_match_the_design_doc():
    assert [round(roof.expected_distinct(128, 4, b), 1) for b in (1, 32, 128)] == [4.0, 81.7, 125.8]


def test_decode_step_bytes_against_a_hand_count():
    tc = text_config("tiny")  # 1 dense + 3 MSA/MoE layers, kv 2 x 32, index dim 32, block 16, top-4 blocks
    model = MiniMaxM3ForCausalLM(root_config(tc, "bf16"), torch.float32, "meta")
    wb, cfg = roof.weight_bytes(model), model.config
    seq_lens, distinct = [40, 100], [0, 3, 8, 5]
    got = roof.decode_step_bytes(wb, cfg, seq_lens, distinct, kv_elt=4)
    h, e, inter, elt = 128, 8, 64, 4
    expert = 3 * inter * h * elt
    # every stored byte, minus the embedding table (2 rows read) and the routed experts not touched
    weights_and_experts = wb["total"] - (512 * h - 2 * h) * elt - sum(e - d for d in distinct[1:]) * expert
    assert got["weights"] + got["experts"] == weights_and_experts
    assert got["experts"] == (3 + 8 + 5) * expert
    kv_tok = 2 * 2 * 32 * elt
    # dense layer: 40 + 100 tokens; MSA layers: min(ctx, min(4, blocks) x 16) = 40 and 64 tokens
    assert got["kv"] == kv_tok * 140 + 3 * kv_tok * (40 + 64)
    assert got["index_k"] == 3 * 32 * elt * 140
    assert got["total"] == sum(got[k] for k in ("weights", "experts", "kv", "index_k"))


def test_prefill_flops_brute_force_and_design_doc():
    tc = text_config("tiny")
    cfg = parse_m3_config(root_config(tc, "bf16"))
    t_len = 100
    fl = roof.prefill_flops(cfg, t_len)
    keys_sparse = 0
    for t in range(t_len):  # up to 4 blocks visible: all of them; beyond: the local block + 3 full earlier ones
        b = t // 16
        keys_sparse += sum(min(16, t - 16 * j + 1) for j in range(b + 1)) if b < 4 else 3 * 16 + t % 16 + 1
    causal = t_len * (t_len + 1) // 2
    assert fl["attention"] == 4 * 8 * 32 * (causal + 3 * keys_sparse)
    assert fl["indexer"] == 3 * 2 * 2 * 32 * causal
    attn_p = 128 * (8 * 32 + 2 * 2 * 32) + 8 * 32 * 128
    per_tok = attn_p * 4 + 3 * 256 * 128 + 3 * (128 * (2 * 32 + 32) + 8 * 128 + 3 * 3 * 64 * 128)
    assert fl["gemm"] == 2 * t_len * per_tok + 2 * 512 * 128
    # design/kernels_and_limits.md §6.4, one rank, 8K prompt: GEMM ~97.4 TFLOP (last-token logits excluded there),
    # MSA attention 6.7, dense attention 0.8, indexer 0.5 TFLOP
    big = roof.prefill_flops(parse_m3_config(root_config(text_config("tp4-rank"), "bf16")), 8192)
    head = 2 * 200064 * 6144
    assert abs((big["gemm"] - head) / 97.4e12 - 1) < 0.005
    assert abs(big["attention"] / (6.7e12 + 0.825e12) - 1) < 0.01
    assert abs(big["indexer"] / 0.49e12 - 1) < 0.02


def test_vocab_parallel_proxy_holds_a_quarter_of_the_vocabulary(tmp_path):
    """tp4-rank-vp differs from tp4-rank only in the vocabulary: the rank's ceil(200064 / 4) = 50016 rows of the
    embedding and of the LM head (bos/eos inside them), i.e. 2 x 150048 x 6144 bf16 bytes (3.7 GB) fewer, and a
    tokenizer of 50016 ids, so random prompts stay inside the table."""
    from transformers import AutoTokenizer

    from ladle.tools.checkpoint_m3 import VOCAB_PARALLEL_TP4, make_checkpoint

    full, vp = text_config("tp4-rank"), text_config("tp4-rank-vp")
    assert VOCAB_PARALLEL_TP4 == 50016 == -(-full["vocab_size"] // 4)
    assert {k for k in full if full[k] != vp[k]} == {"vocab_size", "bos_token_id", "eos_token_id"}
    assert max(vp["bos_token_id"], vp["eos_token_id"]) < vp["vocab_size"]
    a = sum(p.numel() * p.element_size() for p in _meta(cut_layers(full, 4)).parameters())
    b = sum(p.numel() * p.element_size() for p in _meta(cut_layers(vp, 4)).parameters())
    assert a - b == 2 * (200064 - 50016) * 6144 * 2  # embed + lm_head rows, bf16
    tok = AutoTokenizer.from_pretrained(make_checkpoint(str(tmp_path / "vp"), "tp4-rank-vp", config_only=True))
    assert len(tok) == 50016
