"""Honest flags: the MiniMax-M3 recipe line pasted unchanged gets every refusal in one message before anything loads;
no flag is accepted and ignored; a Hugging Face hub id gets the download command."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ladle.cli import serve_parser
from ladle.cli_args import collect_refusals, configs_from_args, load_vllm_flags, parse_serve_args, vllm_flags_version
from ladle.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, RunnerConfig
from ladle.engine.config_resolve import ConfigError, config_refusals, resolve_engine_config, resolve_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = ("--tensor-parallel-size 4 --block-size 128 --no-enable-prefix-caching --language-model-only --moe-backend "
          "aiter --max-model-len 10240 --max-num-batched-tokens 32768 --kv-cache-dtype fp8 --attention-backend "
          "TRITON_ATTN --tool-call-parser minimax_m3 --reasoning-parser minimax_m3 --enable-auto-tool-choice").split()


def _ladle(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ladle", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.fixture(scope="module")
def m3_tiny(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("m3") / "m3-tiny")
    r = _ladle("make-checkpoint", "minimax-m3", "--preset", "tiny", out)
    assert r.returncode == 0, r.stderr
    return out


def test_recipe_line_on_tiny_m3_is_one_message(m3_tiny):
    r = _ladle("serve", m3_tiny, *RECIPE, "--port", "1")
    # the parser flags are implemented: only values are refused now (exit status 1)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.count("error:") == 1 and "usage:" not in r.stderr
    assert r.stderr.startswith("ladle serve: error: 3 settings of this command line are refused")  # fp8 KV is served
    assert "parser" not in r.stderr and "auto-tool-choice" not in r.stderr
    lines = [line.strip() for line in r.stderr.splitlines()[1:]]
    expected = ["--max-model-len 10240", "--block-size 128",
                "--moe-backend aiter:"]  # TP 4 divides the tiny M3's 8 heads: accepted
    assert len(lines) == len(expected)
    for prefix in expected:
        assert sum(line.startswith(prefix) for line in lines) == 1, (prefix, r.stderr)
    # each refusal says what ladle offers instead
    assert "AMD-only" in r.stderr and "ladle offers triton, torch" in r.stderr
    assert "--kv-cache-dtype" not in r.stderr and "must be 16" in r.stderr and "use at most 4096" in r.stderr
    assert "loading weights" not in r.stderr  # nothing was loaded


def test_recipe_flags_ladle_implements_parse():
    args = parse_serve_args(serve_parser(), ["m", "--block-size", "128", "--no-enable-prefix-caching",
                                             "--language-model-only", "--max-model-len", "10240",
                                             "--max-num-batched-tokens", "32768", "--attention-backend", "TRITON_ATTN",
                                             "--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3",
                                             "--enable-auto-tool-choice"])
    engine, server = configs_from_args(args)
    assert (server.tool_call_parser, server.reasoning_parser, server.enable_auto_tool_choice) == (
        "minimax_m3", "minimax_m3", True)
    assert engine.cache.block_size == 128 and engine.cache.enable_prefix_caching is False
    assert engine.model.language_model_only is True and engine.model.max_model_len == 10240
    assert engine.scheduler.max_num_batched_tokens == 32768 and engine.runner.attention_backend == "TRITON_ATTN"


@pytest.mark.parametrize("argv,expected", [
    ([], True), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False),
    (["--disable-prefix-caching"], False), (["--no-enable-prefix-caching", "--enable-prefix-caching"], True),
])
def test_prefix_caching_negations(argv, expected):
    engine, _ = configs_from_args(parse_serve_args(serve_parser(), argv))
    assert engine.cache.enable_prefix_caching is expected


@pytest.mark.parametrize("tp,message", [
    (0, "must be a positive number of ranks"), (-1, "must be a positive number of ranks"),
])
def test_tensor_parallel_size_below_1_is_refused(tp, message):
    refusals = config_refusals(EngineConfig(model=ModelConfig(device="cpu"), parallel=ParallelConfig(tp)))
    assert len(refusals) == 1 and refusals[0].startswith(f"--tensor-parallel-size {tp}: {message}")
    assert config_refusals(EngineConfig(model=ModelConfig(device="cpu"), parallel=ParallelConfig(1))) == []
    assert config_refusals(EngineConfig(model=ModelConfig(device="cpu"), parallel=ParallelConfig(4))) == []


def test_tensor_parallel_size_must_divide_the_heads_and_ray_is_refused():
    from ladle.engine.config_resolve import resolve_parallel

    with pytest.raises(ConfigError, match="does not divide this model's 6 attention heads; sizes that work: 1, 2, "
                                          "3, 6"):
        resolve_parallel(4, "mp", {"num_attention_heads": 6})
    assert resolve_parallel(3, "mp", {"num_attention_heads": 6}) == 3
    with pytest.raises(ConfigError, match="--distributed-executor-backend ray: not supported yet"):
        resolve_parallel(2, "ray", {"num_attention_heads": 6})


def test_ray_and_a_size_that_does_not_divide_are_refused_together():
    refusals = config_refusals(EngineConfig(model=ModelConfig(device="cpu"), parallel=ParallelConfig(7, "ray")),
                               {"num_attention_heads": 9})
    assert any(r.startswith("--distributed-executor-backend ray: not supported yet") for r in refusals), refusals
    assert any("--tensor-parallel-size 7 does not divide this model's 9 attention heads; sizes that work: 1, 3, 9"
               in r for r in refusals), refusals


def test_tensor_parallel_size_against_the_heads_is_refused_before_the_engine_starts(m3_tiny):
    """The model's config.json is read up front on every command line: a size that does not divide the heads is
    refused in the one message (exit 1), before 'configuration accepted', with the other refusals of the line."""
    r = _ladle("serve", m3_tiny, "--tensor-parallel-size", "7", "--max-num-seqs", "0", "--port", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "configuration accepted" not in r.stderr and r.stderr.count("error:") == 1, r.stderr
    assert "--tensor-parallel-size 7 does not divide this model's" in r.stderr and "--max-num-seqs" in r.stderr


def test_expert_parallel_needs_experts_that_split():
    from ladle.engine.config_resolve import resolve_expert_parallel

    assert resolve_expert_parallel(True, 4, {"num_local_experts": 8}) is True
    with pytest.raises(ConfigError, match="has no MoE experts"):
        resolve_expert_parallel(True, 2, {"num_attention_heads": 6})
    with pytest.raises(ConfigError, match="8 experts do not split over --tensor-parallel-size 3"):
        resolve_expert_parallel(True, 3, {"num_local_experts": 8})


@pytest.mark.parametrize("value,why", [("fp8_inc", "does not implement yet"), ("nvfp4", "does not implement yet"),
                                       ("bfloat16", "does not implement yet"), ("int3", "not a KV cache dtype")])
def test_kv_cache_dtype_other_than_ladles_is_refused(value, why):
    refusals = config_refusals(EngineConfig(model=ModelConfig(device="cpu"), cache=CacheConfig(kv_cache_dtype=value)))
    assert len(refusals) == 1 and refusals[0].startswith(f"--kv-cache-dtype {value}: ") and why in refusals[0]
    assert "ladle offers auto" in refusals[0] and "fp8 (= fp8_e4m3) and fp8_e5m2" in refusals[0]


@pytest.mark.parametrize("value,resolved", [("auto", "auto"), ("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"),
                                            ("fp8_e5m2", "fp8_e5m2")])
def test_kv_cache_dtype_fp8_values_are_accepted(value, resolved):
    cfg = EngineConfig(model=ModelConfig(device="cpu"), cache=CacheConfig(kv_cache_dtype=value))
    assert config_refusals(cfg) == []
    assert resolve_engine_config(cfg, {"max_position_embeddings": 64}).cache.kv_cache_dtype == resolved


def test_no_language_model_only_is_refused():
    refusals = config_refusals(EngineConfig(model=ModelConfig(device="cpu", language_model_only=False)))
    assert refusals and refusals[0].startswith("--no-language-model-only: ladle has no vision or audio encoder")


def test_every_config_refusal_at_once():
    cfg = EngineConfig(model=ModelConfig(device="cpu", dtype="int7"), cache=CacheConfig(kv_cache_dtype="fp8_inc"),
                       parallel=ParallelConfig(0), runner=RunnerConfig(attention_backend="FLASH_ATTN",
                                                                       moe_backend="marlin"))
    refusals = config_refusals(cfg)
    assert [r.split(" ", 1)[0] for r in refusals] == ["unsupported", "--kv-cache-dtype", "--tensor-parallel-size",
                                                      "--attention-backend", "--moe-backend"]
    with pytest.raises(ConfigError) as e:
        resolve_engine_config(cfg, {"max_position_embeddings": 64})
    assert e.value.refusals == refusals and str(e.value).startswith("5 settings of this command line are refused")


def test_unsupported_flag_values_are_skipped_by_arity(capsys):
    refusals, args = collect_refusals(serve_parser(), [
        "--swap-space", "4", "model-dir", "--cudagraph-capture-sizes", "1", "2", "4", "--max-num-seqs", "8",
        "--headless", "--enable-lora", "--data-parallel-size=2", "--seed", "3"])
    assert [r.split(" (")[0] for r in refusals] == [
        "not supported yet: --swap-space", "not supported yet: --cudagraph-capture-sizes",
        "not supported yet: --headless", "not supported yet: --enable-lora", "not supported yet: --data-parallel-size"]
    engine, _ = configs_from_args(args)
    assert engine.model.model == "model-dir" and engine.scheduler.max_num_seqs == 8 and engine.model.seed == 3


def test_refused_flags_and_a_bad_value_in_one_message(capsys):
    with pytest.raises(SystemExit) as e:
        parse_serve_args(serve_parser(), ["--enable-lora", "--port", "eighty"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "not supported yet: --enable-lora" in err and "invalid int value" in err


def test_flag_list_is_a_current_vllm():
    assert vllm_flags_version().startswith("vLLM 0.33.0")
    flags = load_vllm_flags()
    for name in ("--moe-backend", "--attention-backend", "--language-model-only", "--disable-prefix-caching",
                 "--no-enable-prefix-caching", "--tool-call-parser", "--reasoning-parser", "--enable-auto-tool-choice",
                 "-tp", "-O", "--swap-space"):  # --swap-space: removed from vLLM, still refused by name
        assert name in flags, name
    assert flags["--disable-prefix-caching"] == "--enable-prefix-caching"


def test_hub_id_is_refused_with_the_download_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as e:
        resolve_model_path("MiniMaxAI/MiniMax-M3")
    assert "huggingface-cli download MiniMaxAI/MiniMax-M3" in str(e.value) and "local paths" in str(e.value)
    assert resolve_model_path(None) is None and resolve_model_path("/abs/missing") == "/abs/missing"
    local = tmp_path / "owner" / "name"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("owner/name") == "owner/name"  # an existing relative path wins over a hub id


def test_hub_id_found_in_the_hf_cache(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--MiniMaxAI--MiniMax-M3"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("MiniMaxAI/MiniMax-M3") == str(snap)


def test_hub_id_subprocess(tmp_path):
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "ladle", "serve", "MiniMaxAI/MiniMax-M3", "--port", "1"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "ladle serve: error: MiniMaxAI/MiniMax-M3 is a Hugging Face hub id" in r.stderr
    assert "huggingface-cli download MiniMaxAI/MiniMax-M3 --local-dir ./MiniMax-M3" in r.stderr


def test_unknown_parser_names_are_refused_before_loading():
    r = _ladle("serve", "/nonexistent/model", "--tool-call-parser", "mistral", "--reasoning-parser", "deepseek_r1",
               "--port", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("error:") == 1
    assert "--tool-call-parser mistral: unknown tool-call parser; ladle has hermes, llama3_json, minimax_m3" in r.stderr
    assert "--reasoning-parser deepseek_r1: unknown reasoning parser; ladle has minimax_m3" in r.stderr


def test_auto_tool_choice_without_a_parser_is_refused():
    from ladle.server.parsers import parser_flag_refusals

    assert parser_flag_refusals(None, None, True) == [
        "--enable-auto-tool-choice: needs --tool-call-parser (one of hermes, llama3_json, minimax_m3)"]
    assert parser_flag_refusals("hermes", "minimax_m3", True) == []


@pytest.mark.parametrize("argv,stats_off,access_off", [
    ([], False, False), (["--disable-log-stats"], True, False), (["--disable-uvicorn-access-log"], False, True),
    (["--disable-uvicorn-access-log", "--enable-uvicorn-access-log"], False, False),
])
def test_log_flags_are_real_settings(argv, stats_off, access_off):
    from ladle.server.api import uvicorn_config

    _, server = configs_from_args(parse_serve_args(serve_parser(), argv))
    assert server.disable_log_stats is stats_off and server.disable_uvicorn_access_log is access_off
    assert uvicorn_config(None, server).access_log is (not access_off)


@pytest.mark.parametrize("argv,expected", [
    ([], False), (["-ep"], True), (["--enable-expert-parallel"], True), (["--disable-expert-parallel"], False),
    (["-ep", "--no-enable-expert-parallel"], False),
])
def test_expert_parallel_short_alias_turns_it_on(argv, expected):
    """vLLM's `-ep` is an "on" alias (it once landed among the "off" spellings and turned expert parallel off)."""
    engine, _ = configs_from_args(parse_serve_args(serve_parser(), ["m", *argv]))
    assert engine.parallel.enable_expert_parallel is expected


def test_stream_interval_is_accepted_and_below_1_refused():
    from ladle.server.stream_chunks import stream_interval_refusals

    refusals, args = collect_refusals(serve_parser(), ["/m", "--stream-interval", "4"])
    assert refusals == [] and configs_from_args(args)[1].stream_interval == 4  # a vLLM flag ladle implements
    assert configs_from_args(collect_refusals(serve_parser(), ["/m"])[1])[1].stream_interval == 1
    assert stream_interval_refusals(1) == [] and stream_interval_refusals(16) == []
    assert stream_interval_refusals(0) == [
        "--stream-interval 0: tokens per streamed chunk must be an integer >= 1 (1 sends every token as it comes, "
        "vLLM's default)"]
    r = _ladle("serve", "/nonexistent/model", "--stream-interval", "0", "--port", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("error:") == 1
    assert "--stream-interval 0: tokens per streamed chunk must be an integer >= 1" in r.stderr


def test_port_outside_the_tcp_range_is_refused_before_loading():
    """`--port 99999` used to reach the socket bind and end in an OverflowError traceback."""
    r = _ladle("serve", "/nonexistent/model", "--port", "99999")
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("error:") == 1
    assert "--port 99999: a TCP port is 0-65535" in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is for CPU runs")
def test_cuda_only_flags_on_a_cpu_run_are_refused(m3_tiny):
    r = _ladle("serve", m3_tiny, "--gpu-memory-utilization", "0.5", "--cuda-graph-sizes=8", "--port", "1")
    assert r.returncode == 1 and r.stderr.count("error:") == 1, r.stderr
    assert "--gpu-memory-utilization: applies on CUDA only" in r.stderr and "--kv-cache-memory-bytes" in r.stderr
    assert "--cuda-graph-sizes: applies on CUDA only" in r.stderr


def test_an_unknown_flag_does_not_hide_the_other_refusals(m3_tiny):
    r = _ladle("serve", m3_tiny, "--no-such-flag", "--max-num-seqs", "0", "--tensor-parallel-size", "7", "--port", "1")
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "unrecognized arguments: --no-such-flag" in r.stderr and "--max-num-seqs" in r.stderr
    assert "--tensor-parallel-size 7 does not divide" in r.stderr
    # a stray value makes the parse untrustworthy: argparse's own error alone, as before
    r = _ladle("serve", m3_tiny, "stray-value", "--port", "1")
    assert r.returncode == 2 and "unrecognized arguments: stray-value" in r.stderr and "usage:" in r.stderr


def test_shortened_flags_are_not_accepted():
    """No argparse abbreviations: `--gpu-memory-util` would otherwise parse as --gpu-memory-utilization past the
    checks that match exact flag names (the CUDA-only refusal, the unsupported vLLM flags)."""
    refusals, args = collect_refusals(serve_parser(), ["--gpu-memory-util", "0.5"])
    assert any("unrecognized arguments: --gpu-memory-util" in r for r in refusals), refusals
