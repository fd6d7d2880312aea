"""Helpers behind the server fixtures: a `Server` handle and an in-thread uvicorn (free ports and the readiness
wait come from tests/ladle_serve_process.py)."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import httpx
import uvicorn

from fake_engine import FakeEngineClient
from ladle_serve_process import free_port, wait_ready as _wait_ready  # tests/ladle_serve_process.py, shared
from ladle.config import ServerConfig
from ladle.server.api import build_app

REAL_MAX_MODEL_LEN = 2048
REAL_MAX_BODY_BYTES = 8 << 20  # the 5 MB prompt of test_edge_validation must reach the tokenizer


@dataclass
class Server:
    kind: str  # "fake" | "real"
    base_url: str
    model: str
    max_model_len: int
    engine: Optional[FakeEngineClient] = None  # the fake's engine (None for the real server)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=kw.pop("timeout", 120), **kw)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: series name -> value (summed over label sets)."""
        out: dict[str, float] = {}
        for line in httpx.get(self.base_url + "/metrics").text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out


class _ThreadServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # not the main thread
        pass


def start_fake(engine: FakeEngineClient, api_key: Optional[str] = None, **server_config):
    """uvicorn serving `engine` on a free port, in a daemon thread. `server_config`: ServerConfig fields (limits).
    Returns (server, thread, base url); stop with `server.should_exit = True` and `thread.join()`."""
    port = free_port()
    app = build_app(engine, ServerConfig(port=port, api_key=api_key, **server_config))
    server = _ThreadServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_ready(f"http://127.0.0.1:{port}", timeout=30)
    return server, thread, f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def serving_fake(engine: FakeEngineClient) -> Iterator["Server"]:
    """start_fake(engine) as a Server for the duration of the block; stopped after it."""
    server, thread, url = start_fake(engine)
    try:
        yield Server("fake", url, engine.model_name, engine.max_model_len, engine)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


