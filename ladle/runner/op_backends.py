"""RunnerConfig's backend choices resolved into what runs: concrete config values (what `/version` reports) and
the one `OpBackends` that every forward context of the runner carries.

    --attention-backend  auto | TRITON_ATTN | TORCH   auto: TRITON_ATTN on CUDA, TORCH on CPU
    --moe-backend        auto | triton | torch        auto: triton on CUDA, torch on CPU
    --fused-norms        in effect on CUDA, and on CPU only when a Triton attention/MoE backend was chosen
    --cuda-graph-sizes   one value N = 1 2 4 and the multiples of 8 up to N (vLLM's rule), several = those sizes;
                         each clamped to --max-num-seqs; empty where no graph is captured (CPU, --enforce-eager,
                         TORCH attention, which reads host mirrors and so cannot be captured)

Backend names are matched case-insensitively (attention names are upper case, MoE names lower case, as in vLLM).
Any other value raises ValueError; one vLLM knows gets "a vLLM backend ladle does not implement" and the list
ladle offers, so a pasted vLLM command line fails with a reason.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ladle.config import RunnerConfig
from ladle.layers.attention.metadata import ATTENTION_BACKENDS, MOE_BACKENDS, OpBackends

AUTO = "auto"

# vLLM's attention backend names that ladle does not implement: the members of vLLM's `AttentionBackendEnum`
# (vllm/v1/attention/backends/registry.py in vLLM 0.33.0; vllm/attention/backends/registry.py in late 2025; called
# `_Backend` before, whose members ROCM_FLASH, DUAL_CHUNK_FLASH_ATTN and DIFFERENTIAL_FLASH_ATTN are included too)
# minus TRITON_ATTN.
VLLM_ATTENTION_BACKENDS = (
    "FLASH_ATTN", "XFORMERS", "ROCM_ATTN", "ROCM_FLASH", "ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA", "ROCM_AITER_FA",
    "ROCM_AITER_MLA_SPARSE", "ROCM_AITER_UNIFIED_ATTN", "TORCH_SDPA", "FLASHINFER", "FLASHINFER_MLA", "TRITON_MLA",
    "CUTLASS_MLA", "FLASHMLA", "FLASHMLA_SPARSE", "FLASH_ATTN_MLA", "PALLAS", "IPEX", "NO_ATTENTION",
    "FLEX_ATTENTION", "TREE_ATTN", "CPU_ATTN", "DUAL_CHUNK_FLASH_ATTN", "DIFFERENTIAL_FLASH_ATTN", "CUSTOM",
    "FLASH_ATTN_DIFFKV", "TRITON_ATTN_DIFFKV", "TRITON_FLASH_ATTN", "ROCM_SEGMENTED_ATTN", "XPU_MLA_SPARSE",
    "TRITON_FLASHINFER", "TOKENSPEED_MLA", "FLASHINFER_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM120",
    "FLASHINFER_MLA_SPARSE_SM90", "FLASHMLA_SPARSE_DSV4", "FLASHINFER_MLA_SPARSE_DSV4", "ROCM_FLASHMLA_SPARSE_DSV4",
    "FLASHMLA_SPARSE_DSV41", "FLASHINFER_MLA_SPARSE_DSV41", "ROCM_FLASHMLA_SPARSE_DSV41", "FLASHMLA_MEGA_ATTN_DSV41",
    "B12X", "FLASH_ATTN_MLA_SPARSE", "FLASH_ATTN_MLA_SPARSE_FA4", "MINIMAX_M3_SPARSE", "CUTLASS_MSA", "TRITON_MSA",
    "STEP5_DSA", "HPC_ATTN", "CPU_MLA", "AMX_MLA", "TURBOQUANT", "ROCM_OCTAVE", "ULTRAQUANT",
)
# vLLM's --moe-backend values that ladle does not implement: vLLM's `MoEBackend` literal (vllm/config/kernel.py,
# union over releases 0.12-0.33) minus auto and triton.
VLLM_MOE_BACKENDS = (
    "deep_gemm", "deep_gemm_mega_moe", "cutlass", "flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_cutedsl",
    "flashinfer_b12x", "marlin", "sm70_skinny", "humming", "triton_unfused", "aiter", "emulation", "batched_triton",
    "flashinfer_moe_ep_cutedsl", "b12x", "flashinfer_moe_ep_mega_deep_gemm", "aiter_mega_moe",
    "aiter_triton_mxfp4_bf16", "aiter_triton_mxfp4_mxfp4", "flydsl", "hpc", "rdna3",
)


def _refuse(flag: str, value: str, offered: Sequence[str], known_to_vllm: bool, auto_rule: str) -> ValueError:
    why = "a vLLM backend that ladle does not implement" if known_to_vllm else "not a backend ladle or vLLM knows"
    amd = known_to_vllm and any(k in value.lower() for k in ("aiter", "rocm", "rdna", "flydsl"))
    return ValueError(f"{flag} {value}: {why}; ladle offers {', '.join(offered)} or auto ({auto_rule})"
                      + ("; this one is AMD-only (ROCm)" if amd else ""))


def resolve_attention_backend(value: str, device_type: str) -> str:
    """'TRITON_ATTN' | 'TORCH' for `value` ('auto' or a name, any case) on a 'cuda' or 'cpu' device."""
    name = value.strip().upper()
    if name == AUTO.upper():
        return "TRITON_ATTN" if device_type == "cuda" else "TORCH"
    if name in ATTENTION_BACKENDS:
        return name
    raise _refuse("--attention-backend", value, ATTENTION_BACKENDS, name in VLLM_ATTENTION_BACKENDS,
                  "TRITON_ATTN on CUDA, TORCH on CPU")


def resolve_moe_backend(value: str, device_type: str) -> str:
    """'triton' | 'torch' for `value` ('auto' or a name, any case) on a 'cuda' or 'cpu' device."""
    name = value.strip().lower()
    if name == AUTO:
        return "triton" if device_type == "cuda" else "torch"
    if name in MOE_BACKENDS:
        return name
    raise _refuse("--moe-backend", value, MOE_BACKENDS, name in VLLM_MOE_BACKENDS, "triton on CUDA, torch on CPU")


def expand_cuda_graph_sizes(sizes: Sequence[int], max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture, ascending. One value N: 1, 2, 4 and the multiples of 8 up to N (vLLM's rule for
    a single --cuda-graph-sizes value, vllm/config/scheduler.py `SchedulerConfig.cuda_graph_sizes`, v0.10); several:
    those. A size above `max_num_seqs` becomes `max_num_seqs`. Raises ValueError for a size < 1."""
    sizes = [int(s) for s in sizes]
    if any(s < 1 for s in sizes):
        raise ValueError(f"--cuda-graph-sizes must be positive batch sizes, got {' '.join(map(str, sizes))}")
    if len(sizes) == 1:
        sizes = [s for s in (1, 2, 4) if s <= sizes[0]] + list(range(8, sizes[0] + 1, 8)) or sizes
    return tuple(sorted({min(s, max_num_seqs) for s in sizes}))


def resolve_runner_config(runner: RunnerConfig, device_type: str, max_num_seqs: int) -> RunnerConfig:
    """A copy of `runner` with every choice replaced by what is in effect on `device_type` ('cuda' or 'cpu').
    Called once per engine (engine/config_resolve.py); not idempotent for --cuda-graph-sizes (a resolved single
    size would expand again), so a resolved config is never resolved twice. Raises ValueError (module docstring)."""
    attention = resolve_attention_backend(runner.attention_backend, device_type)
    moe = resolve_moe_backend(runner.moe_backend, device_type)
    triton_runs = device_type == "cuda" or attention == "TRITON_ATTN" or moe == "triton"
    sizes = expand_cuda_graph_sizes(runner.cuda_graph_sizes, max_num_seqs) if runner.cuda_graph_sizes else ()
    captured = device_type == "cuda" and not runner.enforce_eager and OpBackends(attention, moe).graph_safe
    if runner.observe_timing_interval < 1:
        raise ValueError(f"--observe-timing-interval must be >= 1 step, got {runner.observe_timing_interval}")
    if runner.observe_copy_bandwidth < 0 or runner.observe_gemm_rate < 0:
        raise ValueError("--observe-copy-bandwidth and --observe-gemm-rate must be >= 0 (0: measure on CUDA)")
    return dataclasses.replace(runner, attention_backend=attention, moe_backend=moe,
                               fused_norms=bool(runner.fused_norms and triton_runs),
                               cuda_graph_sizes=sizes if captured else (),
                               observe_timing=bool(runner.observe_timing))  # CUDA events; the host clock on CPU


def op_backends(resolved: RunnerConfig) -> OpBackends:
    """The OpBackends of a config returned by `resolve_runner_config`. Raises ValueError for an unresolved one."""
    if resolved.attention_backend not in ATTENTION_BACKENDS or resolved.moe_backend not in MOE_BACKENDS:
        raise ValueError(f"RunnerConfig not resolved (attention_backend={resolved.attention_backend!r}, "
                         f"moe_backend={resolved.moe_backend!r}): pass it through resolve_runner_config first")
    return OpBackends(attention=resolved.attention_backend, moe=resolved.moe_backend, fused_norms=resolved.fused_norms)
