"""Issue 17's cases, one test each: bad input is a 400 (413 for the body size) naming the field, the keep-alive
connection survives every error, tokenization never stalls the event loop, and a failure while preparing one
request fails that request alone."""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time

import httpx
import pytest

from fake_engine import FakeEngineClient, FakeTokenizer
from harness import Server, start_fake

BIG_PROMPT_BYTES = 5 * 10 ** 6
CHAT = "/v1/chat/completions"


def _post(client: httpx.Client, path: str, body) -> httpx.Response:
    """JSON as Python writes it (lone surrogates escaped, NaN / Infinity literals), which httpx's `json=` refuses."""
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def _assert_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    for internal in ("Traceback", "codec", "TypeError") + (("internal error",) if status < 500 else ()):
        assert internal not in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def _user(content) -> list:
    return [{"role": "user", "content": content}]


# (path, body without "model", the param the 400 must name)
BAD = [
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options"),  # accepted by the schema, never honoured: refused
    (CHAT, {"messages": _user("hi"), "echo": True}, "echo"),
    ("/v1/completions", {"prompt": ["ok", "a\udfffb"]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "a", "stop": ["ok", "\ud800"]}, "stop[1]"),
    ("/v1/completions", {"prompt": "a", "suffix": "\ud800"}, "suffix"),
    ("/v1/completions", {"prompt": "a", "model": "\ud800"}, "model"),
    ("/v1/completions", {"prompt": "a", "temperature": math.nan}, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": math.inf}, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": 1e308}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": math.nan}, "top_p"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": -math.inf}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": math.nan}, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "top_p": 0.0}, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 1000}, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": ["a"] * 257}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": ["x"] * 65}, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["x" * 1025]}, "stop"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [2 ** 64]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [2 ** 70]}, "prompt"),
    (CHAT, {"messages": _user([{"type": "text", "text": "\ud800"}])}, "messages[0].content[0].text"),
    (CHAT, {"messages": _user("\udc00")}, "messages[0].content"),
    (CHAT, {"messages": _user([[{"type": "text", "text": "x"}]])}, "messages[0].content"),
    (CHAT, {"messages": _user([{"type": "image_url", "image_url": {"url": "x"}}])}, "messages[0].content[0].type"),
    (CHAT, {"messages": _user(None)}, "messages[0].content"),  # OpenAI: content is required
    (CHAT, {"messages": [{"role": "system"}] + _user("hi")}, "messages[0].content"),
    (CHAT, {"messages": _user("hi") + [{"role": "assistant", "content": None}]}, "messages[1].content"),
    (CHAT, {"messages": _user("hi") + [{"role": "tool", "content": None, "tool_call_id": "c"}]}, "messages[1].content"),
    (CHAT, {"messages": _user("hi"), "tools": [{"type": "function", "function": {"name": "\ud800"}}]},
     "tools[0].function.name"),
    (CHAT, {"messages": _user("hi"), "chat_template_kwargs": {"x": "\ud800"}}, "chat_template_kwargs.x"),
    (CHAT, {"messages": _user("hi"), "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    (CHAT, {"messages": _user("hi"), "temperature": math.nan}, "temperature"),
    (CHAT, {"messages": _user("hi"), "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"messages": _user("hi"), "n": 129}, "n"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": _user("\ud800")}, "messages[0].content"),
    ("/tokenize", {"messages": _user(None)}, "messages[0].content"),
    ("/detokenize", {"tokens": [2 ** 70]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p}:{json.dumps(b)[:60]}" for p, b, _ in BAD])
def test_bad_input_is_400_naming_the_field(server, path, body, param):
    with server.client() as c:
        _assert_error(_post(c, path, body), 400, param)
        # The same keep-alive client goes on: the next request is served normally.
        r = _post(c, "/v1/completions", {"prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_assistant_content_may_be_null_beside_tool_calls(fake_server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = _user("hi") + [{"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    with fake_server.client() as c:
        r = _post(c, CHAT, {"messages": messages, "max_tokens": 2})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_400_naming_the_header(server, content_type):
    """`curl -d` without `-H 'Content-Type: application/json'` sends a form type: the answer says what to send."""
    body = json.dumps({"prompt": "ok", "max_tokens": 2}).encode()
    with server.client() as c:
        r = c.post("/v1/completions", content=body, headers={"content-type": content_type} if content_type else {})
        err = _assert_error(r, 400)
        assert "must be JSON sent with the header Content-Type: application/json" in err["message"], err
        assert (content_type or "has no Content-Type") in err["message"] and "valid dictionary" not in err["message"]
        ok = c.post("/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200, ok.text


def test_tiny_temperature_is_raised_to_the_floor(fake_server):
    with fake_server.client() as c:
        r = _post(c, "/v1/completions", {"prompt": "a", "max_tokens": 2, "temperature": 1e-40, "seed": 1})
        assert r.status_code == 200, r.text


@pytest.fixture
def small_body_server():
    engine = FakeEngineClient()
    server, thread, url = start_fake(engine, max_request_body_bytes=1000)
    yield Server("fake", url, engine.model_name, engine.max_model_len, engine)
    server.should_exit = True
    thread.join(timeout=10)


def test_oversized_body_is_413_before_parsing(small_body_server):
    with small_body_server.client() as c:
        err = _assert_error(_post(c, "/v1/completions", {"prompt": "x" * 2000}), 413)
        assert "--max-request-body-bytes" in err["message"]
        ok = _post(c, "/v1/completions", {"prompt": "x" * 100, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        # No Content-Length (chunked upload): counted while reading, refused at the first byte over the limit.
        chunks = (b'{"prompt": "' + b"x" * 600, b"x" * 600 + b'"}')
        r = c.post("/v1/completions", content=iter(chunks), headers={"content-type": "application/json"})
        _assert_error(r, 413)
        assert _post(c, "/v1/completions", {"prompt": "y", "max_tokens": 2}).status_code == 200


class _FailingTokenizer(FakeTokenizer):
    """Raises an unexpected exception on the prompt "boom" (a tokenizer bug that slipped through the checks)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text == "boom":
            raise RuntimeError("tokenizer internals exploded")
        return super().encode(text, add_special_tokens)


def test_preparation_failure_fails_that_request_alone(caplog):
    engine = FakeEngineClient()
    engine.tokenizer = _FailingTokenizer()
    server, thread, url = start_fake(engine)
    try:
        with httpx.Client(base_url=url, timeout=60) as c, caplog.at_level(logging.ERROR, logger="ladle.server"):
            for stream in (False, True):
                err = _assert_error(_post(c, "/v1/completions", {"prompt": "boom", "stream": stream}), 500)
                assert "exploded" not in err["message"] and "RuntimeError" not in err["message"]
                error_id = err["message"].split("(id ", 1)[1].split(")", 1)[0]
                lines = [r for r in caplog.records if error_id in r.getMessage()]
                assert len(lines) == 1 and lines[0].exc_info is not None  # logged once, with the traceback
                r = _post(c, "/v1/completions", {"prompt": "fine", "max_tokens": 2})
                assert r.status_code == 200, r.text
        assert len(engine.seen_ids) == 2  # only the two good requests ever reached the engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_unhandled_exception_is_500_and_the_connection_survives(caplog):
    engine = FakeEngineClient()
    server, thread, url = start_fake(engine)
    calls = []

    def is_healthy_failing_once() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("health check exploded")
        return True

    engine.is_healthy = is_healthy_failing_once
    try:
        with httpx.Client(base_url=url, timeout=60) as c, caplog.at_level(logging.ERROR, logger="ladle.server"):
            err = _assert_error(c.get("/health"), 500)
            assert "exploded" not in err["message"]
            error_id = err["message"].split("(id ", 1)[1].split(")", 1)[0]
            assert len([r for r in caplog.records if error_id in r.getMessage()]) == 1
            assert c.get("/health").status_code == 200  # same client, next request
            assert _post(c, "/v1/completions", {"prompt": "fine", "max_tokens": 2}).status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class _SlowTokenizer(FakeTokenizer):
    """Takes 2 s over a prompt of a megabyte or more (sleeping, as a tokenizer that releases the GIL does), then
    returns more tokens than the fake model's context holds."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= 10 ** 6:
            time.sleep(2.0)
            return [97] * 5000
        return super().encode(text, add_special_tokens)


def _metrics_latency_during(base_url: str, body: bytes) -> tuple[httpx.Response, list[float], list[float]]:
    """(response to `body`, idle /metrics latencies, /metrics latencies while `body` was in flight)."""
    def timed_get(client: httpx.Client) -> float:
        t0 = time.perf_counter()
        assert client.get("/metrics").status_code == 200
        return time.perf_counter() - t0

    result: dict = {}
    with httpx.Client(base_url=base_url, timeout=120) as poll:
        idle = [timed_get(poll) for _ in range(10)]

        def send() -> None:
            with httpx.Client(base_url=base_url, timeout=120) as big:
                result["response"] = big.post("/v1/completions", content=body,
                                              headers={"content-type": "application/json"})

        sender = threading.Thread(target=send)
        sender.start()
        during = []
        while sender.is_alive():
            during.append(timed_get(poll))
            time.sleep(0.02)
        sender.join()
    return result["response"], idle, during


def _assert_responsive(r: httpx.Response, idle: list[float], during: list[float], bound: float = 0.2) -> None:
    _assert_error(r, 400)  # tokenized in full, then refused by the context-length check
    assert "maximum context length" in r.json()["error"]["message"]
    # The bound, 200 ms, on top of what /metrics takes on this (possibly loaded) machine when idle.
    assert max(during) - statistics.median(idle) < bound, (max(during), sorted(during)[-5:], statistics.median(idle))
    assert len(during) >= 10, f"the request ended too soon to measure anything: {len(during)} polls"


def test_long_tokenization_does_not_block_the_loop_fake():
    engine = FakeEngineClient()
    engine.tokenizer = _SlowTokenizer()
    server, thread, url = start_fake(engine, max_request_body_bytes=8 << 20)
    try:
        body = json.dumps({"prompt": "x" * BIG_PROMPT_BYTES, "max_tokens": 1}).encode()
        # The fake server runs in this test's process, so the 5 MB upload, its JSON parse and the polling client share
        # one GIL: on a loaded machine a poll can wait ~0.4 s on that alone (seen 2026-12-01). A loop blocked by the
        # 2 s tokenization shows >= 2 s, so 1 s still tells the two apart; the 200 ms is gated by the real
        # server (its own process) below.
        _assert_responsive(*_metrics_latency_during(url, body), bound=1.0)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_five_megabyte_prompt_does_not_block_the_loop_real(real_server):
    """The real tokenizer over a 5 MB prompt (about 1.4 M tokens, seconds of work) while /metrics is polled."""
    body = json.dumps({"prompt": "hello world, this is a test. " * (BIG_PROMPT_BYTES // 29),
                       "max_tokens": 1}).encode()
    _assert_responsive(*_metrics_latency_during(real_server.base_url, body))
    with real_server.client() as c:
        assert c.get("/health").status_code == 200
