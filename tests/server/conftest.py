"""Server fixtures.

`fake_server`: the real FastAPI app + uvicorn on 127.0.0.1, in a thread of this process, over FakeEngineClient
(fast; always runs). `real_server`: one session-scoped `python -m ladle serve` subprocess serving the default
SmolLM2 model (skipped only while `ladle.engine.async_engine` does not exist yet; LADLE_TEST_SERVER_URL reuses a
running server). `server` runs a test against both.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import httpx
import pytest

from fake_engine import FakeEngineClient
from harness import REAL_MAX_MODEL_LEN, Server, _wait_ready, free_port, start_fake


@pytest.fixture(scope="session")
def fake_server():
    engine = FakeEngineClient()
    server, thread, url = start_fake(engine)
    yield Server("fake", url, engine.model_name, engine.max_model_len, engine)
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="session")
def real_server(tmp_path_factory):
    if os.environ.get("LADLE_TEST_SERVER_URL"):  # reuse a running `ladle serve` (development)
        url = os.environ["LADLE_TEST_SERVER_URL"]
        model = httpx.get(url + "/v1/models").json()["data"][0]
        yield Server("real", url, model["id"], model["max_model_len"])
        return
    if importlib.util.find_spec("ladle.engine.async_engine") is None:
        pytest.skip("ladle.engine.async_engine is not written yet")
    port = free_port()
    log = open(tmp_path_factory.mktemp("serve") / "ladle-serve.log", "w+")
    cmd = [sys.executable, "-m", "ladle", "serve", "--port", str(port), "--max-model-len", str(REAL_MAX_MODEL_LEN),
           "--kv-cache-memory-bytes", "512M", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
    except Exception:
        proc.kill()
        log.seek(0)
        raise RuntimeError("`ladle serve` did not start; its log:\n" + log.read()[-5000:])
    model = httpx.get(url + "/v1/models").json()["data"][0]
    yield Server("real", url, model["id"], model["max_model_len"])
    proc.terminate()  # SIGTERM: uvicorn stops, the lifespan shuts the engine down, exit status 0
    try:
        status = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        status = "no exit within 30 s"
    log.seek(0)
    tail = log.read()[-3000:]
    log.close()
    assert status == 0, f"`ladle serve` did not exit cleanly on SIGTERM ({status}); log:\n{tail}"


@pytest.fixture(params=["fake", "real"])
def server(request) -> Server:
    return request.getfixturevalue(f"{request.param}_server")
