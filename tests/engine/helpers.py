"""Small engines for tests: a tiny random Llama (no file needed) or the real SmolLM2 GGUF."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ladle.config import CacheConfig, EngineConfig, ModelConfig, RunnerConfig, SchedulerConfig
from ladle.core.scheduler import Scheduler
from ladle.engine.engine_core import EngineCore
from ladle.engine.engine_factory import EngineBundle
from ladle.runner.model_runner import ModelRunner
from ladle.runner.op_backends import resolve_runner_config

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def smollm2_gguf() -> str:
    from ladle.models.loader import default_model_path

    return default_model_path()


def tiny_model(seed: int = 0, hf_config: Optional[dict] = None) -> torch.nn.Module:
    from ladle.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config or TINY_LLAMA, torch.float32, "cpu")
    model.init_dummy_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peaky logits, so greedy choices are far from ties
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.35)
    return model.eval()


def make_bundle(model: torch.nn.Module, *, tokenizer: Any = None, max_model_len: int = 256, block_size: int = 16,
                num_blocks: int = 64, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                enable_prefix_caching: bool = True, eos_token_ids: tuple = (), seed: int = 0,
                runner: Optional[RunnerConfig] = None, kv_cache_dtype: str = "auto",
                async_scheduling: bool = False) -> EngineBundle:
    """An EngineBundle around an already built model (skips source resolution and loading). `runner` (default:
    --enforce-eager) is resolved for the CPU here. kv_cache_dtype: a resolved --kv-cache-dtype value; the pool
    holds `num_blocks` blocks of that dtype. async_scheduling: --async-scheduling."""
    from ladle.runner.kv_cache import kv_cache_torch_dtype

    specs = model.kv_cache_specs()
    elem = torch.empty((), dtype=kv_cache_torch_dtype(kv_cache_dtype, torch.float32)).element_size()
    per_block = block_size * sum(s.bytes_per_token(elem) for s in specs)
    config = EngineConfig(
        model=ModelConfig(device="cpu", dtype="float32", max_model_len=max_model_len, seed=seed),
        cache=CacheConfig(block_size=block_size, kv_cache_memory_bytes=per_block * num_blocks,
                          enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  async_scheduling=async_scheduling),
        runner=resolve_runner_config(runner or RunnerConfig(enforce_eager=True), "cpu", max_num_seqs),
    )
    model_runner = ModelRunner(config.model, config.cache, config.scheduler, config.runner, model, eos_token_ids,
                               record_step_events=async_scheduling)  # as build_engine asks
    scheduler = Scheduler(config.scheduler, block_size=block_size, num_blocks=model_runner.num_blocks,
                          max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching)
    core = EngineCore(scheduler, model_runner, max_model_len=max_model_len, eos_token_ids=eos_token_ids)
    return EngineBundle(core, tokenizer, config, "test-model", tuple(eos_token_ids))


def replace_cache(bundle: EngineBundle, **kw) -> EngineConfig:
    return dataclasses.replace(bundle.engine_config, cache=dataclasses.replace(bundle.engine_config.cache, **kw))


def smollm2_bundle(tokenizer: Any = None, **kw) -> EngineBundle:
    """The real SmolLM2 GGUF through ladle's own loading path (build_engine)."""
    from ladle.engine.engine_factory import build_engine, engine_config_from_kwargs

    kw.setdefault("kv_cache_memory_bytes", 96 << 20)
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("device", "cpu")
    return build_engine(engine_config_from_kwargs(smollm2_gguf(), **kw), tokenizer)


def hf_twin(model: torch.nn.Module, hf_config: Optional[dict] = None) -> Any:
    """transformers' LlamaForCausalLM with the same weights as a ladle tiny Llama (independent reference).
    ladle merges q/k/v into qkv_proj and gate/up into gate_up_proj; they are split back here."""
    from transformers import LlamaConfig, LlamaForCausalLM as HFLlama

    cfg = dict(hf_config or TINY_LLAMA)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["hidden_size"] // heads
    hf = HFLlama(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})).eval()
    state = {}
    for name, tensor in model.state_dict().items():
        if "qkv_proj" in name:
            parts = tensor.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
            state.update({name.replace("qkv_proj", n): t for n, t in zip(("q_proj", "k_proj", "v_proj"), parts)})
        elif "gate_up_proj" in name:
            gate, up = tensor.chunk(2)
            state.update({name.replace("gate_up_proj", "gate_proj"): gate, name.replace("gate_up_proj", "up_proj"): up})
        else:
            state[name] = tensor
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf


def hf_greedy(hf: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


# a tiny M3 checkpoint (config only, dummy weights) served by LLM: small KV pool, short context
M3_ENGINE = dict(load_format="dummy", max_model_len=128, kv_cache_memory_bytes=4 << 20)


def m3_llm(m3_dir: str, **kw):
    """A maker of LLM(m3_dir) with M3_ENGINE (+ kw), taking async_scheduling (True / False)."""
    from ladle.engine.llm import LLM

    return lambda async_scheduling: LLM(m3_dir, async_scheduling=async_scheduling, **{**M3_ENGINE, **kw})
