"""`ladle serve --tensor-parallel-size 2` end to end (CPU, gloo): the openai client gets the TP = 1 text, streaming
and not; the failure model: a killed rank turns /health to 503 within 2 s and ends the open stream with an error,
SIGTERM stops the server, and no process of it remains (checked through the process table).
One TP server for the module (the killed-worker test runs last and takes it down)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import psutil
import pytest

from ladle.core.sampling_params import SamplingParams
from ladle.engine.llm import LLM
from ladle.tools.checkpoint_m3 import make_checkpoint
from ladle_serve_process import LadleServeProcess

ENGINE = dict(load_format="dummy", max_model_len=256, kv_cache_memory_bytes=4 << 20)
PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("m3tp") / "tiny"), "tiny", config_only=True)


@pytest.fixture(scope="module")
def tp_server(m3_dir, tmp_path_factory):
    args = [m3_dir, "--tensor-parallel-size", "2", "--load-format", "dummy", "--max-model-len", "256",
            "--kv-cache-memory-bytes", str(4 << 20)]
    server = LadleServeProcess(args, tmp_path_factory.mktemp("log") / "serve.log").start()
    yield server
    if server.proc.poll() is None:
        server.stop()


@pytest.fixture(scope="module")
def tp1_text(m3_dir) -> str:
    llm = LLM(m3_dir, **ENGINE)
    return llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_tp2_server_answers_like_tp1(tp_server, tp1_text):
    client = _client(tp_server)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0)
    assert done.choices[0].text == tp1_text
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == tp1_text
    assert "rank 1" in tp_server.log_tail(20000) and "KV cache" in tp_server.log_tail(20000)


def test_killed_worker_health_503_stream_error_and_no_orphans(tp_server):
    server = psutil.Process(tp_server.proc.pid)
    family = [server] + server.children(recursive=True)
    # spawned ranks run `python -c "from multiprocessing.spawn import spawn_main; ..."`; with the engine core in its
    # own process (`--engine-core-process`, the default) they are its children, otherwise the server's
    spawned = [p for p in family if "spawn_main" in " ".join(p.cmdline())]
    ranks = [p for p in spawned if p.ppid() != server.pid] or spawned
    assert len(ranks) == 2, [p.cmdline() for p in family]
    client = _client(tp_server)
    model = client.models.list().data[0].id
    outcome: dict = {}

    def stream_long() -> None:
        try:
            for _ in client.completions.create(model=model, prompt=PROMPT, max_tokens=200, temperature=0.0,
                                               stream=True):
                outcome.setdefault("first", time.monotonic())
            outcome["ended"] = "normally"
        except Exception as e:  # noqa: BLE001 — the error is what this test expects
            outcome["ended"] = f"error: {e}"

    t = threading.Thread(target=stream_long, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while "first" not in outcome and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks[1].kill()
    killed_at = time.monotonic()
    status = None
    while time.monotonic() - killed_at < 2.0:
        status = httpx.get(tp_server.url + "/health", timeout=1).status_code
        if status == 503:
            break
        time.sleep(0.05)
    assert status == 503, f"/health still {status} 2 s after a rank died"
    t.join(30)
    assert outcome.get("ended", "").startswith("error"), outcome  # the open stream ends with an error, no hang
    assert tp_server.stop() == 0
    time.sleep(0.5)
    left = [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes of the server still running: {left}"
