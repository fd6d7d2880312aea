"""`--quantization` is checked against the checkpoint's config.json before anything loads (one message with every
other refusal), and the resolved config that /version serves names the weight format in effect after the load."""

from __future__ import annotations

import pytest
import torch

from ladle.config import CacheConfig, EngineConfig, ModelConfig
from ladle.engine.config_resolve import ConfigError, config_refusals, resolve_engine_config
from ladle.engine.engine_factory import build_engine, engine_config_from_kwargs, preflight_refusals
from ladle.models.minimax_m3 import MiniMaxM3ForCausalLM
from ladle.quant.config import quantization_in_effect
from ladle.server.api import _config_dict
from ladle.tools.checkpoint_m3 import make_checkpoint

HF_FP8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
MXFP8 = {"quantization_config": {"quant_method": "mxfp8", "weight_block_size": [1, 32]}}
MXFP4 = {"quantization_config": {"quant_method": "mxfp4", "weight_block_size": [1, 32]}}
AWQ = {"quantization_config": {"quant_method": "awq", "bits": 4}}


def _config(quantization=None, **cache) -> EngineConfig:
    return EngineConfig(model=ModelConfig(device="cpu", quantization=quantization), cache=CacheConfig(**cache))


def _refusals(quantization, hf_config):
    return [r for r in config_refusals(_config(quantization), dict(hf_config, max_position_embeddings=64))
            if "quantization" in r or "quant_method" in r]


def test_accepted_values():
    for flag, hf in ((None, {}), ("fp8", {}), ("fp8", HF_FP8), ("fp8", MXFP8), ("fp8", MXFP4), ("mxfp8", MXFP8),
                     ("mxfp4", MXFP4), ("fp8", {"text_config": MXFP8})):
        assert _refusals(flag, hf) == [], (flag, hf)


def test_unknown_value_refused_without_the_model():
    (msg,) = [r for r in config_refusals(_config("awq")) if "--quantization" in r]
    assert msg.startswith("--quantization awq: not a quantization ladle offers") and "ladle offers fp8" in msg
    assert "leave --quantization out (the checkpoint's own format)" in msg
    assert config_refusals(_config("fp8")) == [] and config_refusals(_config("mxfp4")) == []  # checked with the model


def test_mismatched_values_refused_against_the_checkpoint():
    (msg,) = _refusals("mxfp4", {})
    assert msg.startswith("--quantization mxfp4: a checkpoint format ladle reads but does not quantize to")
    assert "this checkpoint is not quantized" in msg and "ladle offers fp8" in msg
    (msg,) = _refusals("mxfp8", MXFP4)
    assert "this checkpoint is mxfp4" in msg
    (msg,) = _refusals("fp8", AWQ)
    assert msg == ("checkpoint quant_method 'awq' is not a format ladle reads (it reads fp8, mxfp8, mxfp4); "
                   "--quantization fp8 cannot re-quantize an already quantized checkpoint")
    (msg,) = _refusals(None, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [1, 128]}})
    assert "[128, 128] block scales only" in msg


def test_mxfp4_activation_dtype_key():
    w4a8 = {"quantization_config": dict(MXFP4["quantization_config"], activation_dtype="fp8")}
    assert _refusals(None, w4a8) == [] and _refusals("fp8", w4a8) == []
    (msg,) = _refusals(None, {"quantization_config": dict(MXFP4["quantization_config"], activation_dtype="int8")})
    assert msg.startswith("quantization_config.activation_dtype 'int8': MXFP4 experts take fp8 (W4A8)")
    (msg,) = _refusals(None, {"quantization_config": dict(HF_FP8["quantization_config"], activation_dtype="fp8")})
    assert "chooses the activations of MXFP4 experts" in msg and "'fp8'" in msg


def test_refused_with_every_other_refusal_before_loading(tmp_path):
    path = make_checkpoint(str(tmp_path / "m3"), "tiny", config_only=True)  # no weights: nothing could load
    cfg = EngineConfig(model=ModelConfig(model=path, device="cpu", quantization="int8"),
                       cache=CacheConfig(kv_cache_dtype="nonsense"))
    found = preflight_refusals(cfg)
    assert any(r.startswith("--quantization int8:") for r in found)
    assert any(r.startswith("--kv-cache-dtype nonsense:") for r in found)
    with pytest.raises(ConfigError) as e:
        from ladle.models.loader import resolve_model_source

        resolve_engine_config(cfg, resolve_model_source(cfg.model).hf_config, MiniMaxM3ForCausalLM)
    assert "--quantization int8" in str(e.value) and "--kv-cache-dtype nonsense" in str(e.value)


def test_format_in_effect():
    effect = [quantization_in_effect(ModelConfig(quantization=flag), hf) for flag, hf in
              ((None, {}), ("fp8", {}), (None, HF_FP8), ("fp8", MXFP8), (None, MXFP4), ("fp8", MXFP4))]
    assert effect == [None, "fp8", "fp8", "fp8", "mxfp4", "mxfp4+fp8"]
    w4a8 = {"quantization_config": dict(MXFP4["quantization_config"], activation_dtype="fp8")}
    assert [quantization_in_effect(ModelConfig(quantization=flag), w4a8) for flag in (None, "fp8")] == [
        "mxfp4-w4a8", "mxfp4-w4a8+fp8"]


def test_version_names_the_format_after_loading_an_fp8_checkpoint(tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = make_checkpoint(str(tmp_path / "mx"), "tiny", dtype="mxfp8")
        bundle = build_engine(engine_config_from_kwargs(path, device="cpu", max_model_len=256,
                                                        kv_cache_memory_bytes=8 << 20))
    finally:
        torch.set_num_threads(n)
    assert any(p.dtype == torch.float8_e4m3fn for p in bundle.core.runner.model.parameters())
    served = _config_dict(bundle.engine_config)  # what GET /version returns as "engine_config"
    assert served["model"]["quantization"] == "fp8" and served["model"]["model"] == path
