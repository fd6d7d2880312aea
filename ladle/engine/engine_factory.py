"""Build a ready EngineCore from an EngineConfig: source -> resolved config -> tokenizer -> model -> runner ->
scheduler. Shared by `LLM` (offline) and `AsyncEngine.from_config` (server)."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ladle.config import COMPONENTS, EngineConfig
from ladle.core.scheduler import Scheduler
from ladle.engine.config_resolve import resolve_engine_config, torch_dtype
from ladle.engine.engine_core import EngineCore
from ladle.engine.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineBundle:
    """What a front end needs: the core, the tokenizer, the resolved config, names and EOS ids."""

    core: EngineCore
    tokenizer: Any
    engine_config: EngineConfig
    model_name: str
    eos_token_ids: tuple[int, ...]

    @property
    def max_model_len(self) -> int:
        return int(self.engine_config.model.max_model_len)


def engine_config_from_kwargs(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """EngineConfig from flat keyword arguments named like the component fields (e.g. `block_size=16`,
    `max_num_batched_tokens=64`, `kv_cache_memory_bytes=...`). Raises TypeError for an unknown name."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in COMPONENTS}
    kwargs["model"] = model
    for key, value in kwargs.items():
        owner = [name for name, cls in COMPONENTS.items() if key in {f.name for f in dataclasses.fields(cls)}]
        if not owner:
            raise TypeError(f"unknown engine argument {key!r}")
        parts[owner[0]][key] = value
    return EngineConfig(**{name: COMPONENTS[name](**values) for name, values in parts.items()})


def _model_name(config: EngineConfig, source: Any) -> str:
    if config.model.served_model_name:
        return config.model.served_model_name
    if config.model.model:
        return config.model.model
    return getattr(source, "gguf_file", None) or str(getattr(source, "path", "ladle"))


def build_engine(config: EngineConfig, tokenizer: Any = None) -> EngineBundle:
    """Load everything. `tokenizer`: an already loaded tokenizer for this model (skips loading one).
    Raises ConfigError / KVCacheTooSmall / loader errors with user-facing messages."""
    from ladle.models.loader import load_model, resolve_model_source
    from ladle.models.registry import resolve_model_class
    from ladle.runner.model_runner import ModelRunner

    t0 = time.monotonic()
    source = resolve_model_source(config.model)
    model_cls = resolve_model_class(source.architectures)
    resolved = resolve_engine_config(config, source.hf_config, model_cls)
    mc = resolved.model
    if tokenizer is None:
        tokenizer = load_tokenizer(source.tokenizer_path, source.tokenizer_gguf_file)
    eos = eos_token_ids(tokenizer, source.generation_config)
    model = load_model(mc, source, torch_dtype(mc.dtype), torch.device(mc.device))
    runner = ModelRunner(mc, resolved.cache, resolved.scheduler, resolved.runner, model, eos)
    scheduler = Scheduler(resolved.scheduler, block_size=resolved.cache.block_size, num_blocks=runner.num_blocks,
                          max_model_len=mc.max_model_len, enable_prefix_caching=resolved.cache.enable_prefix_caching)
    core = EngineCore(scheduler, runner, max_model_len=mc.max_model_len, eos_token_ids=eos)
    logger.info("engine ready in %.1f s: %s on %s (%s), max_model_len %d, block %d, %d KV blocks",
                time.monotonic() - t0, _model_name(resolved, source), mc.device, mc.dtype, mc.max_model_len,
                resolved.cache.block_size, runner.num_blocks)
    return EngineBundle(core, tokenizer, resolved, _model_name(resolved, source), eos)
