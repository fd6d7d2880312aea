"""The `ladle` command line: generated flags, vLLM flags not supported yet, README and CI consistency."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from ladle.cli import serve_parser
from ladle.cli_args import (configs_from_args, config_fields, flags_markdown, human_readable_int, load_vllm_flags,
                            parse_serve_args, vllm_flags_version)
from ladle.config import COMPONENTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ladle", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_unsupported_vllm_flag_subprocess():
    r = _run("serve", "--swap-space", "4")
    assert r.returncode == 2
    assert "not supported yet: --swap-space" in r.stderr and "usage:" not in r.stderr
    r = _run("serve", "--enable-lora")
    assert r.returncode == 2 and "not supported yet: --enable-lora" in r.stderr
    r = _run("serve", "--no-such-flag-anywhere")  # not a vLLM flag: argparse's own error
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


@pytest.mark.parametrize("argv,flag", [
    # (--quantization / -q were the examples here until `--quantization fp8` landed: ladle/quant/config.py)
    (["--pipeline-parallel-size=2"], "--pipeline-parallel-size"), (["-pp", "2"], "-pp"),
    (["--enable-sleep-mode"], "--enable-sleep-mode"),  # (--async-scheduling was the example until it landed)
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"),
    (["m.gguf", "--speculative-config", "{}"], "--speculative-config"),
])
def test_unsupported_forms(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_serve_args(serve_parser(), argv)
    assert e.value.code == 2
    assert f"not supported yet: {flag} " in capsys.readouterr().err


def test_flags_build_configs():
    args = parse_serve_args(serve_parser(), [
        "model.gguf", "--max-model-len", "1k", "--kv-cache-memory-bytes", "2G", "--no-enable-prefix-caching",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--block-size", "32", "--dtype", "bfloat16",
        "--gpu-memory-utilization", "0.5", "--seed", "7", "--load-format", "dummy", "--hf-overrides", '{"a": 1}',
        "--enforce-eager", "-tp", "1", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k",
        "--served-model-name", "m"])
    engine, server = configs_from_args(args)
    assert engine.model.model == "model.gguf" and engine.model.max_model_len == 1000
    assert engine.cache.kv_cache_memory_bytes == 2 * 2**30 and engine.cache.enable_prefix_caching is False
    assert engine.cache.block_size == 32 and engine.cache.gpu_memory_utilization == 0.5
    assert engine.scheduler.max_num_seqs == 8 and engine.scheduler.max_num_batched_tokens == 64
    assert engine.model.dtype == "bfloat16" and engine.model.seed == 7 and engine.model.load_format == "dummy"
    assert engine.model.hf_overrides == '{"a": 1}' and engine.runner.enforce_eager is True
    assert engine.model.served_model_name == "m"
    assert (server.host, server.port, server.api_key) == ("0.0.0.0", 9000, "k")
    default_engine, default_server = configs_from_args(parse_serve_args(serve_parser(), []))
    assert default_server.host == "127.0.0.1" and default_server.port == 8000
    assert default_engine == type(default_engine)(**{c: cls() for c, cls in COMPONENTS.items()})


def test_human_readable_int():
    assert [human_readable_int(v) for v in ("123", "1k", "1K", "25.6k", "2M", "1g")] == \
        [123, 1000, 1024, 25600, 2 * 2**20, 10**9]
    with pytest.raises(Exception):
        human_readable_int("1.5K")


def test_vllm_flag_list():
    flags = load_vllm_flags()
    assert vllm_flags_version().startswith("vLLM 0.")
    assert len(flags) > 150 and flags["-tp"] == "--tensor-parallel-size" and "--no-enable-prefix-caching" in flags
    ours = {f.metadata["flag"] for _, f in config_fields() if f.metadata["flag"].startswith("--")}
    # The flags are vLLM's names, so each one is in vLLM's list.
    for flag in ["--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--gpu-memory-utilization", "--kv-cache-memory-bytes",
                 "--dtype", "--seed", "--api-key", "--load-format", "--enable-prefix-caching", "--hf-overrides",
                 "--enforce-eager"]:
        assert flag in flags and flag in ours, flag
    for comp, f in config_fields():
        assert f.metadata["help"], (comp, f.name)
    assert all(dataclasses.fields(cls) for cls in COMPONENTS.values())


def test_readme_and_ci():
    readme = open(os.path.join(ROOT, "README.md")).read()
    commands = [line for line in readme.split("```")[1].splitlines() if line.startswith("python3 ")]
    assert len(commands) == 2
    assert commands[0].endswith(".venv/bin/ladle serve") and "-c constraints.txt" in commands[0]
    assert commands[1].endswith("pytest -q --durations=15 tests") and '".[test]"' in commands[1]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "set -euo pipefail" in ci and commands[1] in ci.splitlines()
    table = readme.split("<!-- flags:start -->\n", 1)[1].split("\n<!-- flags:end -->", 1)[0]
    assert table == flags_markdown(), "README flags table is stale: regenerate it from ladle.cli_args.flags_markdown"


def test_subcommands():
    r = _run("--help")
    assert r.returncode == 0 and "serve" in r.stdout and "make-checkpoint" in r.stdout
    r = _run("make-checkpoint", "gpt9")
    assert r.returncode != 0 and "unknown family" in r.stderr
    r = _run("nonsense")
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_startup_error_is_a_message_not_a_traceback():
    r = _run("serve", "/nonexistent/model.gguf", "--port", "1")
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_no_op_vllm_flags_are_accepted_with_a_note(capsys):
    args = parse_serve_args(serve_parser(), ["--enable-chunked-prefill", "--trust-remote-code",
                                             "--disable-log-requests", "--max-num-seqs", "8"])
    engine, _ = configs_from_args(args)
    assert engine.scheduler.max_num_seqs == 8
    err = capsys.readouterr().err
    assert "ignoring --enable-chunked-prefill" in err and "ignoring --trust-remote-code" in err
    with pytest.raises(SystemExit):  # turning chunked prefill off is a real change: still refused
        parse_serve_args(serve_parser(), ["--enable-chunked-prefill=false"])


def test_busy_port_fails_before_loading_the_model(tmp_path):
    import socket

    from ladle.tools.checkpoint_m3 import make_checkpoint

    # config.json only, no weight files: the command line passes its checks (the model's config is read up front),
    # and had the model been loaded before the bind, the error would be about the missing weights.
    model = make_checkpoint(str(tmp_path / "tiny"), "tiny", config_only=True)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = _run("serve", model, "--port", str(port))
    assert r.returncode == 1 and "cannot listen on 127.0.0.1:" in r.stderr and "safetensors" not in r.stderr, \
        r.stderr


def test_make_checkpoint_help_says_what_it_writes(capsys):
    from ladle import cli
    from ladle.tools.checkpoint_m3 import PRESET_USE

    assert cli.main(["make-checkpoint", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--from-gguf GGUF --config-only OUT" in out and "synthetic MiniMax-M3 checkpoint" in out
    for preset in PRESET_USE:
        assert f"  {preset}: " in out and "layers, hidden" in out


def test_generate_help_has_no_server_flags():
    r = _run("generate", "--help")
    assert r.returncode == 0 and "--max-model-len" in r.stdout
    assert "--port" not in r.stdout and "--api-key" not in r.stdout and "--served-model-name" not in r.stdout
    assert "(default: the model's) (default: None)" not in _run("serve", "--help").stdout
