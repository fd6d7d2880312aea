"""Resolve an EngineConfig against the model: device, dtype, max_model_len, block size and the runner's backend
choices (--attention-backend, --moe-backend, --fused-norms, --cuda-graph-sizes; ladle/runner/op_backends.py)
become concrete; --quantization is checked against the checkpoint's quantization_config.

`resolve_engine_config(config, source, model_cls)` returns a new EngineConfig (dataclasses.replace; the
input is never mutated). User errors raise `ConfigError` (a ValueError) with a message that says why; all the
refusals of one config come in one ConfigError (`config_refusals` lists them without raising, so the command line
can add them to its own, and `hf_config=None` checks what needs no model). `resolve_model_path` turns a Hugging
Face hub id into its local HF-cache snapshot, or refuses it with the download command.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Iterable, Optional

import torch

from ladle.config import GiB, EngineConfig, env_flag, format_refusals
from ladle.models.hf_config import text_config_of
from ladle.quant.config import check_quantization, quantization_in_effect
from ladle.runner.op_backends import (expand_cuda_graph_sizes, resolve_attention_backend, resolve_moe_backend,
                                      resolve_runner_config)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_KV_BYTES = 2 * GiB
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


# vLLM's --kv-cache-dtype values (vllm/config/cache.py `CacheDType`, vLLM 0.33.0) other than auto.
VLLM_KV_CACHE_DTYPES = (
    "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4",
    "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3",
    "octave_k3v3_compact", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head",
    "nvfp4", "nvfp4_4over6",
)


class ConfigError(ValueError):
    """Engine settings that cannot work with this model or machine: one or more refusals, each a line that names
    the flag, the value and what ladle offers instead. `str()` is the one refusal, or a header and one per line."""

    def __init__(self, *refusals: str, source: str = "command line"):
        self.refusals = list(refusals)
        super().__init__(format_refusals(self.refusals, source))


def _hub_cache_dir() -> str:
    """huggingface_hub's cache folder: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if env_flag("HF_HUB_CACHE"):
        return env_flag("HF_HUB_CACHE")
    home = env_flag("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def resolve_model_path(model: Optional[str]) -> Optional[str]:
    """`model` unchanged when it is None or a local path; a Hugging Face hub id (`owner/name`, no such local path)
    becomes its snapshot in the local HF cache (`models--owner--name/snapshots/<refs/main>`, the layout
    huggingface_hub writes), or raises ConfigError saying to download it first."""
    if model is None or os.path.exists(os.path.expanduser(model)) or not _HUB_ID.fullmatch(model):
        return model
    repo_dir = os.path.join(_hub_cache_dir(), "models--" + model.replace("/", "--"))
    snapshots = os.path.join(repo_dir, "snapshots")
    ref_file = os.path.join(repo_dir, "refs", "main")
    if os.path.isfile(ref_file):
        with open(ref_file) as f:
            snapshot = os.path.join(snapshots, f.read().strip())
        if os.path.isfile(os.path.join(snapshot, "config.json")):
            return snapshot
    name = model.split("/")[1]
    raise ConfigError(
        f"{model} is a Hugging Face hub id, and ladle loads local paths only (it downloads nothing): download it "
        f"first, e.g. `huggingface-cli download {model} --local-dir ./{name}`, then `ladle serve ./{name}` "
        f"(a copy in the local Hugging Face cache, {_hub_cache_dir()}, is found by its id)")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"unsupported --device {device!r} (use auto, cpu or cuda)")
    return device


# Fields that size or shape CUDA work only: set on a CPU run they would be accepted and do nothing. Each with what the
# CPU offers instead ({kv_cache_memory_bytes}: that field, spelled as the caller spells fields).
CUDA_ONLY_FIELDS = {
    "gpu_memory_utilization": "on CPU the KV cache takes {kv_cache_memory_bytes} (default 2 GiB)",
    "cuda_graph_sizes": "CPU steps run eager (CUDA graphs exist on CUDA only)",
}


def cuda_only_refusals(given: Iterable[str], device: str, spell: Callable[[str], str] = str) -> list[str]:
    """A refusal per CUDA_ONLY_FIELDS field in `given` (the config fields the user set: flags on the command line,
    keywords in the Python API) when `device` resolves to CPU; [] on CUDA, or when `device` is refused on its own
    (config_refusals says why). `spell` names a field as the user wrote it (`--gpu-memory-utilization`; default: the
    field name, the Python API's keyword)."""
    given = set(given)
    fields = [f for f in CUDA_ONLY_FIELDS if f in given]
    if not fields:
        return []
    try:
        if resolve_device(device) != "cpu":
            return []
    except ValueError:
        return []
    return [f"{spell(f)}: applies on CUDA only, and this run is on CPU; "
            f"{CUDA_ONLY_FIELDS[f].format(kv_cache_memory_bytes=spell('kv_cache_memory_bytes'))}" for f in fields]


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


def _attention_heads(hf_config: dict) -> Optional[int]:
    heads = text_config_of(hf_config).get("num_attention_heads")
    return int(heads) if heads else None


def resolve_parallel(tensor_parallel_size: int, backend: str = "mp", hf_config: Optional[dict] = None) -> int:
    """--tensor-parallel-size must be >= 1 and divide the model's attention heads (the error lists the sizes that
    do); --distributed-executor-backend mp only (ray: not supported yet). Returns the size; one ConfigError with
    every refusal of the two flags."""
    refusals = []
    if backend != "mp":
        why = "not supported yet" if backend == "ray" else "not a distributed executor backend ladle knows"
        refusals.append(f"--distributed-executor-backend {backend}: {why}; ladle offers mp (one local process per "
                        "rank)")
    heads = _attention_heads(hf_config) if hf_config is not None else None
    if tensor_parallel_size < 1:
        refusals.append(f"--tensor-parallel-size {tensor_parallel_size}: must be a positive number of ranks "
                        "(1 runs the model in one process)")
    elif heads and heads % tensor_parallel_size:
        sizes = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        refusals.append(f"--tensor-parallel-size {tensor_parallel_size} does not divide this model's {heads} "
                        f"attention heads; sizes that work: {sizes}")
    if refusals:
        raise ConfigError(*refusals)
    return int(tensor_parallel_size)


def resolve_expert_parallel(enable: bool, tensor_parallel_size: int, hf_config: Optional[dict]) -> bool:
    """--enable-expert-parallel needs a model with routed experts, as many per rank (experts % TP == 0)."""
    if not enable or hf_config is None:
        return bool(enable)
    cfg = text_config_of(hf_config)
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not experts:
        raise ConfigError("--enable-expert-parallel: this model has no MoE experts (leave the flag out)")
    if tensor_parallel_size >= 1 and experts % tensor_parallel_size:
        raise ConfigError(f"--enable-expert-parallel: {experts} experts do not split over --tensor-parallel-size "
                          f"{tensor_parallel_size}")
    return True


# ladle's values of --kv-cache-dtype (ladle/runner/kv_cache.py KV_CACHE_DTYPES maps them to torch dtypes).
LADLE_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def resolve_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """auto (the KV cache stores the model dtype, which --dtype picks), or FP8 K/V and index-K caches: fp8 (vLLM's
    alias, resolved to fp8_e4m3), fp8_e4m3, fp8_e5m2. Any other value is refused, naming what ladle offers."""
    if kv_cache_dtype in LADLE_KV_CACHE_DTYPES:
        return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
    why = ("a vLLM KV cache dtype that ladle does not implement yet" if kv_cache_dtype in VLLM_KV_CACHE_DTYPES
           else "not a KV cache dtype ladle or vLLM knows")
    raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: {why}; ladle offers auto (the KV cache stores the model "
                      "dtype: float32 on CPU, bfloat16/float16 on CUDA, set with --dtype), fp8 (= fp8_e4m3) and "
                      "fp8_e5m2 (FP8 K/V and index-K caches with per-tensor scales)")


def kv_cache_dtype_in_effect(kv_cache_dtype: str, dtype: str) -> str:
    """The KV cache dtype a resolved config stores, by name: the model dtype (`dtype`, resolved: "float32",
    "bfloat16", "float16") for auto, fp8_e4m3 for vLLM's alias fp8, else the FP8 name given."""
    if kv_cache_dtype == "auto":
        return dtype
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def resolve_quantization(quantization: Optional[str], hf_config: Optional[dict]) -> Optional[str]:
    """--quantization checked against the checkpoint's config.json `quantization_config` before anything loads
    (ladle/quant/config.py `check_quantization`: fp8, the checkpoint's own format, or nothing; a checkpoint format
    ladle does not read is refused here too). Returns the flag unchanged; the format in effect is filled in after
    the load (ladle/engine/engine_factory.py, for /version)."""
    try:
        check_quantization(quantization, hf_config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return quantization


def resolve_async_scheduling(enable: Optional[bool], tensor_parallel_size: int) -> bool:
    """--async-scheduling: unset (None) means on with one rank (the H200 runs of 2026-12-01 found it never slower at
    TP = 1) and off with more ranks until a multi-GPU run measures it there; `--async-scheduling` turns it on at any
    size (the executor pipelines launch/wait on every rank, ladle/runner/executor.py); --no-async-scheduling runs
    every step synchronously."""
    if enable is None:
        return tensor_parallel_size == 1
    return bool(enable)


def _language_model_only(value: bool) -> bool:
    if not value:
        raise ConfigError("--no-language-model-only: ladle has no vision or audio encoder; it always loads the text "
                          "model of a multimodal checkpoint (leave the flag out)")
    return True


class _Refusals:
    """Collects the ConfigError/ValueError of each step so every refusal of a config is reported at once."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def run(self, fn: Callable[..., Any], *args: Any, fallback: Any = None) -> Any:
        try:
            return fn(*args)
        except ConfigError as e:
            self.messages.extend(e.refusals)
        except ValueError as e:
            self.messages.append(str(e))
        return fallback


def _resolve(config: EngineConfig, hf_config: Optional[dict], model_cls: Any,
             refusals: _Refusals) -> EngineConfig:
    """The resolved config; steps that fail record a refusal and leave their field as given. `hf_config=None`
    skips the steps that need the model (max_model_len, block size, the dtype auto rule on CUDA)."""
    device = refusals.run(resolve_device, config.model.device, fallback="cpu")
    model_fields = dict(device=device, language_model_only=refusals.run(
        _language_model_only, config.model.language_model_only, fallback=config.model.language_model_only))
    if hf_config is not None or config.model.dtype != "auto":
        model_fields["dtype"] = refusals.run(resolve_dtype, config.model.dtype, device, hf_config or {},
                                             fallback=config.model.dtype)
    model_fields["quantization"] = refusals.run(resolve_quantization, config.model.quantization, hf_config,
                                                fallback=config.model.quantization)
    cache_fields: dict[str, Any] = dict(kv_cache_dtype=refusals.run(resolve_kv_cache_dtype, config.cache.kv_cache_dtype,
                                                                      fallback=config.cache.kv_cache_dtype))
    if hf_config is not None:
        model_fields["max_model_len"] = refusals.run(resolve_max_model_len, config.model.max_model_len, hf_config,
                                                     fallback=config.model.max_model_len)
        cache_fields["block_size"] = refusals.run(resolve_block_size, config.cache.block_size, hf_config, model_cls,
                                                  fallback=config.cache.block_size)
    kv_bytes = config.cache.kv_cache_memory_bytes
    cache_fields["kv_cache_memory_bytes"] = DEFAULT_CPU_KV_BYTES if kv_bytes is None and device == "cpu" else kv_bytes
    if config.scheduler.max_num_batched_tokens < 1 or config.scheduler.max_num_seqs < 1:
        refusals.messages.append("--max-num-batched-tokens and --max-num-seqs must be positive")
    parallel = dataclasses.replace(config.parallel, tensor_parallel_size=refusals.run(
        resolve_parallel, config.parallel.tensor_parallel_size, config.parallel.distributed_executor_backend,
        hf_config, fallback=config.parallel.tensor_parallel_size))
    refusals.run(resolve_expert_parallel, config.parallel.enable_expert_parallel,
                 config.parallel.tensor_parallel_size, hf_config)
    scheduler = dataclasses.replace(config.scheduler, async_scheduling=refusals.run(
        resolve_async_scheduling, config.scheduler.async_scheduling, config.parallel.tensor_parallel_size,
        fallback=False))
    device_type = torch.device(device).type
    backends_ok = [refusals.run(resolve_attention_backend, config.runner.attention_backend, device_type),
                   refusals.run(resolve_moe_backend, config.runner.moe_backend, device_type)]
    runner = config.runner
    if all(backends_ok):  # else their refusals are recorded; the rest of the runner config is checked below
        runner = refusals.run(resolve_runner_config, config.runner, device_type, max(1, config.scheduler.max_num_seqs),
                              fallback=config.runner)
    elif config.runner.cuda_graph_sizes:
        refusals.run(expand_cuda_graph_sizes, config.runner.cuda_graph_sizes, max(1, config.scheduler.max_num_seqs))
    if config.runner.observe_timing and config.parallel.tensor_parallel_size > 1:
        refusals.messages.append(  # refused, never turned off quietly: the ranks' devices are in worker processes
            f"--observe-timing with --tensor-parallel-size {config.parallel.tensor_parallel_size}: not supported yet "
            "(the ranks run in worker processes, where the step record is not); time with --tensor-parallel-size 1, "
            "or leave --observe-timing out")
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **model_fields),
                               cache=dataclasses.replace(config.cache, **cache_fields), parallel=parallel,
                               scheduler=scheduler, runner=runner)


def config_refusals(config: EngineConfig, hf_config: Optional[dict] = None, model_cls: Any = None) -> list[str]:
    """Every refusal of `config` (empty when it resolves), each a one-line message. `hf_config=None`: only the
    checks that need no model (device, dtype, KV cache dtype, parallelism, backends, scheduler limits)."""
    refusals = _Refusals()
    _resolve(config, hf_config, model_cls, refusals)
    return refusals.messages


def resolve_engine_config(config: EngineConfig, hf_config: dict, model_cls: Any = None) -> EngineConfig:
    """A fully resolved copy of `config` for this model (see module docstring). Raises one ConfigError that lists
    every refusal."""
    refusals = _Refusals()
    resolved = _resolve(config, hf_config, model_cls, refusals)
    if refusals.messages:
        raise ConfigError(*refusals.messages)
    return resolved


def config_in_effect(resolved: EngineConfig, source: Any, served_model_name: str,
                     kv_cache_bytes: Optional[int] = None) -> EngineConfig:
    """What a built engine runs with, as /version and `LLM.engine_config` report it: `resolved` (from
    resolve_engine_config) with the values known once the model is loaded. Not a command line to resolve again:
    some values are no flag's (quantization "mxfp4+fp8", kv_cache_dtype "float32").
    - model: the path the source resolved to (None meant the embedded default GGUF);
    - served_model_name: the name the API answers to (--served-model-name, else the model's path or GGUF name);
    - tokenizer: the directory the tokenizer was read from (None meant the model's);
    - load_format: auto becomes what was read, gguf or safetensors (dummy and explicit values stay);
    - quantization: the weight format the model was built with (ladle/quant/config.py: "fp8", "mxfp4", "mxfp4+fp8"
      or None);
    - kv_cache_dtype: auto becomes the model dtype's name (kv_cache_dtype_in_effect);
    - kv_cache_memory_bytes: unset (on CUDA: from --gpu-memory-utilization) becomes `kv_cache_bytes`, the KV budget
      the runner profiled, where known (one rank; None leaves it unset);
    - gpu_memory_utilization: None where it sizes nothing (on CPU, or with --kv-cache-memory-bytes given).
    `source`: the ladle.models.loader.ModelSource the model was loaded from."""
    mc = resolved.model
    load_format = mc.load_format
    if load_format == "auto":
        load_format = "gguf" if source.kind == "gguf" else "safetensors"
    model = dataclasses.replace(mc, model=source.path, served_model_name=served_model_name,
                                tokenizer=source.tokenizer_path, load_format=load_format,
                                quantization=quantization_in_effect(mc, source.hf_config))
    cc = resolved.cache
    # --gpu-memory-utilization sizes the KV cache only on CUDA without --kv-cache-memory-bytes: elsewhere null
    sized_by_fraction = mc.device != "cpu" and cc.kv_cache_memory_bytes is None
    cache = dataclasses.replace(cc, kv_cache_dtype=kv_cache_dtype_in_effect(cc.kv_cache_dtype, mc.dtype),
                                kv_cache_memory_bytes=cc.kv_cache_memory_bytes if cc.kv_cache_memory_bytes is not None
                                else kv_cache_bytes,
                                gpu_memory_utilization=cc.gpu_memory_utilization if sized_by_fraction else None)
    return dataclasses.replace(resolved, model=model, cache=cache)
