"""The operator's console of `ladle serve`: progress and a startup summary in the log, Ctrl-C and SIGTERM end with
status 0 and no traceback (while serving and while starting), the open-files limit raised."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
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
    try:
        deadline = time.monotonic() + 60
        while "configuration accepted" not in server.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "ladle.server: serving" not in log  # it stopped before serving


# A stand-in for startup code that loses the KeyboardInterrupt of `ladle serve`'s SIGTERM handler: {body} runs after
# the handlers are installed and "ready" is printed; the grace period is {grace} s.
_LOSES_THE_INTERRUPT = """
import logging, sys, time
import ladle.cli as cli
logging.basicConfig(level=logging.INFO)
cli.STARTUP_STOP_GRACE_S = {grace}
cli.install_stop_handlers()
try:
    print("ready", flush=True)
{body}
except KeyboardInterrupt:
    cli._exit_now(3)  # not the path under test
"""


def _run_losing_the_interrupt(tmp_path, body: str, grace: float):
    """Start the stand-in, SIGTERM it once it is ready; returns (exit status, seconds from the signal, output)."""
    script = tmp_path / "loses.py"
    script.write_text(_LOSES_THE_INTERRUPT.format(grace=grace, body=body))
    log_path = tmp_path / "loses.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "ready" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # well inside the loop
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=60)
        return status, time.monotonic() - start, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_swallowed_by_startup_code_still_stops_within_the_grace(tmp_path):
    body = ("    while True:\n        try:\n            time.sleep(0.05)\n"
            "        except BaseException:  # a bare except: in library code\n            pass\n")
    status, seconds, out = _run_losing_the_interrupt(tmp_path, body, grace=2.0)
    assert status == 0 and 2.0 <= seconds < 10.0, (status, seconds, out)
    assert "had not stopped 2 s after the signal" in out and "Traceback" not in out, out


def test_sigterm_inside_a_finalizer_stops_at_once_without_traceback(tmp_path):
    # the signal arrives while a __del__ sleeps: Python cannot raise the interrupt there ("Exception ignored")
    body = ("    class Slow:\n        def __del__(self):\n            time.sleep(0.2)\n"
            "    while True:\n        Slow()\n")
    status, seconds, out = _run_losing_the_interrupt(tmp_path, body, grace=60.0)
    assert status == 0 and seconds < 10.0, (status, seconds, out)
    assert "ladle serve: stopped" in out and "Traceback" not in out and "Exception ignored" not in out, out


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
