"""Resolve an EngineConfig against the model: device, dtype, max_model_len, block size and the runner's backend
choices (--attention-backend, --moe-backend, --fused-norms, --cuda-graph-sizes; ladle/runner/op_backends.py)
become concrete.

`resolve_engine_config(config, source, model_cls)` returns a new EngineConfig (dataclasses.replace; the
input is never mutated). User errors raise `ConfigError` (a ValueError) with a message that says why.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ladle.config import GiB, EngineConfig
from ladle.models.hf_config import text_config_of
from ladle.runner.op_backends import resolve_runner_config

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_KV_BYTES = 2 * GiB
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


class ConfigError(ValueError):
    """An engine setting that cannot work with this model or machine."""


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"unsupported --device {device!r} (use auto, cpu or cuda)")
    return device


def resolve_dtype(dtype: str, device: str, hf_config: dict) -> str:
    """auto = float32 on CPU; on CUDA the config's dtype, except float32 configs run in bfloat16 (vLLM's
    choice too: float32 weights would waste half the memory bandwidth)."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ConfigError(f"unsupported --dtype {dtype!r} (use auto, float32, bfloat16, float16)")
        return "float16" if dtype == "half" else ("float32" if dtype == "float" else dtype)
    if device == "cpu":
        return "float32"
    cfg = text_config_of(hf_config)
    declared = cfg.get("torch_dtype") or cfg.get("dtype") or hf_config.get("torch_dtype") or hf_config.get("dtype")
    declared = str(declared).replace("torch.", "")
    if declared in ("float16", "bfloat16"):
        return declared
    return "bfloat16"


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def resolve_max_model_len(requested: Optional[int], hf_config: dict) -> int:
    """Default: the model's max_position_embeddings. A larger explicit value is refused."""
    limit = text_config_of(hf_config).get("max_position_embeddings")
    if requested is None:
        if limit is None:
            raise ConfigError("the model config has no max_position_embeddings; pass --max-model-len")
        return int(limit)
    if requested < 1:
        raise ConfigError(f"--max-model-len must be positive, got {requested}")
    if limit is not None and requested > int(limit):
        raise ConfigError(
            f"--max-model-len {requested} is larger than the model's maximum context length "
            f"(max_position_embeddings = {limit}); use at most {limit}")
    return int(requested)


def resolve_block_size(requested: int, hf_config: dict, model_cls: Any) -> int:
    """0 = auto: the model's required block size (e.g. MiniMax-M3's MSA index block) or 16. An explicit
    value that disagrees with the model's required size is refused with the reason."""
    required = None
    if model_cls is not None and hasattr(model_cls, "required_block_size"):
        required = model_cls.required_block_size(text_config_of(hf_config))
    if requested == 0:
        return int(required) if required else DEFAULT_BLOCK_SIZE
    if requested < 1:
        raise ConfigError(f"--block-size must be positive (or 0 for auto), got {requested}")
    if required and requested != required:
        raise ConfigError(
            f"--block-size {requested} does not match this model: its attention selects KV in blocks of "
            f"{required} tokens (the model's index block size), so the KV cache block size must be {required}. "
            f"Omit --block-size or pass --block-size {required}.")
    return int(requested)


def resolve_engine_config(config: EngineConfig, hf_config: dict, model_cls: Any = None) -> EngineConfig:
    """A fully resolved copy of `config` for this model (see module docstring)."""
    device = resolve_device(config.model.device)
    model = dataclasses.replace(
        config.model,
        device=device,
        dtype=resolve_dtype(config.model.dtype, device, hf_config),
        max_model_len=resolve_max_model_len(config.model.max_model_len, hf_config),
    )
    kv_bytes = config.cache.kv_cache_memory_bytes
    if kv_bytes is None and device == "cpu":
        kv_bytes = DEFAULT_CPU_KV_BYTES
    cache = dataclasses.replace(
        config.cache,
        block_size=resolve_block_size(config.cache.block_size, hf_config, model_cls),
        kv_cache_memory_bytes=kv_bytes,
    )
    if config.scheduler.max_num_batched_tokens < 1 or config.scheduler.max_num_seqs < 1:
        raise ConfigError("--max-num-batched-tokens and --max-num-seqs must be positive")
    try:
        runner = resolve_runner_config(config.runner, torch.device(device).type, config.scheduler.max_num_seqs)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return dataclasses.replace(config, model=model, cache=cache, runner=runner)
