"""minimax_m3 reasoning parser, the combined chat-output parser, the registry and the tool_choice plan."""

from __future__ import annotations

import pytest

from ladle.server.parsers import (ChatOutputParser, assemble_deltas, MiniMaxM3ReasoningParser, MiniMaxM3ToolParser, ToolChoiceError,
                                  ToolChoicePlan, get_reasoning_parser, get_tool_parser, make_chat_output_parser,
                                  plan_tool_choice, unmet_tool_choice)
from parser_streaming import check_delta_shapes, chunkings, counter_ids, stream_deltas

NS = "]<]minimax[>["

REASONING_CASES = [  # (starts_in_reasoning, text, reasoning, content)
    (True, "Let me think.</mm:think>The answer is 4.", "Let me think.", "The answer is 4."),
    (True, "<mm:think>R\nmore</mm:think>\n\nC", "R\nmore", "\n\nC"),
    (True, "  <mm:think>R</mm:think>C", "R", "C"),
    (True, "still thinking when cut off", "still thinking when cut off", None),
    (True, "</mm:think>only content", None, "only content"),
    (True, "R</mm:think>C with </mm:think> and <mm:think> kept", "R", "C with </mm:think> and <mm:think> kept"),
    (True, "ends on a partial </mm:thi", "ends on a partial </mm:thi", None),
    (True, "<mm:thi", "<mm:thi", None),
    (True, "<m", "<m", None),
    (True, "", None, None),
    (False, "Plain answer.", None, "Plain answer."),
    (False, "<mm:think>R</mm:think>C", "R", "C"),
    (False, "\n<mm:think>truncated", "truncated", None),
    (False, "</mm:think>C", None, "C"),
    (False, "a <mm:think>b</mm:think> c", None, "a <mm:think>b</mm:think> c"),
    (False, "R</mm:think>C", None, "R</mm:think>C"),
    (False, "<mm:thi", None, "<mm:thi"),
    (False, "   ", None, "   "),
    (False, "<mm:think></mm:think>C", None, "C"),
]


@pytest.mark.parametrize("inside,text,reasoning,content", REASONING_CASES)
def test_minimax_m3_reasoning_extract_and_stream(inside, text, reasoning, content):
    assert MiniMaxM3ReasoningParser(inside).extract(text) == (reasoning, content)
    for pieces in chunkings(text):
        parser = MiniMaxM3ReasoningParser(inside)
        out = [parser.feed(p) for p in pieces] + [parser.finish()]
        got = ("".join(r for r, _ in out) or None, "".join(c for _, c in out) or None)
        assert got == (reasoning, content), pieces


def test_reasoning_holds_back_only_a_possible_marker():
    parser = MiniMaxM3ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("abc</mm") == ("abc", "")
    assert parser.feed(":thinx") == ("</mm:thinx", "")  # not a marker after all: released at once
    assert parser.feed("</mm:think>") == ("", "")
    assert parser.feed("<mm:think> x") == ("", "<mm:think> x")  # content: markers are text, nothing held
    assert parser.finish() == ("", "")
    outside = MiniMaxM3ReasoningParser(starts_in_reasoning=False)
    assert outside.feed("Hi <") == ("", "Hi <")


@pytest.mark.parametrize("kwargs,inside", [
    ({"thinking_mode": "enabled"}, True), ({"thinking_mode": "disabled"}, False),
    ({"thinking_mode": "adaptive"}, False), ({}, False), (None, False),
])
def test_reasoning_state_from_chat_template_kwargs(kwargs, inside):
    parser = get_reasoning_parser("minimax_m3").for_request(kwargs)
    assert parser.starts_in_reasoning is inside
    assert parser.extract("x") == (("x", None) if inside else (None, "x"))


def test_registry_names_and_unknown():
    assert get_tool_parser("minimax_m3") is MiniMaxM3ToolParser
    assert {get_tool_parser(n).name for n in ("minimax_m3", "hermes", "llama3_json")} == {
        "minimax_m3", "hermes", "llama3_json"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="minimax_m3"):
        get_reasoning_parser("deepseek_r1")


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}}}}]


def test_chat_output_reasoning_then_tool_calls():
    call = (f"{NS}<tool_call>\n{NS}<invoke name=\"add\">\n{NS}<a>2{NS}</a>\n{NS}<b>0.5{NS}</b>\n"
            f"{NS}</invoke>\n{NS}</tool_call>")
    # a call written while reasoning is not a call
    text = f"I could write {call} here.</mm:think>Sure.\n{call}"
    expected = {"reasoning_content": f"I could write {call} here.", "content": "Sure.\n",
                "tool_calls": [{"id": "call_0", "type": "function",
                                "function": {"name": "add", "arguments": '{"a": 2, "b": 0.5}'}}]}
    whole = ChatOutputParser(MiniMaxM3ReasoningParser(True), MiniMaxM3ToolParser(TOOLS, new_id=counter_ids()))
    assert whole.extract(text) == expected and whole.tools_called
    for pieces in chunkings(text, num_random=6):
        parser = ChatOutputParser(MiniMaxM3ReasoningParser(True), MiniMaxM3ToolParser(TOOLS, new_id=counter_ids()))
        deltas = stream_deltas(parser, pieces)
        check_delta_shapes(deltas)
        content, calls = assemble_deltas(deltas)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
        assert {"reasoning_content": reasoning, "content": content, "tool_calls": calls} == expected, pieces
        assert parser.tools_called


def test_make_chat_output_parser_without_parsers_passes_text_through():
    parser = make_chat_output_parser(None, None)
    assert parser.feed("<tool_call>{}") == [{"content": "<tool_call>{}"}]
    assert parser.finish() == [] and not parser.tools_called
    both = make_chat_output_parser("minimax_m3", "hermes", chat_template_kwargs={"thinking_mode": "disabled"})
    assert both.extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>')["tool_calls"][0]["function"] == {
        "name": "f", "arguments": "{}"}


# ------------------------------------------------------------------------------------------ tool_choice
def _plan(choice, tools=TOOLS, parser="minimax_m3", auto=True):
    return plan_tool_choice(choice, tools, tool_parser=parser, enable_auto_tool_choice=auto)


def test_tool_choice_plans():
    assert _plan(None, tools=None) == ToolChoicePlan(run_parser=False, required=False)
    assert _plan("auto", tools=[]) == ToolChoicePlan(run_parser=False, required=False)
    assert _plan("none") == ToolChoicePlan(run_parser=False, required=False)
    assert _plan("none", parser=None, auto=False).run_parser is False
    assert _plan(None) == ToolChoicePlan(run_parser=True, required=False)  # default with tools is auto
    assert _plan("auto") == ToolChoicePlan(run_parser=True, required=False)
    assert _plan("required", auto=False) == ToolChoicePlan(run_parser=True, required=True)
    named = {"type": "function", "function": {"name": "add"}}
    assert _plan(named, auto=False) == ToolChoicePlan(run_parser=True, required=True, function_name="add")


@pytest.mark.parametrize("choice,kwargs,match", [
    ("auto", {"auto": False}, "enable-auto-tool-choice"),
    (None, {"parser": None}, "enable-auto-tool-choice"),
    ("required", {"parser": None}, "tool-call-parser"),
    ("required", {"tools": None}, "requires `tools`"),
    ({"type": "function", "function": {"name": "sub"}}, {}, "not in `tools`"),
    ({"type": "function", "function": {}}, {}, "named tool_choice"),
    ({"type": "function", "function": {"name": "add"}}, {"tools": []}, "requires `tools`"),
    ("always", {}, "must be"),
])
def test_tool_choice_refusals(choice, kwargs, match):
    with pytest.raises(ToolChoiceError, match=match) as info:
        _plan(choice, **kwargs)
    assert info.value.param == "tool_choice" and isinstance(info.value, ValueError)


def test_unmet_tool_choice():
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    other = {"id": "d", "type": "function", "function": {"name": "sub", "arguments": "{}"}}
    required = ToolChoicePlan(run_parser=True, required=True)
    named = ToolChoicePlan(run_parser=True, required=True, function_name="add")
    assert unmet_tool_choice(required, []) == "tool_choice asked for a tool call but the model made no tool call"
    assert unmet_tool_choice(required, [other]) is None
    assert "'add'" in unmet_tool_choice(named, [])
    assert unmet_tool_choice(named, [call]) is None
    assert "['sub']" in unmet_tool_choice(named, [call, other])
    assert unmet_tool_choice(ToolChoicePlan(run_parser=True, required=False), []) is None
