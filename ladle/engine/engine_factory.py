"""Build a ready EngineCore from an EngineConfig: source -> resolved config -> tokenizer -> model -> runner ->
scheduler. Shared by `LLM` (offline) and `AsyncEngine.from_config` (server).

Each stage logs a line when it starts (an operator sees progress from the first second), and the end is one
summary line: weights bytes, KV capacity in tokens and blocks, the concurrency that fits at max_model_len, dtypes
and the backend in effect per op (`startup_summary`). `preflight_refusals` checks a config without loading any
weights, so a command line can report every refusal at once before it binds a port or loads a model."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ladle.config import COMPONENTS, EngineConfig
from ladle.core.scheduler import Scheduler
from ladle.engine.config_resolve import (ConfigError, config_in_effect, config_refusals, cuda_only_refusals,
                                         kv_cache_dtype_in_effect, resolve_engine_config, resolve_model_path,
                                         torch_dtype)
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
    `max_num_batched_tokens=64`, `kv_cache_memory_bytes=...`). Raises TypeError for an unknown name, ConfigError (a
    ValueError) for a CUDA-only one (`gpu_memory_utilization`, `cuda_graph_sizes`) on a CPU run, as `ladle serve`
    refuses its flag (config_resolve.cuda_only_refusals)."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in COMPONENTS}
    kwargs["model"] = model
    for key, value in kwargs.items():
        owner = [name for name, cls in COMPONENTS.items() if key in {f.name for f in dataclasses.fields(cls)}]
        if not owner:
            raise TypeError(f"unknown engine argument {key!r}")
        parts[owner[0]][key] = value
    config = EngineConfig(**{name: COMPONENTS[name](**values) for name, values in parts.items()})
    if refusals := cuda_only_refusals(kwargs, config.model.device):
        raise ConfigError(*refusals, source="LLM(...) call")
    return config


def _model_name(config: EngineConfig, source: Any) -> str:
    if config.model.served_model_name:
        return config.model.served_model_name
    if config.model.model:
        return config.model.model
    return getattr(source, "gguf_file", None) or str(getattr(source, "path", "ladle"))


def preflight_refusals(config: EngineConfig, with_model: bool = True) -> list[str]:
    """Every refusal of `config` found without loading weights: the model path (a hub id), then the model-free
    checks, and with `with_model` the checks against the model's config.json (reading it is cheap; a source that
    cannot be read is itself a refusal). Empty when the config can be built."""
    from ladle.models.loader import resolve_model_source
    from ladle.models.registry import resolve_model_class

    try:
        path = resolve_model_path(config.model.model)
    except ConfigError as e:
        return e.refusals + config_refusals(config)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=path))
    if not with_model:
        return config_refusals(config)
    try:
        source = resolve_model_source(config.model)
        model_cls = resolve_model_class(source.architectures)
    except (OSError, ValueError) as e:
        return [str(e)] + config_refusals(config)
    return config_refusals(config, source.hf_config, model_cls)


def startup_summary(resolved: EngineConfig, model: Any, num_blocks: int) -> str:
    """One line: weights bytes, KV capacity (tokens, blocks), max concurrency at max_model_len, dtypes, and the
    backend per op (attention, MoE, fused norms, CUDA graph sizes). `model`: the loaded model, or the weight bytes
    of rank 0 (an int) under tensor parallelism."""
    mc, cc, rc = resolved.model, resolved.cache, resolved.runner
    weights = model if isinstance(model, int) else sum(
        t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    tokens = (num_blocks - 1) * cc.block_size  # block 0 is the null block, never handed to a request
    kv_dtype = kv_cache_dtype_in_effect(cc.kv_cache_dtype, mc.dtype)
    graphs = f"{len(rc.cuda_graph_sizes)} sizes up to {max(rc.cuda_graph_sizes)}" if rc.cuda_graph_sizes else "none"
    return (f"startup summary: weights {weights / 2**30:.2f} GiB ({weights} bytes); KV cache {tokens} tokens in "
            f"{num_blocks} blocks of {cc.block_size}; max concurrency {tokens / mc.max_model_len:.2f}x at "
            f"max_model_len {mc.max_model_len}; dtype {mc.dtype}, KV dtype {kv_dtype}; attention "
            f"{rc.attention_backend}, moe {rc.moe_backend}, fused norms {'on' if rc.fused_norms else 'off'}, "
            f"CUDA graphs {graphs}")


def start_executor(resolved: EngineConfig, source: Any, eos: tuple[int, ...]) -> Any:
    """The mp executor (ladle/runner/executor.py): one worker process per rank, each with its shard and runner."""
    from ladle.runner.executor import MultiprocExecutor
    from ladle.runner.worker import WorkerSpec

    par = resolved.parallel
    spec = WorkerSpec(resolved.model, resolved.cache, resolved.scheduler, resolved.runner, source, tuple(eos), 0,
                      par.tensor_parallel_size, expert_parallel=par.enable_expert_parallel)
    return MultiprocExecutor(spec)


def build_engine(config: EngineConfig, tokenizer: Any = None) -> EngineBundle:
    """Load everything. `tokenizer`: an already loaded tokenizer for this model (skips loading one).
    Raises ConfigError / KVCacheTooSmall / loader errors with user-facing messages."""
    from ladle.models.loader import load_model, resolve_model_source
    from ladle.models.registry import resolve_model_class
    from ladle.runner.model_runner import ModelRunner

    t0 = time.monotonic()
    path = resolve_model_path(config.model.model)
    if path != config.model.model:  # a hub id found in the HF cache: the API still names the model by its id
        config = dataclasses.replace(config, model=dataclasses.replace(
            config.model, model=path, served_model_name=config.model.served_model_name or config.model.model))
    where = config.model.model or "the embedded default model (a GGUF)"
    logger.info("reading the model's config from %s%s", where,
                " (a GGUF is converted once, on its first start)" if not config.model.model or
                str(config.model.model).endswith(".gguf") else "")
    source = resolve_model_source(config.model)
    model_cls = resolve_model_class(source.architectures)
    resolved = resolve_engine_config(config, source.hf_config, model_cls)
    mc = resolved.model
    logger.info("config resolved: %s (%s) on %s, dtype %s, max_model_len %d", source.path, model_cls.__name__,
                mc.device, mc.dtype, mc.max_model_len)
    if tokenizer is None:
        logger.info("loading the tokenizer from %s", source.tokenizer_path)
        tokenizer = load_tokenizer(source.tokenizer_path, source.tokenizer_gguf_file)
    eos = eos_token_ids(tokenizer, source.generation_config)
    t1 = time.monotonic()
    sizes = resolved.runner.cuda_graph_sizes
    tp = resolved.parallel.tensor_parallel_size
    if tp > 1:
        logger.info("starting %d tensor-parallel ranks (%s backend): each loads its shard (%s, load format %s), "
                    "allocates its KV cache%s", tp, resolved.parallel.distributed_executor_backend, source.kind,
                    mc.load_format, f" and captures {len(sizes)} CUDA graphs" if sizes else "")
        runner = start_executor(resolved, source, eos)
        model = runner.ranks[0].weight_bytes
    else:
        logger.info("loading weights (%s, load format %s)", source.kind, mc.load_format)
        model = load_model(mc, source, torch_dtype(mc.dtype), torch.device(mc.device))
        logger.info("weights loaded in %.1f s", time.monotonic() - t1)
        logger.info("allocating the KV cache%s", f" and capturing {len(sizes)} CUDA graphs" if sizes else "")
        runner = ModelRunner(mc, resolved.cache, resolved.scheduler, resolved.runner, model, eos,
                             record_step_events=resolved.scheduler.async_scheduling)  # EngineCore's device_idle
    scheduler = Scheduler(resolved.scheduler, block_size=resolved.cache.block_size, num_blocks=runner.num_blocks,
                          max_model_len=mc.max_model_len, enable_prefix_caching=resolved.cache.enable_prefix_caching)
    core = EngineCore(scheduler, runner, max_model_len=mc.max_model_len, eos_token_ids=eos)
    logger.info(startup_summary(resolved, model, runner.num_blocks))
    name = _model_name(resolved, source)  # before the path is filled in: the default model keeps its GGUF name
    # what is in effect (/version, LLM.engine_config); the KV budget of one rank (the executor does not report it)
    resolved = config_in_effect(resolved, source, name, getattr(runner, "kv_cache_bytes", None))
    logger.info("engine ready in %.1f s: %s on %s (%s), max_model_len %d, block %d, %d KV blocks",
                time.monotonic() - t0, name, mc.device, mc.dtype, mc.max_model_len, resolved.cache.block_size,
                runner.num_blocks)
    return EngineBundle(core, tokenizer, resolved, name, eos)
