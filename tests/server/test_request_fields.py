"""Request fields ladle does not honour are refused, never ignored (ladle.server.validation.check_request_fields):
a 400 with an OpenAI error body naming the field, before any SSE byte, streaming or not; values equivalent to
leaving the field out pass; unknown fields are refused; identifiers no output depends on pass; the server keeps
serving afterwards."""

from __future__ import annotations

from typing import Optional

import openai
import pytest

from fake_engine import SCRIPT
from ladle.server.protocol import ChatCompletionRequest, CompletionRequest
from ladle.server.validation import HARMLESS_FIELDS, UNHONOURED

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BASE = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0},
        COMPLETIONS: {"prompt": "hi", "max_tokens": 3, "temperature": 0}}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}

# (path, field, a value that changes the output if honoured, a word the message must hold: what ladle offers)
REFUSED = [
    (CHAT, "logit_bias", {"5": 1.0}, "{}"),
    (COMPLETIONS, "logit_bias", {"5": -100}, "{}"),
    (CHAT, "response_format", JSON_SCHEMA, "text"),
    (CHAT, "response_format", {"type": "json_object"}, "constrained"),
    (COMPLETIONS, "response_format", {"type": "json_object"}, "constrained"),
    (COMPLETIONS, "best_of", 3, "equal to n"),
    (CHAT, "best_of", 2, "equal to n"),
    (COMPLETIONS, "suffix", "x", "fill-in-the-middle"),
    (COMPLETIONS, "tools", [{"type": "function", "function": {"name": "f"}}], CHAT),
    (COMPLETIONS, "messages", [{"role": "user", "content": "hi"}], CHAT),
    (CHAT, "prompt", "hi", COMPLETIONS),
    (CHAT, "echo", True, COMPLETIONS),
    (CHAT, "functions", [{"name": "f", "parameters": {}}], "tools"),
    (CHAT, "function_call", "auto", "tool_choice"),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}, "text only"),
    (CHAT, "modalities", ["text", "audio"], "text only"),
    (CHAT, "prediction", {"type": "content", "content": "x"}, "leave it out"),
    (CHAT, "web_search_options", {}, "web search"),
    (CHAT, "service_tier", "priority", "one tier"),
    (CHAT, "reasoning_effort", "low", "chat_template_kwargs"),
    (CHAT, "verbosity", "low", "max_completion_tokens"),
    (CHAT, "store", True, "false"),
    (CHAT, "guided_json", {"type": "object"}, "constrained"),
    (COMPLETIONS, "guided_regex", "a+", "constrained"),
    (COMPLETIONS, "guided_choice", ["a", "b"], "constrained"),
    (CHAT, "structured_outputs", {"choice": ["a"]}, "constrained"),
    (COMPLETIONS, "use_beam_search", True, "beam search"),
    (COMPLETIONS, "length_penalty", 0.5, "beam search"),
    (COMPLETIONS, "prompt_logprobs", 1, "echo"),
    (CHAT, "allowed_token_ids", [1, 2], "allow-list"),
    (CHAT, "bad_words", ["x"], "stop"),
    (COMPLETIONS, "priority", 5, "first come"),
    (COMPLETIONS, "truncate_prompt_tokens", 4, "shorten"),
    (CHAT, "include_reasoning", False, "reasoning_content"),
    (CHAT, "add_special_tokens", True, "false"),
    (COMPLETIONS, "add_special_tokens", False, "token ids"),
    (CHAT, "request_id", "abc", "X-Request-Id"),
    (CHAT, "cache_salt", "salt", "--no-enable-prefix-caching"),
    (CHAT, "documents", [{"title": "t", "text": "x"}], "messages"),
    (CHAT, "chat_template", "{{ messages }}", "chat template"),
]

# (path, field, a value equivalent to leaving it out)
OFF = [
    (CHAT, "logit_bias", None), (CHAT, "logit_bias", {}), (COMPLETIONS, "logit_bias", {"5": 0}),
    (CHAT, "response_format", {"type": "text"}), (COMPLETIONS, "response_format", None),
    (COMPLETIONS, "best_of", 1), (COMPLETIONS, "best_of", None), (CHAT, "best_of", 1),
    (COMPLETIONS, "suffix", ""), (COMPLETIONS, "suffix", None),
    (CHAT, "echo", False), (CHAT, "service_tier", "auto"), (CHAT, "service_tier", "default"),
    (CHAT, "modalities", ["text"]), (CHAT, "store", False), (CHAT, "functions", []), (CHAT, "function_call", "none"),
    (CHAT, "audio", None), (CHAT, "reasoning_effort", None), (CHAT, "guided_json", None),
    (COMPLETIONS, "use_beam_search", False), (COMPLETIONS, "length_penalty", 1.0), (COMPLETIONS, "priority", 0),
    (CHAT, "spaces_between_special_tokens", True), (CHAT, "include_reasoning", True),
    (CHAT, "add_special_tokens", False), (COMPLETIONS, "add_special_tokens", True), (CHAT, "bad_words", []),
    (CHAT, "vllm_xargs", {}), (COMPLETIONS, "tools", None),
]


def _expect_400(c, path: str, body: dict, param: str) -> str:
    """POST streaming and not: 400, OpenAI error body naming `param`, no SSE. Returns the message."""
    messages = set()
    for stream in (False, True):
        with c.stream("POST", path, json={**body, "stream": stream}) as r:
            raw = r.read()
        assert r.status_code == 400 and not raw.startswith(b"data:"), (stream, r.status_code, raw[:300])
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param, err
        assert param in err["message"], err
        messages.add(err["message"])
    assert len(messages) == 1
    return messages.pop()


def _expect_ok(c, path: str, body: dict, streamed: Optional[dict] = None) -> None:
    """`body` answered 200 with the scripted text, plain and streamed; `streamed`: fields of the streamed request
    only (stream_options is refused on a plain request)."""
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"] if path == CHAT else choice["text"]) == SCRIPT[:3]
    with c.stream("POST", path, json={**body, **(streamed or {}), "stream": True}) as r:
        raw = r.read()
    assert r.status_code == 200 and raw.startswith(b"data:") and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]


@pytest.mark.parametrize("path,field,value,offer", REFUSED, ids=[f"{p[4:]}-{f}" for p, f, _, _ in REFUSED])
def test_unhonoured_field_is_refused(fake_server, path, field, value, offer):
    with fake_server.client() as c:
        message = _expect_400(c, path, {**BASE[path], field: value}, field)
        assert offer in message and "not honoured" in message, message
        _expect_ok(c, path, BASE[path])  # still serving


@pytest.mark.parametrize("path,field,value", OFF, ids=[f"{p[4:]}-{f}-{v!r}" for p, f, v in OFF])
def test_off_value_is_accepted(fake_server, path, field, value):
    with fake_server.client() as c:
        _expect_ok(c, path, {**BASE[path], field: value})


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unknown_fields_are_refused_naming_them(fake_server, path):
    with fake_server.client() as c:
        message = _expect_400(c, path, {**BASE[path], "top_a": 0.2, "tfs_z": 0.9}, "tfs_z")
        assert '"tfs_z", "top_a"' in message and path in message, message
        assert "Fields ladle honours:" in message and "temperature" in message, message
        assert message.endswith("accepted with no effect on the output: metadata, prompt_cache_key, "
                                "safety_identifier"), message
        assert "\\u" not in _expect_400(c, path, {**BASE[path], "mirostat": 1}, "mirostat")
        _expect_ok(c, path, BASE[path])


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_metadata_fields_are_accepted(fake_server, path):
    with fake_server.client() as c:
        _expect_ok(c, path, {**BASE[path], "user": "u-1", "metadata": {"team": "a"}, "safety_identifier": "h",
                             "prompt_cache_key": "k"})


def test_nested_history_fields_stay_accepted(fake_server):
    """An assistant message sent back as received (refusal, annotations): history, not a generation control."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "audio": None},
                {"role": "user", "content": "again"}]
    with fake_server.client() as c:
        _expect_ok(c, CHAT, {**BASE[CHAT], "messages": messages},
                   streamed={"stream_options": {"include_usage": True, "include_obfuscation": False}})


def test_openai_client_extra_body(fake_server):
    client = fake_server.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=fake_server.model, messages=BASE[CHAT]["messages"], max_tokens=3,
                                       extra_body={"guided_choice": ["a", "b"]})
    assert e.value.body["param"] == "guided_choice"
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=fake_server.model, prompt="hi", max_tokens=3, logit_bias={"5": 3})
    out = client.completions.create(model=fake_server.model, prompt="hi", max_tokens=3, temperature=0,
                                    logit_bias={}, best_of=1, user="u")
    assert out.choices[0].text == SCRIPT[:3]


def test_tables_hold_no_declared_field():
    """A table entry for a field the schema declares would never be reached (the field is not in model_extra)."""
    for path, cls in ((CHAT, ChatCompletionRequest), (COMPLETIONS, CompletionRequest)):
        assert cls.api_path == path
        declared = set(cls.model_fields)
        assert not declared & set(UNHONOURED[path]) and not declared & HARMLESS_FIELDS
        for name, (off, offer) in UNHONOURED[path].items():
            assert offer and off(None, cls.model_construct(n=1)), name  # null always means "left out"
