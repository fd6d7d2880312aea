"""The operator's console of `ladle serve`: progress and a startup summary in the log, Ctrl-C and SIGTERM end with
status 0 and no traceback (while serving and while starting), the open-files limit raised."""

from __future__ import annotations

import re
import signal
import time

import pytest

from ladle.cli import raise_open_files_limit
from ladle_serve_process import LadleServeProcess

resource = pytest.importorskip("resource")


def test_sigint_while_serving_exits_0_without_traceback(tmp_path):
    server = LadleServeProcess([], tmp_path / "serve.log").start()
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(timeout=60) == 0
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
    for stage in ("configuration accepted", "reading the model's config", "config resolved", "loading the tokenizer",
                  "loading weights", "weights loaded", "allocating the KV cache"):
        assert stage in log, stage
    summary = re.search(r"startup summary: weights [\d.]+ GiB \((\d+) bytes\); KV cache (\d+) tokens in (\d+) blocks "
                        r"of (\d+); max concurrency ([\d.]+)x at max_model_len (\d+); dtype float32, KV dtype float32; "
                        r"attention TORCH, moe torch, fused norms off, CUDA graphs none", log)
    assert summary, log
    weights, tokens, blocks, block, concurrency, max_len = (float(v) for v in summary.groups())
    # block 0 is the null block: the usable tokens (what the runner's KV log line says too) leave it out
    assert weights > 100e6 and tokens == (blocks - 1) * block and abs(concurrency - tokens / max_len) < 0.01


def test_sigterm_during_startup_exits_0_without_traceback(tmp_path):
    server = LadleServeProcess([], tmp_path / "serve.log")
    deadline = time.monotonic() + 60
    while "configuration accepted" not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "ladle.server: serving" not in log  # it stopped before serving


def test_open_files_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        raise_open_files_limit(wanted=4096)
        expected = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == expected
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_open_files_limit_below_the_floor_is_warned_about(caplog):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        with caplog.at_level("INFO", logger="ladle.cli"):
            raise_open_files_limit(wanted=300, warn_below=1000)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(300, hard)
        assert "open-files limit is 300" in caplog.text and "ulimit -Hn" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
