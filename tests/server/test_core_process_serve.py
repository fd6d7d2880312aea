"""`ladle serve` with the engine core in its own process (the default), checked through the process table: SIGTERM
and SIGINT exit 0 with no traceback and leave no process behind; a killed core turns /health to 503 within 2 s,
ends the open stream with an error, and the server still stops cleanly. `--no-engine-core-process` keeps the core
on a thread of the server (no child process). Tiny MiniMax-M3 config with dummy weights (starts in seconds)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest

from ladle.tools.checkpoint_m3 import make_checkpoint
from ladle_serve_process import LadleServeProcess


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("m3serve") / "tiny"), "tiny", config_only=True)


def _serve(m3_dir: str, log, *extra: str) -> LadleServeProcess:
    return LadleServeProcess([m3_dir, "--load-format", "dummy", "--max-model-len", "256",
                              "--kv-cache-memory-bytes", str(4 << 20), *extra], log).start()


def _family(server: LadleServeProcess) -> list[psutil.Process]:
    root = psutil.Process(server.proc.pid)
    return [root] + root.children(recursive=True)


def _cores(server: LadleServeProcess) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]


def _left(family: list[psutil.Process]) -> list[int]:
    time.sleep(0.5)
    return [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _complete(server: LadleServeProcess, **body) -> httpx.Response:
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    return httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "the quick brown fox",
                                                           "temperature": 0.0, **body}, timeout=60)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_0_without_orphans(m3_dir, tmp_path, sig):
    server = _serve(m3_dir, tmp_path / "serve.log")
    assert len(_cores(server)) == 1
    assert _complete(server, max_tokens=4).status_code == 200
    family = _family(server)
    server.proc.send_signal(sig)
    assert server.proc.wait(timeout=60) == 0
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
    assert not _left(family), f"processes of the server still running; log:\n{log[-3000:]}"


def test_killed_core_health_503_stream_error_clean_exit(m3_dir, tmp_path):
    server = _serve(m3_dir, tmp_path / "serve.log")
    family = _family(server)
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    outcome: dict = {}

    def stream_long() -> None:
        body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 200, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    outcome.setdefault("first", time.monotonic())
                    if '"error"' in line:
                        outcome["ended"] = "error"
            outcome.setdefault("ended", "normally")

    t = threading.Thread(target=stream_long, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while "first" not in outcome and time.monotonic() < deadline:
        time.sleep(0.02)
    _cores(server)[0].kill()
    killed_at, status = time.monotonic(), None
    while time.monotonic() - killed_at < 2.0:
        status = httpx.get(server.url + "/health", timeout=1).status_code
        if status == 503:
            break
        time.sleep(0.05)
    assert status == 503, f"/health still {status} 2 s after the core died"
    t.join(30)
    assert outcome.get("ended") == "error", outcome
    assert _complete(server, max_tokens=2).status_code in (500, 503)
    assert server.stop() == 0
    assert not _left(family)


def test_no_engine_core_process_keeps_the_thread(m3_dir, tmp_path):
    server = _serve(m3_dir, tmp_path / "serve.log", "--no-engine-core-process")
    assert _cores(server) == []
    assert _complete(server, max_tokens=4).status_code == 200
    assert server.stop() == 0


def test_integers_beyond_64_bits_are_a_400_not_a_500(m3_dir, tmp_path):
    """msgspec carries 64-bit integers to the core process: a wider seed / top_k / min_tokens is refused at the edge
    with a 400 naming the field (it was a 500 from the encoder in this layout, a 200 with the core on a thread), and
    the server goes on serving."""
    server = _serve(m3_dir, tmp_path / "serve.log")
    try:
        for field, value in (("seed", 99999999999999999999999), ("seed", -9223372036854775809),
                             ("top_k", 1180591620717411303424), ("min_tokens", 2**64)):
            for stream in (False, True):
                r = _complete(server, max_tokens=4, stream=stream, **{field: value})
                assert r.status_code == 400, (field, stream, r.text)
                assert field in r.json()["error"]["message"], r.text
        assert _complete(server, max_tokens=4, seed=2**63 - 1).status_code == 200
    finally:
        server.stop()
