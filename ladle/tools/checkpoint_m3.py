"""`ladle make-checkpoint minimax-m3 --preset tiny|small|tp4-rank|tp4-rank-vp [--dtype bf16|mxfp8|mxfp4] [--config-only]
[--num-layers N] OUT`.

Writes a synthetic MiniMax-M3 checkpoint in the *release* layout (design/minimax_m3.md §1.1, §2, §5): root
`minimax_m3_vl` wrapper config written by hand in the release form (freq lists, `sparse_attention_config`, flat
rope keys; a tiny `vision_config` so transformers does not build the 0.6B default ViT; bos/eos inside the vocab),
`language_model.`-prefixed tensors with per-expert w1/w3/w2 and a float32 router, sharded safetensors + index,
generation_config.json, and a tokenizer covering `vocab_size` with the M3 chat template.

Weights are streamed shard by shard (never the whole model in memory), each tensor drawn from a generator seeded by
(seed, name) so the result does not depend on shard size. Draws exercise every path: norm offsets ~N(0, 0.1),
correction bias ~N(0, 0.5), and the first rows of every gate/up projection scaled so |pre-activation| exceeds the
swiglu clamp (7.0) on both sides.

Fewer layers (the one-GPU TP4-rank proxy, issue 6): a preset's layer plan is three lists (`moe_layer_freq`,
`sparse_attention_config.sparse_attention_freq` and `.sparse_disable_index_value`) that must be as long as
`num_hidden_layers` (the parser refuses a mismatch), so overriding `num_hidden_layers` alone does not work. Two ways:
* `--num-layers N` writes a config that keeps the preset's first N layers (lists cut to N);
* or keep the full config and load it with `--hf-overrides "$(python -c 'from ladle.tools.checkpoint_m3 import
  layer_overrides_json; print(layer_overrides_json("tp4-rank", 28))')"`, i.e. for tp4-rank and N = 28 exactly
  (3 dense + 25 sparse/MoE layers; `1,` repeated 25 times in each list):
  `{"text_config": {"num_hidden_layers": 28, "moe_layer_freq": [0,0,0,1,...,1], "sparse_attention_config":
  {"sparse_attention_freq": [0,0,0,1,...,1], "sparse_disable_index_value": [0,0,0,1,...,1]}}}`
  (the loader merges nested dicts key by key, so the other `sparse_attention_config` keys stay).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import zlib
from typing import Iterator

import torch
from safetensors.torch import save_file

from ladle.kernels.fp8_quant import quantize_mxfp4, quantize_mxfp8
from ladle.tools.minimax_m3_tokenizer import write_tokenizer

SHARD_BYTES = {"tiny": 300_000, "small": 200 << 20, "tp4-rank": 4 << 30, "tp4-rank-vp": 4 << 30}
PRESET_USE = {"tiny": "CPU tests", "small": "quick GPU runs",
              "tp4-rank": "one tensor-parallel rank of the released model, TP4; the one-GPU proxy",
              "tp4-rank-vp": "tp4-rank with the rank's vocab-parallel quarter of the embedding and LM head "
                             "(50016 rows): a TP4 rank's memory"}
# tp4-rank-vp: a TP4 rank of vLLM / ladle holds ceil(200064 / 4) = 50016 rows of the embedding and of the LM head
# (VocabParallelEmbedding, ParallelLMHead; design/minimax_m3.md §5.2 "vocab 200064 (or 50016 if vocab-parallel)"), not
# the full 200064 x 6144 bf16 pair (4.9 GB): the one-GPU proxy of tp4-rank carries 3.7 GB (3.4 GiB) more weights than
# the rank it stands for, which its KV pool loses, and an LM head 4x as large per decode step. Its tokenizer covers
# 50016 ids (random prompts stay inside the table); the logits all-gather of the real rank is communication, left
# out like the all-reduces.
VOCAB_PARALLEL_TP4 = -(-200064 // 4)


def _sparse_cfg(n: int, n_dense: int, heads: int, dim: int, block: int, topk: int) -> dict:
    freq = [0] * n_dense + [1] * (n - n_dense)
    return {"use_sparse_attention": True, "sparse_num_index_heads": heads, "sparse_index_dim": dim,
            "sparse_block_size": block, "sparse_topk_blocks": topk, "sparse_local_block": 1,
            "sparse_init_block": 0, "sparse_score_type": "max", "sparse_attention_freq": freq,
            "sparse_disable_index_value": freq}


def text_config(preset: str) -> dict:
    """The release-form `text_config` of a preset (spec §5.1 tiny, §5.2 one TP4 rank, `tp4-rank-vp` the same with the
    rank's vocab-parallel 50016 rows; `small` for quick GPU runs)."""
    p = {
        # hidden, layers, dense layers, heads, kv, head_dim, dense_inter, inter, experts, top-k, vocab, block, topk
        "tiny": (128, 4, 1, 8, 2, 32, 256, 64, 8, 2, 512, 16, 4),
        "small": (1024, 6, 2, 8, 2, 128, 2048, 512, 16, 4, 32000, 128, 16),
        "tp4-rank": (6144, 60, 3, 16, 1, 128, 3072, 768, 128, 4, 200064, 128, 16),
        "tp4-rank-vp": (6144, 60, 3, 16, 1, 128, 3072, 768, 128, 4, VOCAB_PARALLEL_TP4, 128, 16),
    }[preset]
    hidden, n, n_dense, nh, nkv, hd, dense_i, inter, ne, k, vocab, block, topk = p
    bos, eos = (200034, 200020) if vocab > 200060 else (1, 2)
    return {
        "architectures": ["MiniMaxM3SparseForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": n, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
        "max_position_embeddings": 4096 if preset == "tiny" else 1048576, "rms_norm_eps": 1e-6,
        "use_gemma_norm": True, "attention_output_gate": False, "rope_theta": 5000000,
        "rotary_dim": hd // 2, "partial_rotary_factor": 0.5, "hidden_act": "swigluoai", "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "use_qk_norm": True, "qk_norm_type": "per_head", "tie_word_embeddings": False,
        "dense_intermediate_size": dense_i, "intermediate_size": inter, "shared_intermediate_size": inter,
        "num_local_experts": ne, "num_experts_per_tok": k, "n_shared_experts": 1, "scoring_func": "sigmoid",
        "use_routing_bias": True, "routed_scaling_factor": 2.0, "moe_layer_freq": [0] * n_dense + [1] * (n - n_dense),
        "num_mtp_modules": 0, "sparse_attention_config": _sparse_cfg(n, n_dense, nkv, hd, block, topk),
        "bos_token_id": bos, "eos_token_id": eos,
    }


def preset_summary() -> list[str]:
    """One line per preset (name, layers, hidden size, experts, what it is for), for the commands' --help."""
    lines = []
    for name, use in PRESET_USE.items():
        tc = text_config(name)
        lines.append(f"{name}: {tc['num_hidden_layers']} layers, hidden {tc['hidden_size']}, "
                     f"{tc['num_local_experts']} experts ({use})")
    return lines


def _plan_overrides(tc: dict, num_layers: int) -> dict:
    """The text-config keys that change when only the first `num_layers` layers of `tc` are kept."""
    n = int(tc["num_hidden_layers"])
    if not 1 <= num_layers <= n:
        raise ValueError(f"num_layers must be in [1, {n}], got {num_layers}")
    sc = tc["sparse_attention_config"]
    return {"num_hidden_layers": num_layers, "moe_layer_freq": list(tc["moe_layer_freq"][:num_layers]),
            "sparse_attention_config": {k: list(sc[k][:num_layers])
                                        for k in ("sparse_attention_freq", "sparse_disable_index_value")}}


def cut_layers(tc: dict, num_layers: int) -> dict:
    """A copy of text config `tc` keeping its first `num_layers` layers (layer-plan lists cut to match).
    Raises ValueError when num_layers is not in [1, num_hidden_layers]."""
    o = _plan_overrides(tc, num_layers)
    return {**tc, **o, "sparse_attention_config": {**tc["sparse_attention_config"], **o["sparse_attention_config"]}}


def layer_overrides(preset_or_tc: "str | dict", num_layers: int) -> dict:
    """`--hf-overrides` dict that keeps the first `num_layers` layers of a root config whose `text_config` is
    the preset's (or the given text config dict): {"text_config": {num_hidden_layers, the three plan lists}}."""
    tc = text_config(preset_or_tc) if isinstance(preset_or_tc, str) else preset_or_tc
    return {"text_config": _plan_overrides(tc, num_layers)}


def layer_overrides_json(preset_or_tc: "str | dict", num_layers: int) -> str:
    """`layer_overrides` as the compact JSON string to pass to `--hf-overrides`."""
    return json.dumps(layer_overrides(preset_or_tc, num_layers), separators=(",", ":"))


def root_config(tc: dict, dtype: str) -> dict:
    """Wrapper config in the release form, with a tiny vision tower (minimax_m3_vs_transformers.md B11/B12)."""
    cfg = {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
        "text_config": tc,
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "patch_size": 14, "temporal_patch_size": 2,
                          "spatial_merge_size": 2},
        "projector_hidden_size": tc["hidden_size"], "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True, "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
        "image_token_index": 5 if tc["vocab_size"] < 200060 else 200025,
        "video_token_index": 6 if tc["vocab_size"] < 200060 else 200026,
        "bos_token_id": tc["bos_token_id"], "eos_token_id": tc["eos_token_id"], "torch_dtype": "bfloat16",
    }
    if dtype == "mxfp4":
        cfg["quantization_config"] = {"quant_method": "mxfp4", "weight_block_size": [1, 32],
                                      "quantized_modules": "block_sparse_moe experts and shared_experts"}
    if dtype == "mxfp8":
        gates = [f"language_model.model.layers.{i}.block_sparse_moe.gate"
                 for i, f in enumerate(tc["moe_layer_freq"]) if f]
        cfg["quantization_config"] = {
            "quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
            "ignored_layers": ["lm_head", "model.embed_tokens", "vision_tower", "multi_modal_projector",
                               "patch_merge_mlp"] + gates}
    return cfg


def tensor_specs(tc: dict) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(release name, shape, kind) in file order; kind in embed|head|norm|proj|gate_up|down|router|bias."""
    h, hd, nh, nkv = tc["hidden_size"], tc["head_dim"], tc["num_attention_heads"], tc["num_key_value_heads"]
    sc = tc["sparse_attention_config"]
    yield "language_model.model.embed_tokens.weight", (tc["vocab_size"], h), "embed"
    for i in range(tc["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), "norm"
        yield p + "post_attention_layernorm.weight", (h,), "norm"
        for n, shape in (("q_proj", (nh * hd, h)), ("k_proj", (nkv * hd, h)), ("v_proj", (nkv * hd, h)),
                         ("o_proj", (h, nh * hd))):
            yield p + f"self_attn.{n}.weight", shape, "proj"
        yield p + "self_attn.q_norm.weight", (hd,), "norm"
        yield p + "self_attn.k_norm.weight", (hd,), "norm"
        if sc["sparse_attention_freq"][i]:
            ni, di = sc["sparse_num_index_heads"], sc["sparse_index_dim"]
            yield p + "self_attn.index_q_proj.weight", (ni * di, h), "proj"
            yield p + "self_attn.index_k_proj.weight", (di, h), "proj"
            yield p + "self_attn.index_q_norm.weight", (di,), "norm"
            yield p + "self_attn.index_k_norm.weight", (di,), "norm"
        if not tc["moe_layer_freq"][i]:
            di_ = tc["dense_intermediate_size"]
            yield p + "mlp.gate_proj.weight", (di_, h), "gate_up"
            yield p + "mlp.up_proj.weight", (di_, h), "gate_up"
            yield p + "mlp.down_proj.weight", (h, di_), "down"
            continue
        m, inter = p + "block_sparse_moe.", tc["intermediate_size"]
        yield m + "gate.weight", (tc["num_local_experts"], h), "router"
        yield m + "e_score_correction_bias", (tc["num_local_experts"],), "bias"
        for e in range(tc["num_local_experts"]):
            yield m + f"experts.{e}.w1.weight", (inter, h), "gate_up"
            yield m + f"experts.{e}.w3.weight", (inter, h), "gate_up"
            yield m + f"experts.{e}.w2.weight", (h, inter), "down"
        si = tc["shared_intermediate_size"]
        yield m + "shared_experts.gate_proj.weight", (si, h), "gate_up"
        yield m + "shared_experts.up_proj.weight", (si, h), "gate_up"
        yield m + "shared_experts.down_proj.weight", (h, si), "down"
    yield "language_model.model.norm.weight", (h,), "norm"
    yield "language_model.lm_head.weight", (tc["vocab_size"], h), "head"


def draw(name: str, shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    """Deterministic float32 draw for one tensor (see module doc for the distributions)."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & 0x7FFFFFFF)
    x = torch.randn(shape, generator=g)
    if kind == "norm":
        return x * 0.1
    if kind == "bias":
        return x * 0.5
    if kind == "embed":
        return x
    x = x / math.sqrt(shape[-1])
    if kind == "gate_up":
        x[:2] *= 12.0  # |x·w| ~ 12 per unit-RMS input: both swiglu clamps are hit
    elif kind == "down":
        x *= 0.5
    return x


def _tensors(tc: dict, dtype: str, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape, kind in tensor_specs(tc):
        x = draw(name, shape, kind, seed)
        if kind in ("router", "bias"):
            yield name, x.float()  # fp32 on disk (spec §2.1)
        elif dtype == "mxfp8" and kind in ("proj", "gate_up", "down"):
            q, s = quantize_mxfp8(x)
            yield name, q
            yield name + "_scale_inv", s
        elif dtype == "mxfp4" and ".block_sparse_moe." in name and kind in ("gate_up", "down"):
            packed, s = quantize_mxfp4(x)  # routed and shared experts (ladle/quant/mxfp4.py)
            yield name, packed
            yield name[: -len(".weight")] + ".weight_scale", s
        else:
            yield name, x.to(torch.bfloat16)


def write_weights(out: str, tc: dict, dtype: str, seed: int, shard_bytes: int) -> int:
    """Stream tensors into shards of at most `shard_bytes` (one tensor may exceed it). Returns the shard count."""
    weight_map: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    size, count, total = 0, 0, 0

    def flush() -> None:
        nonlocal shard, size, count
        if shard:
            count += 1
            save_file(shard, os.path.join(out, f"shard-{count}.tmp"), metadata={"format": "pt"})
            for n in shard:
                weight_map[n] = count
            shard, size = {}, 0

    for name, t in _tensors(tc, dtype, seed):
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        shard[name], size, total = t, size + nbytes, total + nbytes
    flush()
    names = {i: f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)}
    for i, fname in names.items():
        os.replace(os.path.join(out, f"shard-{i}.tmp"), os.path.join(out, fname))
    index = {"metadata": {"total_size": total}, "weight_map": {n: names[i] for n, i in sorted(weight_map.items())}}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return count


def make_checkpoint(out: str, preset: str = "tiny", dtype: str = "bf16", config_only: bool = False,
                    seed: int = 0, shard_bytes: int | None = None, num_layers: int | None = None) -> str:
    """Write the checkpoint directory `out` (created if needed); `num_layers` keeps the preset's first N layers
    (see the module doc). Returns `out`."""
    tc = text_config(preset)
    if num_layers is not None:
        tc = cut_layers(tc, num_layers)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(root_config(tc, dtype), f, indent=1)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tc["bos_token_id"], "eos_token_id": tc["eos_token_id"]}, f, indent=1)
    write_tokenizer(out, tc["vocab_size"], tc["bos_token_id"], tc["eos_token_id"], tc["max_position_embeddings"])
    if not config_only:
        write_weights(out, tc, dtype, seed, shard_bytes or SHARD_BYTES[preset])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ladle make-checkpoint minimax-m3",
                                 description="write a synthetic MiniMax-M3 checkpoint in the release layout",
                                 epilog="presets: " + "; ".join(preset_summary()))
    ap.add_argument("--preset", choices=sorted(SHARD_BYTES), default="tiny", help="model shapes (below; default: tiny)")
    ap.add_argument("--dtype", choices=["bf16", "mxfp8", "mxfp4"], default="bf16")
    ap.add_argument("--config-only", action="store_true", help="config + tokenizer only (for --load-format dummy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=None,
                    help="keep only the preset's first N layers (e.g. 28 for the one-GPU tp4-rank proxy in bf16)")
    ap.add_argument("out", help="output directory")
    args = ap.parse_args(argv)
    try:
        make_checkpoint(args.out, args.preset, args.dtype, args.config_only, args.seed, num_layers=args.num_layers)
    except ValueError as exc:
        ap.error(str(exc))
    layers = f", {args.num_layers} layers" if args.num_layers else ""
    print(f"wrote MiniMax-M3 {args.preset} ({args.dtype}{layers}{', config only' if args.config_only else ''}) "
          f"to {args.out}")
    return 0
