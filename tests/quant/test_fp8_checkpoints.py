"""Whole-model FP8 loading through `load_model`: an HF block-FP8 Llama checkpoint (`quantization_config.quant_method
"fp8"`, `weight_block_size [128, 128]`, `weight_scale_inv`), and `--quantization fp8` with `--load-format dummy`
(Llama and MiniMax-M3).

Budget for the FP8 forward against float32 on the same (dequantized) weights: 2 layers, activations rounded to e4m3
per 128-group before each GEMM (~2-3% per GEMM, tests/quant/test_fp8_kernels.py): per-position logit cosine >= 0.99
(observed ~0.999); a wrong scale row or block drops it below 0.9.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from drivers.paged_test_cache import PagedTestCache
from ladle.config import ModelConfig
from ladle.kernels.fp8_quant import dequant_block_fp8, quantize_block_fp8
from ladle.models.llama import LlamaForCausalLM
from ladle.models.loader import load_model, resolve_model_source
from ladle.tools.checkpoint_m3 import make_checkpoint

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 192, "intermediate_size": 320,
         "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64,
         "vocab_size": 300, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "torch_dtype": "float32"}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _hf_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """HF names of a (float) ladle Llama: merged projections split back into q/k/v and gate/up."""
    sd, out = model.state_dict(), {}
    h, d = LLAMA["hidden_size"], LLAMA["head_dim"]
    for i in range(LLAMA["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k, v = sd[p + "self_attn.qkv_proj.weight"].split([3 * d, d, d])
        gate, up = sd[p + "mlp.gate_up_proj.weight"].chunk(2)
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": sd[p + "self_attn.o_proj.weight"],
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": sd[p + "mlp.down_proj.weight"]})
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = sd[p + n + ".weight"]
    for n in ("model.embed_tokens.weight", "model.norm.weight"):
        out[n] = sd[n]
    out["lm_head.weight"] = sd["lm_head.weight"]
    assert h == 192
    return {k: v.contiguous() for k, v in out.items()}


def _logits(model, ids):
    cache = PagedTestCache(model.kv_cache_specs(), num_blocks=8, block_size=16)
    with torch.no_grad():
        return model.compute_logits(cache.run(model, [("a", ids)]))


def test_hf_block_fp8_llama_checkpoint(tmp_path):
    src = LlamaForCausalLM(LLAMA, torch.float32)
    src.init_dummy_weights(3)
    fp8_state, deq_state = {}, {}
    for name, t in _hf_state(src).items():
        if name.rsplit(".", 2)[-2] in PROJ:
            q, s = quantize_block_fp8(t)
            fp8_state[name], fp8_state[name + "_scale_inv"] = q, s
            deq_state[name] = dequant_block_fp8(q, s)
        else:
            fp8_state[name] = deq_state[name] = t
    d = tmp_path / "fp8"
    os.makedirs(d)
    cfg = dict(LLAMA, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]})
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(fp8_state, str(d / "model.safetensors"))
    mc = ModelConfig(model=str(d))
    ours = load_model(mc, resolve_model_source(mc), torch.float32, torch.device("cpu"))
    qkv = ours.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    want = torch.cat([deq_state[f"model.layers.1.self_attn.{n}.weight"] for n in PROJ[:3]])
    assert torch.equal(dequant_block_fp8(qkv.weight, qkv.weight_scale_inv), want)  # exact re-lay
    ref = LlamaForCausalLM(LLAMA, torch.float32)
    ref.load_weights(deq_state.items())
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    cos = torch.nn.functional.cosine_similarity(_logits(ours, ids), _logits(ref, ids), dim=-1)
    assert cos.min().item() >= 0.99, cos.min().item()


def test_dummy_weights_quantized_at_load(tmp_path):
    d = tmp_path / "llama"
    os.makedirs(d)
    (d / "config.json").write_text(json.dumps(LLAMA))
    m3 = make_checkpoint(str(tmp_path / "m3"), "tiny", config_only=True)
    for path in (str(d), m3):
        mc = ModelConfig(model=path, load_format="dummy", quantization="fp8")
        model = load_model(mc, resolve_model_source(mc), torch.float32, torch.device("cpu"))
        fp8 = [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
        assert fp8 and all(getattr(model.get_parameter(n + "_scale_inv"), "dtype", None) == torch.float32
                           for n in fp8)
        scales = [model.get_parameter(n + "_scale_inv") for n in fp8]
        assert all(bool((s > 0).all()) for s in scales)  # every block got a scale
        ids = list(range(3, 40))
        logits = _logits(model, ids) if path == str(d) else None
        assert logits is None or bool(torch.isfinite(logits).all())
