"""Request fields ladle used to accept and drop, one test each: `add_special_tokens` on /tokenize with `messages`,
`parallel_tool_calls` on chat completions; and the 413 body's shape."""

from __future__ import annotations

import json

import pytest

from fake_engine import IM_START, FakeEngineClient, FakeTokenizer
from harness import Server, start_fake


class _BosTokenizer(FakeTokenizer):
    """FakeTokenizer that puts a BOS (<|im_start|>, id 256) in front when asked to add special tokens."""

    bos_token_id = IM_START

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([IM_START] if add_special_tokens else []) + super().encode(text, add_special_tokens)


def _serve(engine: FakeEngineClient, **server_config):
    server, thread, url = start_fake(engine, **server_config)
    return Server("fake", url, engine.model_name, engine.max_model_len, engine), server, thread


@pytest.fixture(scope="module")
def bos_server():
    engine = FakeEngineClient()
    engine.tokenizer = _BosTokenizer()
    handle, server, thread = _serve(engine)
    yield handle
    server.should_exit = True
    thread.join(timeout=10)


def test_tokenize_messages_honours_add_special_tokens(bos_server):
    messages = [{"role": "user", "content": "hi"}]
    template = [IM_START] + list(b"user\nhi") + [257] + list(b"\n") + [IM_START] + list(b"assistant\n")
    with bos_server.client() as c:
        # chat form: the template writes the special tokens, so none are added by default (as in vLLM)
        default = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
        off = c.post("/tokenize", json={"messages": messages, "add_special_tokens": False}).json()["tokens"]
        on = c.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()["tokens"]
        # completion form: added by default
        prompt = c.post("/tokenize", json={"prompt": "hi"}).json()["tokens"]
        prompt_off = c.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["tokens"]
    assert default == off == template
    assert on == [IM_START] + template
    assert prompt == [IM_START] + list(b"hi") and prompt_off == list(b"hi")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TWO_CALLS = ('Checking both.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


@pytest.fixture(scope="module")
def hermes_server():
    handle, server, thread = _serve(FakeEngineClient(), tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield handle
    server.should_exit = True
    thread.join(timeout=10)


def _chat_calls(client, stream: bool, **extra) -> tuple[str, list[dict], str]:
    """(content, tool calls as message dicts, finish_reason) of one chat request, streamed or not."""
    from ladle.server.parsers import assemble_deltas
    from sse import stream_events

    body = {"messages": [{"role": "user", "content": "Paris and Rome?"}], "tools": TOOLS, "max_tokens": 400,
            "temperature": 0, **extra}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]
    status, events = stream_events(client, "/v1/chat/completions", dict(body, stream=True))
    assert status == 200, events
    chunks = [e["choices"][0] for e in events if e.get("choices")]
    content, calls = assemble_deltas(c["delta"] for c in chunks)
    return content, calls, [c["finish_reason"] for c in chunks if c["finish_reason"]][-1]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_returns_the_first_call_only(hermes_server, stream):
    hermes_server.engine.script = TWO_CALLS
    with hermes_server.client() as c:
        for extra in ({}, {"parallel_tool_calls": True}, {"parallel_tool_calls": None}):
            content, calls, finish = _chat_calls(c, stream, **extra)
            assert [json.loads(t["function"]["arguments"]) for t in calls] == [{"city": "Paris"}, {"city": "Rome"}]
            assert content == "Checking both." and finish == "tool_calls"
        content, calls, finish = _chat_calls(c, stream, parallel_tool_calls=False)
    assert [json.loads(t["function"]["arguments"]) for t in calls] == [{"city": "Paris"}]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert content == "Checking both." and finish == "tool_calls"


def test_parallel_tool_calls_must_be_a_boolean(hermes_server):
    with hermes_server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "parallel_tool_calls": "sometimes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "parallel_tool_calls", r.text


@pytest.fixture(scope="module")
def wide_logprobs_server():
    handle, server, thread = _serve(FakeEngineClient(), max_logprobs=50)
    yield handle
    server.should_exit = True
    thread.join(timeout=10)


def test_max_logprobs_above_20_is_honoured(wide_logprobs_server):
    user = [{"role": "user", "content": "hi"}]
    with wide_logprobs_server.client() as c:
        # greedy: the fake writes "H", its 30 alternatives are the next 30 ASCII characters
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "temperature": 0, "logprobs": 30})
        assert r.status_code == 200, r.text
        top = r.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert len(top) == 1 and len(top[0]) == 31  # 30 alternatives and the chosen token
        r = c.post("/v1/chat/completions", json={"messages": user, "max_tokens": 2, "logprobs": True,
                                                 "top_logprobs": 30})
        assert r.status_code == 200, r.text
        assert all(len(t["top_logprobs"]) == 30 for t in r.json()["choices"][0]["logprobs"]["content"])
        # the server's own limit gives the 400, naming the field and the flag
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 51})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        assert "--max-logprobs" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": user, "logprobs": True, "top_logprobs": 51})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_max_logprobs_beyond_the_vocabulary_is_bounded_by_it():
    handle, server, thread = _serve(FakeEngineClient(), max_logprobs=10 ** 6)
    try:
        with handle.client() as c:
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 259})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        assert "258" in r.json()["error"]["message"]  # FakeTokenizer's vocabulary size
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_every_error_body_has_one_shape_413_included():
    """413 (refused in the ASGI middleware before any parsing), 401 (middleware), 400 / 404 / 405 (the app's
    handlers): the same OpenAI body, rendered by one serializer, with a Content-Length and an `...Error` type."""
    handle, server, thread = _serve(FakeEngineClient(), api_key="k", max_request_body_bytes=1000)
    auth = {"authorization": "Bearer k", "content-type": "application/json"}
    try:
        with handle.client() as c:
            cases = [
                (413, None, c.post("/v1/completions", content=json.dumps({"prompt": "x" * 2000}), headers=auth)),
                (413, None, c.post("/v1/completions", content=iter((b'{"prompt": "' + b"x" * 600, b"x" * 600)),
                                   headers=auth)),  # chunked: refused while reading
                (401, None, c.post("/v1/completions", json={"prompt": "a"})),
                (400, "n", c.post("/v1/completions", content=json.dumps({"prompt": "a", "n": 1000}), headers=auth)),
                (404, None, c.get("/nope")),
                (405, None, c.get("/v1/completions", headers=auth)),
            ]
        for status, param, r in cases:
            assert r.status_code == status, (status, r.text)
            assert r.headers["content-type"] == "application/json"
            assert int(r.headers["content-length"]) == len(r.content), (status, dict(r.headers))
            body = r.json()
            assert r.content == json.dumps(body, separators=(",", ":")).encode(), (status, r.content)
            err = body["error"]
            assert set(body) == {"error"} and set(err) == {"message", "type", "param", "code"}
            assert err["code"] == status and err["param"] == param and err["message"]
            assert err["type"].endswith("Error") and err["type"][0].isupper(), err
        assert {r.json()["error"]["type"] for s, _, r in cases if s == 413} == {"RequestTooLargeError"}
    finally:
        server.should_exit = True
        thread.join(timeout=10)
