"""Tool calls and reasoning through the served chat API: the `openai` client against a server run with
`--tool-call-parser` / `--reasoning-parser` / `--enable-auto-tool-choice`, over the fake engine scripted to write a
tool call (hermes and minimax_m3 formats) and reasoning; streaming and not, n > 1 (one parser per choice)."""

from __future__ import annotations

import json

import pytest

from fake_engine import FakeEngineClient
from golden_streams import HERMES_SCRIPT, M3_SCRIPT, MESSAGES, TOOLS  # the scripted tool calls, one home
from harness import Server, start_fake



def _serve(**server_config):
    engine = FakeEngineClient()
    server, thread, url = start_fake(engine, **server_config)
    return Server("fake", url, engine.model_name, engine.max_model_len, engine), server, thread


@pytest.fixture(scope="module")
def m3_server():
    handle, server, thread = _serve(tool_call_parser="minimax_m3", reasoning_parser="minimax_m3",
                                    enable_auto_tool_choice=True)
    yield handle
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def hermes_server():
    handle, server, thread = _serve(tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield handle
    server.should_exit = True
    thread.join(timeout=10)


def _stream(client, **kw):
    """Stream a chat request; per choice: (reasoning, content, tool calls by index, finish reason)."""
    out: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            st = out.setdefault(ch.index, {"reasoning": "", "content": "", "calls": {}, "finish": None})
            d = ch.delta
            st["reasoning"] += getattr(d, "reasoning_content", None) or ""
            st["content"] += d.content or ""
            for tc in d.tool_calls or ():
                call = st["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] = (tc.function.name if tc.function else None) or call["name"]
                call["arguments"] += (tc.function.arguments if tc.function else None) or ""
            st["finish"] = ch.finish_reason or st["finish"]
    return out


def test_minimax_m3_tool_call_and_reasoning(m3_server):
    m3_server.engine.script = M3_SCRIPT
    client = m3_server.openai()
    kw = dict(model=m3_server.model, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=400)
    plain = client.chat.completions.create(**kw)
    assert m3_server.engine.last_params.skip_special_tokens is False  # the markers are special tokens
    assert m3_server.engine.tokenizer.last_template_kwargs["tools"] == TOOLS  # tools reach the chat template
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.model_extra["reasoning_content"] == "The user wants Paris, 3 days."
    assert msg.content == "Let me check." and msg.refusal is None
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}  # coerced by schema
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    streamed = _stream(client, **kw)[0]
    assert streamed["reasoning"] == "The user wants Paris, 3 days." and streamed["content"] == "Let me check."
    assert streamed["finish"] == "tool_calls" and list(streamed["calls"]) == [0]
    call = streamed["calls"][0]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "days": 3}


def test_thinking_mode_enabled_starts_inside_reasoning(m3_server):
    m3_server.engine.script = "still thinking</mm:think>The answer."
    client = m3_server.openai()
    kw = dict(model=m3_server.model, messages=MESSAGES, temperature=0, max_tokens=100,
              extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.model_extra["reasoning_content"] == "still thinking" and msg.content == "The answer."
    assert m3_server.engine.tokenizer.last_template_kwargs["thinking_mode"] == "enabled"
    streamed = _stream(client, **kw)[0]
    assert (streamed["reasoning"], streamed["content"], streamed["finish"]) == ("still thinking", "The answer.", "stop")


def test_hermes_tool_call_stream_and_not_with_n_2(hermes_server):
    hermes_server.engine.script = HERMES_SCRIPT
    client = hermes_server.openai()
    kw = dict(model=hermes_server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=400, n=2)
    plain = client.chat.completions.create(**kw)
    assert [c.index for c in plain.choices] == [0, 1]
    for choice in plain.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        assert [json.loads(t.function.arguments) for t in choice.message.tool_calls] == [{"city": "Paris", "days": 3}]
    streamed = _stream(client, **kw)
    assert sorted(streamed) == [0, 1]
    for st in streamed.values():  # each choice parsed on its own: one call each, index 0
        assert st["content"] == "Let me check." and st["finish"] == "tool_calls" and list(st["calls"]) == [0]
        assert json.loads(st["calls"][0]["arguments"]) == {"city": "Paris", "days": 3}


def test_tool_choice_none_returns_the_text(hermes_server):
    hermes_server.engine.script = HERMES_SCRIPT
    client = hermes_server.openai()
    plain = client.chat.completions.create(model=hermes_server.model, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=400)
    assert plain.choices[0].message.content == HERMES_SCRIPT and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"
    assert hermes_server.engine.last_params.skip_special_tokens is True  # no parser runs: the request's own value


def test_named_tool_choice_must_be_in_tools(hermes_server):
    with hermes_server.client() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "max_tokens": 5,
            "tool_choice": {"type": "function", "function": {"name": "other"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_auto_tool_choice_needs_the_server_flag():
    handle, server, thread = _serve(tool_call_parser="hermes")  # no --enable-auto-tool-choice
    try:
        with handle.client() as c:
            r = c.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 5})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_tokenize_passes_tools_to_the_template(hermes_server):
    with hermes_server.client() as c:
        r = c.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200 and r.json()["count"] > 0
    assert hermes_server.engine.tokenizer.last_template_kwargs["tools"] == TOOLS


def test_build_app_refuses_an_unknown_parser():
    from ladle.config import ServerConfig
    from ladle.server.api import build_app

    with pytest.raises(ValueError, match="unknown tool-call parser; ladle has hermes, llama3_json, minimax_m3"):
        build_app(FakeEngineClient(), ServerConfig(tool_call_parser="mistral"))
