"""Responses match OpenAI's published schema: required fields present (nullable ones as null), typed fields of
their type, optional fields absent or of their type (never null where the schema says a plain type).

Field lists written from OpenAI's OpenAPI spec (github.com/openai/openai-openapi, openapi.yaml; API reference
https://platform.openai.com/docs/api-reference/chat/object, .../chat-streaming, .../completions/object):
CreateChatCompletionResponse, ChatCompletionResponseMessage, ChatCompletionMessageToolCall,
CreateChatCompletionStreamResponse, ChatCompletionStreamResponseDelta, CreateCompletionResponse, CompletionUsage.
"""

from __future__ import annotations

import json

import pytest

from fake_engine import FakeEngineClient
from harness import start_fake

# schema: field -> (required, allowed JSON types); "null" in the types = nullable.
S, I, N, O, A, NULL = "string", "integer", "number", "object", "array", "null"
USAGE = {"prompt_tokens": (True, {I}), "completion_tokens": (True, {I}), "total_tokens": (True, {I}),
         "prompt_tokens_details": (False, {O}), "completion_tokens_details": (False, {O})}
CHAT = {"id": (True, {S}), "object": (True, {S}), "created": (True, {I}), "model": (True, {S}),
        "choices": (True, {A}), "usage": (False, {O}), "system_fingerprint": (False, {S}), "service_tier": (False, {S})}
CHAT_CHOICE = {"index": (True, {I}), "message": (True, {O}), "finish_reason": (True, {S}),
               "logprobs": (True, {O, NULL})}
CHAT_LOGPROBS = {"content": (True, {A, NULL}), "refusal": (True, {A, NULL})}
MESSAGE = {"role": (True, {S}), "content": (True, {S, NULL}), "refusal": (True, {S, NULL}), "tool_calls": (False, {A}),
           "annotations": (False, {A}), "audio": (False, {O, NULL}), "function_call": (False, {O})}
TOOL_CALL = {"id": (True, {S}), "type": (True, {S}), "function": (True, {O})}
FUNCTION = {"name": (True, {S}), "arguments": (True, {S})}
CHUNK = {"id": (True, {S}), "object": (True, {S}), "created": (True, {I}), "model": (True, {S}),
         "choices": (True, {A}), "usage": (False, {O, NULL}), "system_fingerprint": (False, {S})}
CHUNK_CHOICE = {"index": (True, {I}), "delta": (True, {O}), "finish_reason": (True, {S, NULL}),
                "logprobs": (False, {O, NULL})}
DELTA = {"role": (False, {S}), "content": (False, {S, NULL}), "refusal": (False, {S, NULL}), "tool_calls": (False, {A})}
DELTA_TOOL_CALL = {"index": (True, {I}), "id": (False, {S}), "type": (False, {S}), "function": (False, {O})}
COMPLETION = {"id": (True, {S}), "object": (True, {S}), "created": (True, {I}), "model": (True, {S}),
              "choices": (True, {A}), "usage": (False, {O}), "system_fingerprint": (False, {S})}
COMPLETION_CHOICE = {"index": (True, {I}), "text": (True, {S}), "finish_reason": (True, {S, NULL}),
                     "logprobs": (True, {O, NULL})}
COMPLETION_LOGPROBS = {"text_offset": (False, {A}), "token_logprobs": (False, {A}), "tokens": (False, {A}),
                       "top_logprobs": (False, {A})}


def _type(v) -> str:
    return {type(None): NULL, str: S, bool: "boolean", int: I, float: N, dict: O, list: A}[type(v)]


def check(obj: dict, schema: dict, where: str) -> None:
    for key, (required, types) in schema.items():
        if key not in obj:
            assert not required, f"{where}: required field {key!r} missing in {obj}"
            continue
        t = _type(obj[key])
        assert t in types or (t == I and N in types), f"{where}.{key}: {t} ({obj[key]!r}), schema allows {types}"


def check_chat(body: dict) -> None:
    check(body, CHAT, "chat")
    if "usage" in body:
        check(body["usage"], USAGE, "usage")
    assert body["object"] == "chat.completion"
    for ch in body["choices"]:
        check(ch, CHAT_CHOICE, "choice")
        if ch["logprobs"] is not None:
            check(ch["logprobs"], CHAT_LOGPROBS, "choice.logprobs")
        check(ch["message"], MESSAGE, "message")
        for call in ch["message"].get("tool_calls", []):
            check(call, TOOL_CALL, "tool_call")
            check(call["function"], FUNCTION, "tool_call.function")


def check_chunks(text: str, chunk_schema: dict, choice_schema: dict, obj: str) -> list[dict]:
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert chunks and text.rstrip().endswith("data: [DONE]")
    for c in chunks:
        check(c, chunk_schema, "chunk")
        assert c["object"] == obj
        if c.get("usage") is not None:
            check(c["usage"], USAGE, "chunk.usage")
        for ch in c["choices"]:
            check(ch, choice_schema, "chunk.choice")
            if "delta" in ch:
                check(ch["delta"], DELTA, "delta")
                for call in ch["delta"].get("tool_calls", []):
                    check(call, DELTA_TOOL_CALL, "delta.tool_call")
    return chunks


def test_schema_checker_catches_a_violation():
    with pytest.raises(AssertionError):
        check({"role": "assistant", "content": None}, MESSAGE, "message")  # refusal missing
    with pytest.raises(AssertionError):
        check({"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [],
               "system_fingerprint": None}, CHAT, "chat")


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2}])
def test_chat_matches_the_schema(fake_server, extra):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, **extra}
    with fake_server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200
        check_chat(r.json())
        check(r.json()["usage"], USAGE, "usage")
        s = c.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        check_chunks(s.text, CHUNK, CHUNK_CHOICE, "chat.completion.chunk")


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2, "echo": True}, {"n": 2}, {"max_tokens": 0, "echo": True}])
def test_completions_match_the_schema(fake_server, extra):
    body = {"prompt": "hi", "max_tokens": 5, "temperature": 0, **extra}
    with fake_server.client() as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200
        out = r.json()
        check(out, COMPLETION, "completion")
        check(out["usage"], USAGE, "usage")
        assert out["object"] == "text_completion"
        for ch in out["choices"]:
            check(ch, COMPLETION_CHOICE, "choice")
            if ch["logprobs"] is not None:
                check(ch["logprobs"], COMPLETION_LOGPROBS, "choice.logprobs")
        s = c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        check_chunks(s.text, COMPLETION, COMPLETION_CHOICE, "text_completion")


def test_tool_call_responses_match_the_schema():
    engine = FakeEngineClient()
    engine.script = 'ok<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    server, thread, url = start_fake(engine, tool_call_parser="hermes", enable_auto_tool_choice=True)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    try:
        import httpx

        with httpx.Client(base_url=url, timeout=60) as c:
            out = c.post("/v1/chat/completions", json=body).json()
            check_chat(out)
            assert out["choices"][0]["message"]["tool_calls"] and out["choices"][0]["finish_reason"] == "tool_calls"
            chunks = check_chunks(c.post("/v1/chat/completions", json={**body, "stream": True}).text, CHUNK,
                                  CHUNK_CHOICE, "chat.completion.chunk")
            assert any(ch["delta"].get("tool_calls") for c_ in chunks for ch in c_["choices"])
    finally:
        server.should_exit = True
        thread.join(timeout=10)
