"""What a request's `tool_choice` asks of the tool-call parser, and whether the output met it.

Request-time rules (OpenAI's `tool_choice`; server flags as in vLLM's `--enable-auto-tool-choice`,
`--tool-call-parser`):
* no `tools`: `none`, `auto` or unset -> no parsing; `required` or a named function -> refused.
* `none` -> no parsing (the output is plain content even if it looks like a call).
* `auto` (also the default when `tools` is given, as in OpenAI and vLLM) -> parse; refused unless the server runs
  with `--enable-auto-tool-choice` and a `--tool-call-parser`.
* `required` / `{"type": "function", "function": {"name": N}}` -> parse; refused without a `--tool-call-parser`;
  a named function must be one of `tools`.

Decision for outputs that miss the choice (`required` with no call, or a call to another function than the named
one): ladle has no constrained decoding, so it cannot force a call. The response is returned as generated (content
and whatever calls were parsed, `finish_reason` from what happened) and `unmet_tool_choice` gives the message to log
as a warning. Failing the request after generation would discard a valid answer, and OpenAI's schema has no field
for "choice not met".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ladle.server.parsers.tool_call_base import tools_by_name


class ToolChoiceError(ValueError):
    """`tools` / `tool_choice` the server refuses: map to HTTP 400 with `param` "tool_choice"."""

    param = "tool_choice"


@dataclass(frozen=True)
class ToolChoicePlan:
    run_parser: bool  # parse the output for tool calls
    required: bool  # the client asked for at least one call ("required" or a named function)
    function_name: Optional[str] = None  # the named function, if any


def plan_tool_choice(tool_choice: Union[None, str, dict[str, Any]], tools: Optional[list[dict[str, Any]]], *,
                     tool_parser: Optional[str], enable_auto_tool_choice: bool) -> ToolChoicePlan:
    """The plan for one request (rules in the module docstring). Raises ToolChoiceError for a refused request."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none" or (tool_choice == "auto" and not tools):
        return ToolChoicePlan(run_parser=False, required=False)
    if tool_choice not in ("auto", "required") and not isinstance(tool_choice, dict):
        raise ToolChoiceError(f"tool_choice must be \"none\", \"auto\", \"required\" or "
                              f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}")
    if not tools:
        raise ToolChoiceError("tool_choice other than \"none\" or \"auto\" requires `tools`")
    if tool_choice == "auto" and not (enable_auto_tool_choice and tool_parser):
        raise ToolChoiceError("\"auto\" tool choice requires the server to run with --enable-auto-tool-choice "
                              "and --tool-call-parser")
    if not tool_parser:
        raise ToolChoiceError("tool_choice \"required\" or a named function requires the server to run with "
                              "--tool-call-parser")
    if tool_choice == "required" or tool_choice == "auto":
        return ToolChoicePlan(run_parser=True, required=tool_choice == "required")
    name = _named_function(tool_choice)
    if name not in tools_by_name(tools):
        raise ToolChoiceError(f"tool_choice names function {name!r}, which is not in `tools`")
    return ToolChoicePlan(run_parser=True, required=True, function_name=name)


def _named_function(tool_choice: dict[str, Any]) -> str:
    fn = tool_choice.get("function")
    if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolChoiceError(f"a named tool_choice must be {{\"type\": \"function\", \"function\": "
                              f"{{\"name\": ...}}}}, got {tool_choice!r}")
    return fn["name"]


def unmet_tool_choice(plan: ToolChoicePlan, tool_calls: list[dict[str, Any]]) -> Optional[str]:
    """A warning message when the parsed `tool_calls` (OpenAI message dicts) miss the plan; None when met."""
    if plan.required and not tool_calls:
        wanted = f"function {plan.function_name!r}" if plan.function_name else "a tool call"
        return f"tool_choice asked for {wanted} but the model made no tool call"
    if plan.function_name is not None:
        others = sorted({c["function"]["name"] for c in tool_calls} - {plan.function_name})
        if others:
            return f"tool_choice named {plan.function_name!r} but the model also called {others}"
    return None
