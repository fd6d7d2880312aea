"""One request choice's output text -> OpenAI chat deltas: reasoning first, then tool calls in the content.

The reasoning parser splits `reasoning_content` from content; only content goes on to the tool-call parser (calls
written while reasoning are not calls). Either parser may be absent.
"""

from __future__ import annotations

from typing import Any, Optional

from ladle.server.parsers.reasoning import ReasoningParser
from ladle.server.parsers.tool_call_base import ToolCallParser, assemble_deltas


class ChatOutputParser:
    """Streaming: `feed(delta_text)`* then `finish()`, each returning OpenAI delta bodies
    (`{"reasoning_content": s}`, `{"content": s}`, `{"tool_calls": [...]}`). Non-streaming: `extract(text)`.
    One instance per choice; use one mode, once."""

    def __init__(self, reasoning: Optional[ReasoningParser] = None, tools: Optional[ToolCallParser] = None):
        self.reasoning = reasoning
        self.tools = tools

    @property
    def tools_called(self) -> bool:
        """True once a tool call was emitted: finish the choice with `finish_reason: "tool_calls"`."""
        return self.tools is not None and self.tools.tools_called

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        reasoning, content = self.reasoning.feed(delta_text) if self.reasoning else ("", delta_text)
        return self._route(reasoning, content, final=False)

    def finish(self) -> list[dict[str, Any]]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._route(reasoning, content, final=True)

    def _route(self, reasoning: str, content: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if self.tools is None:
            return out + ([{"content": content}] if content else [])
        out += self.tools.feed(content) if content else []
        return out + (self.tools.finish() if final else [])

    def extract(self, text: str) -> dict[str, Any]:
        """Whole output -> `{"reasoning_content": str|None, "content": str|None, "tool_calls": [...]}`."""
        deltas = self.feed(text) + self.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
        content, calls = assemble_deltas(deltas)
        return {"reasoning_content": reasoning, "content": content, "tool_calls": calls}
