"""--attention-backend / --moe-backend / --fused-norms / --cuda-graph-sizes: flag parsing, refusal of vLLM values
ladle lacks, per-device resolution of auto, and the runner's forward contexts carrying what was resolved."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from helpers import TINY_LLAMA, make_bundle, tiny_model

from ladle.cli import serve_parser
from ladle.cli_args import configs_from_args, parse_serve_args
from ladle.config import (DEFAULT_CUDA_GRAPH_SIZES, EngineConfig, ModelConfig, ParallelConfig, RunnerConfig,
                          SchedulerConfig)
from ladle.core.sampling_params import SamplingParams
from ladle.engine.config_resolve import ConfigError, config_refusals, resolve_engine_config
from ladle.engine.llm import LLM
from ladle.layers.attention.metadata import OpBackends, get_forward_context
from ladle.runner.op_backends import (expand_cuda_graph_sizes, op_backends, resolve_attention_backend,
                                      resolve_moe_backend, resolve_runner_config)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flags_parse_into_runner_config():
    args = parse_serve_args(serve_parser(), ["--attention-backend", "TRITON_ATTN", "--moe-backend", "torch",
                                             "--no-fused-norms", "--cuda-graph-sizes", "1", "8", "32"])
    runner = configs_from_args(args)[0].runner
    assert (runner.attention_backend, runner.moe_backend, runner.fused_norms) == ("TRITON_ATTN", "torch", False)
    assert runner.cuda_graph_sizes == (1, 8, 32)
    default = configs_from_args(parse_serve_args(serve_parser(), []))[0].runner
    assert default == RunnerConfig() and default.fused_norms is True
    assert default.cuda_graph_sizes == DEFAULT_CUDA_GRAPH_SIZES == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160,
                                                                    192, 224, 256, 320, 384, 448, 512)


@pytest.mark.parametrize("value", ["FLASH_ATTN", "flashinfer", "FLEX_ATTENTION", "TRITON_MLA", "CPU_ATTN"])
def test_vllm_attention_backend_is_refused_with_the_list(value):
    with pytest.raises(ValueError, match="a vLLM backend that ladle does not implement; ladle offers TRITON_ATTN, "
                                         "TORCH or auto"):
        resolve_attention_backend(value, "cuda")


@pytest.mark.parametrize("value", ["marlin", "aiter", "cutlass", "flashinfer_cutlass", "DEEP_GEMM"])
def test_vllm_moe_backend_is_refused_with_the_list(value):
    with pytest.raises(ValueError, match="a vLLM backend that ladle does not implement; ladle offers triton, torch"):
        resolve_moe_backend(value, "cuda")


def test_unknown_backend_values_are_refused():
    with pytest.raises(ValueError, match=r"--attention-backend FAST: not a backend ladle or vLLM knows; ladle offers"):
        resolve_attention_backend("FAST", "cpu")
    with pytest.raises(ValueError, match=r"--moe-backend fastest: not a backend ladle or vLLM knows; ladle offers"):
        resolve_moe_backend("fastest", "cpu")


def test_auto_resolves_per_device():
    cuda = resolve_runner_config(RunnerConfig(), "cuda", 256)
    assert (cuda.attention_backend, cuda.moe_backend, cuda.fused_norms) == ("TRITON_ATTN", "triton", True)
    assert cuda.cuda_graph_sizes == DEFAULT_CUDA_GRAPH_SIZES[:15]  # up to 256 = --max-num-seqs
    assert op_backends(cuda) == OpBackends.kernels()
    cpu = resolve_runner_config(RunnerConfig(), "cpu", 256)
    assert (cpu.attention_backend, cpu.moe_backend, cpu.fused_norms, cpu.cuda_graph_sizes) == ("TORCH", "torch",
                                                                                               False, ())
    assert op_backends(cpu) == OpBackends.reference()


def test_explicit_choices_and_what_is_in_effect():
    # names match case-insensitively; on CPU a Triton backend brings the fused norms into effect (interpreter)
    cpu = resolve_runner_config(RunnerConfig(attention_backend="triton_attn", moe_backend="TORCH"), "cpu", 8)
    assert op_backends(cpu) == OpBackends("TRITON_ATTN", "torch", True) and cpu.cuda_graph_sizes == ()
    off = resolve_runner_config(RunnerConfig(fused_norms=False), "cuda", 8)
    assert op_backends(off) == OpBackends("TRITON_ATTN", "triton", False)
    # no graphs with --enforce-eager, nor with the TORCH attention (host mirrors: not graph-safe)
    assert resolve_runner_config(RunnerConfig(enforce_eager=True), "cuda", 8).cuda_graph_sizes == ()
    torch_attn = resolve_runner_config(RunnerConfig(attention_backend="TORCH"), "cuda", 8)
    assert torch_attn.cuda_graph_sizes == () and torch_attn.fused_norms is True
    with pytest.raises(ValueError, match="not resolved"):
        op_backends(RunnerConfig())


def test_cuda_graph_sizes_rules():
    assert expand_cuda_graph_sizes([100, 4, 1, 4], 64) == (1, 4, 64)  # clamped to --max-num-seqs, deduplicated
    assert expand_cuda_graph_sizes(DEFAULT_CUDA_GRAPH_SIZES, 100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert expand_cuda_graph_sizes([20], 256) == (1, 2, 4, 8, 16)  # one value: vLLM's 1 2 4 + multiples of 8
    assert expand_cuda_graph_sizes([3], 256) == (1, 2)
    assert expand_cuda_graph_sizes([1], 256) == (1,)
    with pytest.raises(ValueError, match="must be positive"):
        expand_cuda_graph_sizes([8, 0], 256)


def test_engine_config_resolution_reports_what_is_in_effect():
    cfg = EngineConfig(model=ModelConfig(device="cpu"), scheduler=SchedulerConfig(max_num_seqs=8),
                       runner=RunnerConfig(moe_backend="triton"))
    runner = resolve_engine_config(cfg, dict(TINY_LLAMA)).runner
    assert (runner.attention_backend, runner.moe_backend, runner.fused_norms) == ("TORCH", "triton", True)
    assert json.loads(json.dumps(resolve_engine_config(cfg, dict(TINY_LLAMA)).to_dict()))["runner"] == {
        "attention_backend": "TORCH", "moe_backend": "triton", "fused_norms": True, "cuda_graph_sizes": [],
        "enforce_eager": False, "dispatch_report": False, "observe_timing": False, "observe_timing_interval": 16,
        "observe_copy_bandwidth": 0.0, "observe_gemm_rate": 0.0}
    with pytest.raises(ConfigError, match="--attention-backend FLASHINFER: a vLLM backend"):
        resolve_engine_config(EngineConfig(model=ModelConfig(device="cpu"),
                                           runner=RunnerConfig(attention_backend="FLASHINFER")), dict(TINY_LLAMA))


def test_runner_forward_contexts_carry_the_resolved_backends():
    model = tiny_model(seed=1)
    seen: list[OpBackends] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(get_forward_context().backends))
    # --moe-backend triton on a dense model: a non-default OpBackends whose forward runs no Triton code
    bundle = make_bundle(model, runner=RunnerConfig(moe_backend="triton", fused_norms=False))
    assert bundle.core.runner.backends == OpBackends("TORCH", "triton", False)
    LLM(bundle=bundle).generate([[5, 9, 2, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(seen) == 3 and all(b == OpBackends("TORCH", "triton", False) for b in seen)


def test_cli_shows_a_refused_backend_as_a_message(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "ladle", "serve", str(tmp_path), "--load-format", "dummy",
                        "--device", "cpu", "--port", str(port), "--moe-backend", "marlin"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "ladle serve: error: --moe-backend marlin: a vLLM backend that ladle does not implement; ladle offers " \
           "triton, torch or auto" in r.stderr


def test_cuda_graphs_need_both_triton_attention_and_triton_moe():
    """The torch MoE references sync on the host (torch.unique(...).tolist()): a graph cannot capture them."""
    assert OpBackends.kernels().graph_safe
    assert not OpBackends("TRITON_ATTN", "torch", True).graph_safe
    assert not OpBackends("TORCH", "triton", True).graph_safe
    cuda = resolve_runner_config(RunnerConfig(moe_backend="torch"), "cuda", 8)
    assert cuda.cuda_graph_sizes == () and resolve_runner_config(RunnerConfig(), "cuda", 8).cuda_graph_sizes


def test_observe_timing_is_reported_only_where_it_runs_and_its_numbers_are_checked():
    """Honoured on CUDA (events) and on CPU (the host clock, ladle/observe/op_timing.py); refused with more ranks,
    never turned off quietly (it used to resolve to False on CPU and at TP > 1)."""
    assert resolve_runner_config(RunnerConfig(observe_timing=True), "cpu", 8).observe_timing is True
    tp2 = EngineConfig(runner=RunnerConfig(observe_timing=True), parallel=ParallelConfig(tensor_parallel_size=2))
    assert [r for r in config_refusals(tp2) if "--observe-timing" in r] == [
        "--observe-timing with --tensor-parallel-size 2: not supported yet (the ranks run in worker processes, where "
        "the step record is not); time with --tensor-parallel-size 1, or leave --observe-timing out"]
    assert resolve_runner_config(RunnerConfig(observe_timing=True), "cuda", 8).observe_timing is True
    with pytest.raises(ValueError, match="--observe-timing-interval"):
        resolve_runner_config(RunnerConfig(observe_timing_interval=0), "cpu", 8)
    with pytest.raises(ValueError, match="--observe-copy-bandwidth"):
        resolve_runner_config(RunnerConfig(observe_gemm_rate=-1.0), "cpu", 8)
