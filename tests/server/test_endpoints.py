"""Endpoint details checked against the fake engine (fast; exact values known in advance)."""

from __future__ import annotations

import contextlib
import os

import httpx
import pytest

from harness import start_fake
from fake_engine import SCRIPT, FakeEngineClient
from sse import completion_text, stream_events


@contextlib.contextmanager
def engine_state(engine: FakeEngineClient, **attrs):
    old = {k: getattr(engine, k) for k in attrs}
    for k, v in attrs.items():
        setattr(engine, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(engine, k, v)


def test_health_version_models(fake_server):
    with fake_server.client() as c:
        assert c.get("/health").status_code == 200
        with engine_state(fake_server.engine, healthy=False):
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == 503
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["message"]
        v = c.get("/version").json()
        assert v["version"] and v["engine_config"]["model"]["max_model_len"] == fake_server.max_model_len
        assert set(v["engine_config"]) >= {"model", "cache", "scheduler", "parallel", "runner"}
        m = c.get("/v1/models").json()
        assert m["object"] == "list" and m["data"][0]["id"] == "fake-model"
        assert m["data"][0]["max_model_len"] == fake_server.max_model_len
        assert c.get("/debug/dispatch").status_code == 200 and isinstance(c.get("/debug/dispatch").json(), dict)


def test_tokenize_detokenize(fake_server):
    with fake_server.client() as c:
        r = c.post("/tokenize", json={"prompt": "héllo"}).json()
        assert r["tokens"] == list("héllo".encode()) and r["count"] == 6
        assert r["max_model_len"] == fake_server.max_model_len
        r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert r["tokens"][0] == 256 and r["tokens"][-1] == ord("\n")  # <|im_start|> ... assistant\n
        assert c.post("/detokenize", json={"tokens": list("héllo".encode())}).json() == {"prompt": "héllo"}
        assert c.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
        assert c.post("/tokenize", json={}).status_code == 400


def test_metrics_names(fake_server):
    with fake_server.client() as c:
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        text = c.get("/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_sum", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "ladle:num_free_blocks", "ladle:num_total_blocks"]:
        assert f"\n{name}{{" in text, name
    assert 'model_name="fake-model"' in text
    m = fake_server.metrics()
    assert m["vllm:e2e_request_latency_seconds_count"] >= 1 and m["vllm:generation_tokens_total"] >= 3


def test_metrics_have_no_created_series(server):
    """No `*_created` series (prometheus_client's creation timestamps of counters and histograms), as in vLLM's
    /metrics; the counters and histograms themselves are there, with their values."""
    with server.client() as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0}).status_code == 200
        text = c.get("/metrics").text
    assert [line for line in text.splitlines() if "_created" in line] == []
    assert "# TYPE vllm:generation_tokens_total counter" in text and "# TYPE vllm:request_success_total counter" in text
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
    for name in ["vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_generation_tokens_sum",
                 "vllm:iteration_tokens_total_count"]:
        assert f"\n{name}{{" in text, name
    m = server.metrics()
    assert m["vllm:e2e_request_latency_seconds_count"] >= 1 and m["vllm:request_generation_tokens_sum"] >= 2


def test_request_id_header_is_echoed_not_used(fake_server):
    with fake_server.client() as c:
        r = c.post("/v1/completions", headers={"X-Request-Id": "client-42"}, json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-request-id"] == "client-42"
        with c.stream("POST", "/v1/completions", headers={"X-Request-Id": "client-43"},
                      json={"prompt": "hi", "max_tokens": 2, "stream": True}) as s:
            assert s.headers["x-request-id"] == "client-43"
            s.read()
    assert not {"client-42", "client-43"} & set(fake_server.engine.seen_ids)
    assert all(i.startswith("cmpl-") for i in fake_server.engine.seen_ids)


def test_api_key():
    engine = FakeEngineClient()
    server, thread, url = start_fake(engine, api_key="sekret")
    try:
        with httpx.Client(base_url=url) as c:
            r = c.get("/v1/models")
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
            assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert engine.healthy is False  # the lifespan shut the engine down


def test_batch_prompts_and_echo(fake_server):
    with fake_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": ["A", "B"], "n": 2, "max_tokens": 3, "temperature": 0,
                                            "echo": True}).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3]
        assert [ch["text"] for ch in r["choices"]] == ["A" + SCRIPT[:3]] * 2 + ["B" + SCRIPT[:3]] * 2
        assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 12, "total_tokens": 14,
                              "prompt_tokens_details": {"cached_tokens": 0}}
        _, events = stream_events(c, "/v1/completions", {"prompt": [[72, 105], [66]], "max_tokens": 3,
                                                         "temperature": 0, "stream": True})
        assert completion_text(events, 0) == SCRIPT[:3] and completion_text(events, 1) == SCRIPT[:3]
        assert c.post("/v1/completions", json={"prompt": [[1, 2], [10**6]]}).status_code == 400


def test_request_rejected_is_400_before_sse(fake_server):
    msg = "request needs 5000 blocks but the pool has 1000"
    with engine_state(fake_server.engine, reject_message=msg), fake_server.client() as c:
        for stream in (False, True):
            for path, body in (("/v1/completions", {"prompt": "hi"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
                with c.stream("POST", path, json={**body, "stream": stream, "max_tokens": 4}) as r:
                    raw = r.read().decode()
                assert r.status_code == 400 and not raw.startswith("data:") and msg in raw


def test_engine_error_mid_request(fake_server):
    with engine_state(fake_server.engine, fail_after=3), fake_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10})
        assert r.status_code == 500 and "fake step failure" in r.json()["error"]["message"]
        status, events = stream_events(c, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                   "max_tokens": 10, "stream": True})
        assert status == 200 and "fake step failure" in events[-1]["error"]["message"]
    with fake_server.client() as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "top_p": 0},
    {"prompt": "hi", "logprobs": 21},
    {"prompt": "hi", "suffix": "x"},
    {"prompt": "hi", "max_tokens": -1},
    {"prompt": "hi", "min_tokens": 5, "max_tokens": 2},
    {"prompt": "hi", "stop": [""]},
    {"prompt": "hi", "best_of": 3},
    {"prompt": "hi", "logit_bias": {"5": 1.0}},
])
def test_invalid_sampling_is_400(fake_server, body):
    with fake_server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_chat_fields(fake_server):
    with fake_server.client() as c:
        base = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3,
                "temperature": 0}
        r = c.post("/v1/chat/completions", json={**base, "chat_template_kwargs": {"enable_thinking": False},
                                                 "skip_special_tokens": False, "stop_token_ids": [5]}).json()
        msg = r["choices"][0]["message"]
        assert msg["content"] == SCRIPT[:3] and msg["tool_calls"] == [] and "reasoning_content" in msg
        assert c.post("/v1/chat/completions", json={**base, "top_logprobs": 2}).status_code == 400
        too_many = c.post("/v1/chat/completions", json={**base, "logprobs": True, "top_logprobs": 50})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "top_logprobs"
        assert c.post("/v1/chat/completions", json={**base, "messages": []}).status_code == 400
        forced = c.post("/v1/chat/completions", json={**base, "tool_choice": "required",
                                                      "tools": [{"type": "function", "function": {"name": "f"}}]})
        assert forced.status_code == 400 and forced.json()["error"]["param"] == "tool_choice"
        img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        r = c.post("/v1/chat/completions", json={**base, "messages": img})
        assert r.status_code == 400 and "not supported yet" in r.json()["error"]["message"]


SIGTERM_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import types
from fake_engine import FakeEngineClient
from ladle.config import EngineConfig, ServerConfig
from ladle.server.api import run_server

engine = FakeEngineClient()
original_shutdown = engine.shutdown

async def shutdown():
    await original_shutdown()
    print("ENGINE SHUT DOWN", flush=True)

engine.shutdown = shutdown
fake_module = types.SimpleNamespace(AsyncEngine=types.SimpleNamespace(from_config=lambda config: engine))
sys.modules["ladle.engine.async_engine"] = fake_module  # run_server imports AsyncEngine from here
sys.exit(run_server(EngineConfig(), ServerConfig(port={port}, log_level="warning")))
"""


def test_sigterm_exits_cleanly(tmp_path):
    """`run_server` under SIGTERM: graceful uvicorn shutdown, engine shut down in the lifespan, status 0."""
    import signal
    import subprocess
    import sys

    from harness import _wait_ready, free_port

    port = free_port()
    script = SIGTERM_SCRIPT.format(here=os.path.dirname(os.path.abspath(__file__)), port=port)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc, timeout=120)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "ENGINE SHUT DOWN" in out, out
