"""Server fixtures.

`fake_server`: the real FastAPI app + uvicorn on 127.0.0.1, in a thread of this process, over FakeEngineClient
(fast; always runs). `real_server`: one session-scoped `python -m ladle serve` subprocess serving the default
SmolLM2 model (skipped only while `ladle.engine.async_engine` does not exist yet; LADLE_TEST_SERVER_URL reuses a
running server). `server` runs a test against both.
"""

from __future__ import annotations

import importlib.util
import os

import httpx
import pytest

from fake_engine import FakeEngineClient
from harness import REAL_MAX_BODY_BYTES, REAL_MAX_MODEL_LEN, Server, serving_fake
from ladle_serve_process import LadleServeProcess


@pytest.fixture(scope="session")
def fake_server():
    with serving_fake(FakeEngineClient()) as server:
        yield server


@pytest.fixture(scope="session")
def real_server(tmp_path_factory):
    if os.environ.get("LADLE_TEST_SERVER_URL"):  # reuse a running `ladle serve` (development)
        url = os.environ["LADLE_TEST_SERVER_URL"]
        model = httpx.get(url + "/v1/models").json()["data"][0]
        yield Server("real", url, model["id"], model["max_model_len"])
        return
    if importlib.util.find_spec("ladle.engine.async_engine") is None:
        pytest.skip("ladle.engine.async_engine is not written yet")
    serve = LadleServeProcess(["--max-model-len", str(REAL_MAX_MODEL_LEN), "--kv-cache-memory-bytes", "512M",
                               "--max-request-body-bytes", str(REAL_MAX_BODY_BYTES)],
                              tmp_path_factory.mktemp("serve") / "ladle-serve.log").start()
    model = httpx.get(serve.url + "/v1/models").json()["data"][0]
    yield Server("real", serve.url, model["id"], model["max_model_len"])
    status = serve.stop()  # SIGTERM: uvicorn stops, the lifespan shuts the engine down, exit status 0
    assert status == 0, f"`ladle serve` did not exit cleanly on SIGTERM ({status}); log:\n{serve.log_tail(3000)}"


@pytest.fixture(params=["fake", "real"])
def server(request) -> Server:
    return request.getfixturevalue(f"{request.param}_server")
