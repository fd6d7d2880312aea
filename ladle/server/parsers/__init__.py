"""Reasoning and tool-call parsers, by vLLM's `--reasoning-parser` / `--tool-call-parser` names.

Engine-independent (stdlib only). Wiring into the chat handler, per choice:

    plan = plan_tool_choice(req.tool_choice, req.tools, tool_parser=..., enable_auto_tool_choice=...)
    parser = make_chat_output_parser(reasoning_parser_name, tool_parser_name if plan.run_parser else None,
                                     chat_template_kwargs=req.chat_template_kwargs, tools=req.tools)
    streaming: for each text delta, parser.feed(delta) -> delta bodies; at the end parser.finish();
    non-streaming: parser.extract(text); finish_reason "tool_calls" when parser.tools_called.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ladle.server.parsers.chat_output import ChatOutputParser
from ladle.server.parsers.json_tool_calls import HermesToolParser, Llama3JsonToolParser
from ladle.server.parsers.minimax_m3_tool_calls import MiniMaxM3ToolParser
from ladle.server.parsers.reasoning import MiniMaxM3ReasoningParser, ReasoningParser
from ladle.server.parsers.tool_call_base import ToolCallParser, assemble_deltas, make_tool_call_id
from ladle.server.parsers.tool_choice import ToolChoiceError, ToolChoicePlan, plan_tool_choice, unmet_tool_choice

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"minimax_m3": MiniMaxM3ReasoningParser}
TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    "minimax_m3": MiniMaxM3ToolParser, "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
}


def _lookup(table: dict[str, type], kind: str, name: str) -> type:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; ladle has: {', '.join(sorted(table))}")
    return table[name]


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class registered as `name`; ValueError naming the known ones otherwise."""
    return _lookup(REASONING_PARSERS, "reasoning parser", name)


def get_tool_parser(name: str) -> type[ToolCallParser]:
    """The tool-call parser class registered as `name`; ValueError naming the known ones otherwise."""
    return _lookup(TOOL_PARSERS, "tool-call parser", name)


def make_chat_output_parser(reasoning_parser: Optional[str], tool_parser: Optional[str], *,
                            chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                            tools: Optional[list[dict[str, Any]]] = None) -> ChatOutputParser:
    """A fresh per-choice parser: reasoning state from `chat_template_kwargs`, tool schemas from `tools`.
    Pass `tool_parser=None` when the tool-choice plan says not to parse."""
    reasoning = get_reasoning_parser(reasoning_parser).for_request(chat_template_kwargs) if reasoning_parser else None
    calls = get_tool_parser(tool_parser)(tools) if tool_parser else None
    return ChatOutputParser(reasoning, calls)


def parser_flag_refusals(tool_call_parser: Optional[str], reasoning_parser: Optional[str],
                         enable_auto_tool_choice: bool) -> list[str]:
    """The refusals (one line each, naming the flag, the value and what ladle has) of the parser flags of
    `ladle serve`; [] when they are usable. Checked before the model loads."""
    refusals = []
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        refusals.append(f"--tool-call-parser {tool_call_parser}: unknown tool-call parser; ladle has "
                        f"{', '.join(sorted(TOOL_PARSERS))}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        refusals.append(f"--reasoning-parser {reasoning_parser}: unknown reasoning parser; ladle has "
                        f"{', '.join(sorted(REASONING_PARSERS))}")
    if enable_auto_tool_choice and tool_call_parser is None:
        refusals.append("--enable-auto-tool-choice: needs --tool-call-parser (one of "
                        f"{', '.join(sorted(TOOL_PARSERS))})")
    return refusals


__all__ = [
    "parser_flag_refusals",
    "REASONING_PARSERS", "TOOL_PARSERS", "get_reasoning_parser", "get_tool_parser", "make_chat_output_parser",
    "ChatOutputParser", "ReasoningParser", "MiniMaxM3ReasoningParser", "ToolCallParser", "MiniMaxM3ToolParser",
    "HermesToolParser", "Llama3JsonToolParser", "assemble_deltas", "make_tool_call_id",
    "ToolChoiceError", "ToolChoicePlan", "plan_tool_choice", "unmet_tool_choice",
]
