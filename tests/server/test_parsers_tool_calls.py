"""Tool-call parsers (minimax_m3, hermes, llama3_json): non-streaming results, and streaming over every chunking
giving the same content and calls."""

from __future__ import annotations

import json
import random

import pytest

from ladle.server.parsers import (HermesToolParser, Llama3JsonToolParser, MiniMaxM3ToolParser, assemble_deltas,
                                  get_tool_parser)
from parser_streaming import check_delta_shapes, chunkings, counter_ids, stream_deltas

NS = "]<]minimax[>["
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "none": {"type": "null"}, "maybe": {"type": ["integer", "null"]},
    "either": {"anyOf": [{"type": "string"}, {"type": "number"}]},
    "blob": {"type": "object"}, "list": {"type": "array"},
    "opts": {"type": "object", "properties": {"depth": {"type": "integer"},
                                              "inner": {"type": "object", "properties": {"on": {"type": "boolean"}}}}},
    "tags": {"type": "array", "items": {"type": "integer"}},
    "rows": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}}},
}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


def call(name, arguments, index):
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def check_all_chunkings(parser_cls, text, content, calls, tools=TOOLS, num_random=12):
    """extract(text) == (content, calls), and so does every streamed chunking (with well-shaped deltas)."""
    parser = parser_cls(tools, new_id=counter_ids())
    assert parser.extract(text) == (content, calls)
    assert parser.tools_called == bool(calls)
    for pieces in chunkings(text, num_random=num_random):
        parser = parser_cls(tools, new_id=counter_ids())
        deltas = stream_deltas(parser, pieces)
        check_delta_shapes(deltas)
        assert assemble_deltas(deltas) == (content, calls), pieces
        assert parser.tools_called == bool(calls)


def m3_invoke(name, body):
    return f"{NS}<invoke name=\"{name}\">\n{body}{NS}</invoke>\n"


def m3_param(key, value):
    return f"{NS}<{key}>{value}{NS}</{key}>\n"


def m3_wrap(*invokes):
    return f"{NS}<tool_call>\n" + "".join(invokes) + f"{NS}</tool_call>"


# ------------------------------------------------------------------------------------------ minimax_m3
def test_m3_one_call_with_text_before_and_after():
    text = "Let me look.\n" + m3_wrap(m3_invoke("get_weather", m3_param("city", "Paris"))) + "\nDone."
    check_all_chunkings(MiniMaxM3ToolParser, text, "Let me look.\n\nDone.", [call("get_weather", {"city": "Paris"}, 0)])


def test_m3_several_invokes_and_wrappers():
    first = m3_wrap(m3_invoke("get_weather", m3_param("city", "Oslo") + m3_param("days", "2")),
                    m3_invoke("noop", ""))
    second = m3_wrap(m3_invoke("get_weather", m3_param("city", "Rome")))
    calls = [call("get_weather", {"city": "Oslo", "days": 2}, 0), call("noop", {}, 1),
             call("get_weather", {"city": "Rome"}, 2)]
    check_all_chunkings(MiniMaxM3ToolParser, first + " and " + second, " and ", calls)


def test_m3_schema_coercion_of_leaves():
    body = "".join(m3_param(k, v) for k, v in [
        ("city", " 42 "), ("days", "7"), ("temp", "-3.5e1"), ("metric", "True"), ("none", "null"),
        ("maybe", "null"), ("either", "2.5"), ("blob", '{"k": [1, {"z": null}]}'), ("list", "[1, \"a\"]"),
        ("undeclared", "123"),
    ])
    expected = {"city": "42", "days": 7, "temp": -35.0, "metric": True, "none": None, "maybe": None,
                "either": 2.5, "blob": {"k": [1, {"z": None}]}, "list": [1, "a"], "undeclared": "123"}
    check_all_chunkings(MiniMaxM3ToolParser, m3_wrap(m3_invoke("get_weather", body)), None,
                        [call("get_weather", expected, 0)], num_random=4)


@pytest.mark.parametrize("key,text,value", [
    ("days", "seven", "seven"), ("days", "2.0", 2), ("days", "2.5", "2.5"), ("temp", "true", "true"),
    ("metric", "yes", "yes"), ("blob", "[1]", "[1]"), ("list", "", []), ("blob", "", {}), ("maybe", "3", 3),
    ("either", "word", "word"), ("city", "", ""), ("city", "<b>bold</b> & \"q\"", "<b>bold</b> & \"q\""),
])
def test_m3_coercion_falls_back_to_string(key, text, value):
    text = m3_wrap(m3_invoke("get_weather", m3_param(key, text)))
    assert MiniMaxM3ToolParser(TOOLS, new_id=counter_ids()).extract(text) == (None, [call("get_weather", {key: value}, 0)])


def test_m3_nested_objects_and_arrays():
    body = (f"{NS}<opts>{NS}<depth>3{NS}</depth>{NS}<inner>{NS}<on>false{NS}</on>{NS}</inner>{NS}</opts>\n"
            f"{NS}<tags>\n{NS}<item>1{NS}</item>\n{NS}<item>2{NS}</item>\n{NS}</tags>\n"
            f"{NS}<rows>{NS}<item>{NS}<x>1.5{NS}</x>{NS}</item>{NS}</rows>\n"
            f"{NS}<free>{NS}<item>a{NS}</item>{NS}<item>b{NS}</item>{NS}</free>\n")
    expected = {"opts": {"depth": 3, "inner": {"on": False}}, "tags": [1, 2], "rows": [{"x": 1.5}],
                "free": ["a", "b"]}
    check_all_chunkings(MiniMaxM3ToolParser, m3_wrap(m3_invoke("get_weather", body)), None,
                        [call("get_weather", expected, 0)], num_random=4)


def test_m3_without_tools_keeps_strings():
    text = m3_wrap(m3_invoke("anything", m3_param("n", "5") + m3_param("o", f"{NS}<k>1{NS}</k>")))
    assert MiniMaxM3ToolParser(None, new_id=counter_ids()).extract(text) == (
        None, [call("anything", {"n": "5", "o": {"k": "1"}}, 0)])


def test_m3_tolerated_deviations():
    # missing namespace on invoke tags and the wrapper closer; a parameter left open before </invoke>;
    # an invoke cut short by the wrapper's end
    text = (f"{NS}<tool_call>\n<invoke name='get_weather'>{NS}<city>Lima\n</invoke>\n"
            f"{NS}<invoke name=\"noop\">\n</tool_call>tail")
    check_all_chunkings(MiniMaxM3ToolParser, text, "tail", [call("get_weather", {"city": "Lima"}, 0), call("noop", {}, 1)])


@pytest.mark.parametrize("text", [
    m3_wrap(m3_invoke("get_weather", "<city>Paris</city>\n")),  # parameter without namespace: text, not a tag
    m3_wrap(f"{NS}<invoke>{NS}</invoke>"),  # no name
    m3_wrap(m3_invoke("get_weather", m3_param("city", "x") + f"{NS}</days>")),  # stray closing tag
    m3_wrap(m3_invoke("get_weather", f"{NS}<opts>text{NS}<depth>1{NS}</depth>{NS}</opts>")),  # mixed content
    m3_wrap("just words"),
    f"{NS}<tool_call>{NS}<invoke name=\"noop\">{NS}<a>1",  # truncated in an invoke
    f"{NS}<tool_call>\n",  # truncated wrapper
    m3_wrap(m3_invoke("noop", f"{NS}<a>" * 65 + "x")),  # nesting deeper than MAX_DEPTH
])
def test_m3_malformed_wrapper_is_content_verbatim(text):
    check_all_chunkings(MiniMaxM3ToolParser, "before " + text + " after", "before " + text + " after", [],
                        num_random=4)


def test_m3_very_deep_nesting_is_content_not_an_exception():
    text = m3_wrap(m3_invoke("noop", f"{NS}<a>" * 3000 + "x"))
    assert MiniMaxM3ToolParser(TOOLS).extract(text) == (text, [])
    ok = m3_wrap(m3_invoke("noop", f"{NS}<a>" * 64 + "x"))
    assert MiniMaxM3ToolParser(TOOLS).extract(ok)[1][0]["function"]["arguments"].count("{") == 64


def test_m3_malformed_invoke_beside_a_valid_one():
    bad = f"{NS}<invoke name=\"get_weather\"><city>x</city>{NS}</invoke>"
    text = m3_wrap(m3_invoke("noop", ""), bad + "\n", "stray\n")
    check_all_chunkings(MiniMaxM3ToolParser, text, "\n" + bad + "\nstray\n", [call("noop", {}, 0)], num_random=6)


@pytest.mark.parametrize("text,content", [
    ("ends on a partial ]<]minimax[>[<tool_", "ends on a partial ]<]minimax[>[<tool_"),
    ("M2 style <tool_call><invoke name=\"f\"></invoke></tool_call>",
     "M2 style <tool_call><invoke name=\"f\"></invoke></tool_call>"),
    ("a ]<]minimax[>[ token alone", "a ]<]minimax[>[ token alone"),
    ("", None),
])
def test_m3_plain_text(text, content):
    check_all_chunkings(MiniMaxM3ToolParser, text, content, [])


def test_m3_unclosed_wrapper_keeps_complete_invokes():
    text = f"{NS}<tool_call>\n" + m3_invoke("noop", "") + f"{NS}<invoke name=\"get_weather\">{NS}<ci"
    check_all_chunkings(MiniMaxM3ToolParser, text, f"\n{NS}<invoke name=\"get_weather\">{NS}<ci",
                        [call("noop", {}, 0)])


def test_m3_streams_content_and_calls_early():
    parser = MiniMaxM3ToolParser(TOOLS, new_id=counter_ids())
    assert parser.feed("Hello ]<]mini") == [{"content": "Hello "}]
    assert parser.feed("max[>[<tool_call>\n" + m3_invoke("noop", "")) == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "noop", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}]
    assert parser.tools_called
    assert parser.feed(f"{NS}</tool_call> bye") == [{"content": " bye"}]
    assert parser.finish() == []


# ------------------------------------------------------------------------------------------ hermes
def hermes(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.parametrize("text,content,calls", [
    ("Sure. " + hermes("f", {"a": 1}) + " Then.", "Sure.  Then.", [call("f", {"a": 1}, 0)]),
    (hermes("f", {"a": [1, {"b": None}]}) + "\n" + hermes("g", {}), "\n",
     [call("f", {"a": [1, {"b": None}]}, 0), call("g", {}, 1)]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": true}"}</tool_call>', None, [call("f", {"x": True}, 0)]),
    ('<tool_call>{"name": "f"}</tool_call>', None, [call("f", {}, 0)]),
    ('x <tool_call>{"name": "f", "arguments": {"a": 1}}', "x ", [call("f", {"a": 1}, 0)]),  # closer eaten
    ("x <tool_call>{not json}</tool_call> y", "x <tool_call>{not json}</tool_call> y", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ('a <tool_call>{"name": "f", "argu', 'a <tool_call>{"name": "f", "argu', []),  # truncated
    ("ends on <tool_ca", "ends on <tool_ca", []),
    ("", None, []),
])
def test_hermes(text, content, calls):
    check_all_chunkings(HermesToolParser, text, content, calls)


# ------------------------------------------------------------------------------------------ llama3_json
@pytest.mark.parametrize("text,content,calls", [
    ('{"name": "f", "parameters": {"a": 1}}', None, [call("f", {"a": 1}, 0)]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": "x"}}; {"name": "g", "arguments": {"b": [2]}}', None,
     [call("f", {"a": "x"}, 0), call("g", {"b": [2]}, 1)]),
    ('\n {"name": "f", "parameters": {}} trailing words', "trailing words", [call("f", {}, 0)]),
    ('{"name": "f", "parameters": {}}; {"broken": ', '{"broken": ', [call("f", {}, 0)]),
    ("The answer is 4.", "The answer is 4.", []),
    ('{"answer": 4}', '{"answer": 4}', []),
    ('{"name": "f", "parameters": {"a": 1', '{"name": "f", "parameters": {"a": 1', []),  # truncated
    ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ("<|python_ta", "<|python_ta", []),
    ("  ", "  ", []),
    ("", None, []),
])
def test_llama3_json(text, content, calls):
    check_all_chunkings(Llama3JsonToolParser, text, content, calls)


def test_llama3_json_plain_text_streams_at_once():
    parser = Llama3JsonToolParser()
    assert parser.feed(" <|py") == []  # could still be the python tag
    assert parser.feed("thon is nice") == [{"content": " <|python is nice"}]


# ------------------------------------------------------------------------------------------ random round trips
def _random_value(rng, depth=0):
    kind = rng.choice(["str", "int", "float", "bool", "null"] + (["obj", "list"] if depth < 2 else []))
    if kind == "str":
        return "".join(rng.choice("abc xyz<>&\"'é1") for _ in range(rng.randint(1, 8))).strip() or "s"
    if kind == "obj":
        return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randint(1, 3))}
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(1, 3))]
    return {"int": rng.randint(-10**6, 10**6), "float": rng.uniform(-1e3, 1e3), "bool": rng.random() < 0.5,
            "null": None}[kind]


def _schema_of(value):
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: _schema_of(v) for k, v in value.items()}}
    if isinstance(value, list):  # items typed by the first element; others fall back to their own text
        return {"type": "array", "items": _schema_of(value[0])}
    return {"type": {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}[type(value)]}


def _m3_render(value):
    if isinstance(value, dict):
        return "".join(m3_param(k, _m3_render(v)) for k, v in value.items())
    if isinstance(value, list):
        return "".join(m3_param("item", _m3_render(v)) for v in value)
    return json.dumps(value) if not isinstance(value, str) else value


def _homogeneous(value):
    """Make every list's items share the first item's type, so the items schema describes them all."""
    if isinstance(value, dict):
        return {k: _homogeneous(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_homogeneous(value[0])] * len(value)
    return value


@pytest.mark.parametrize("fmt", ["minimax_m3", "hermes", "llama3_json"])
def test_random_calls_round_trip(fmt):
    rng = random.Random(1234)
    for trial in range(25):
        calls = [(f"fn{i}", _homogeneous({f"p{j}": _random_value(rng) for j in range(rng.randint(0, 4))}))
                 for i in range(rng.randint(1, 3))]
        tools = [{"type": "function", "function": {"name": n, "parameters": _schema_of(a)}} for n, a in calls]
        if fmt == "minimax_m3":
            text = "pre " + m3_wrap(*(m3_invoke(n, _m3_render(a)) for n, a in calls)) + " post"
        elif fmt == "hermes":
            text = "pre " + "".join(hermes(n, a) for n, a in calls) + " post"
        else:
            text = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls) + " post"
        expected = [call(n, a, i) for i, (n, a) in enumerate(calls)]
        content = "post" if fmt == "llama3_json" else "pre  post"
        check_all_chunkings(get_tool_parser(fmt), text, content, expected, tools=tools, num_random=3)
