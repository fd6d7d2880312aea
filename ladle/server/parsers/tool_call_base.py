"""The streaming tool-call parser contract and the OpenAI delta shapes it produces.

A parser reads the assistant's content text (after the reasoning parser, if any) and yields OpenAI chat
`delta` bodies, in order:
* `{"content": "..."}` for ordinary text (text before, between and after calls, and malformed calls verbatim);
* per tool call, a header `{"tool_calls": [{"index": i, "id": "call_…", "type": "function",
  "function": {"name": NAME, "arguments": ""}}]}` followed by
  `{"tool_calls": [{"index": i, "function": {"arguments": JSON_STRING}}]}`.
Shape from OpenAI's chat streaming reference (ChatCompletionChunk.choices[].delta.tool_calls[], each with `index`,
and `id` / `type` / `function.name` on the first chunk of a call). A call is emitted once it is complete in the
text (its arguments in one piece), never partially; text that may still turn out to be a marker is held back.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable, Iterable, Optional


def make_tool_call_id() -> str:
    """OpenAI-style tool call id: `call_` + 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def tools_by_name(tools: Optional[Iterable[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Request `tools` (OpenAI format `[{"type": "function", "function": {"name", "parameters", ...}}]`) ->
    `{name: function dict}`; entries without a function name are skipped (request validation is not ours)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn
    return out


def assemble_deltas(deltas: Iterable[dict[str, Any]]) -> tuple[Optional[str], list[dict[str, Any]]]:
    """Streamed delta bodies -> `(content or None, tool calls)`, tool calls as OpenAI message dicts
    `{"id", "type": "function", "function": {"name", "arguments"}}` ordered by index."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        for item in delta.get("tool_calls") or ():
            call = calls.setdefault(item["index"], {"id": None, "type": "function",
                                                    "function": {"name": None, "arguments": ""}})
            call["id"] = item.get("id", call["id"])
            fn = item.get("function", {})
            call["function"]["name"] = fn.get("name", call["function"]["name"])
            call["function"]["arguments"] += fn.get("arguments", "")
    return "".join(content) or None, [calls[i] for i in sorted(calls)]


class ToolCallParser:
    """Base class: buffering, call numbering and delta emission. Subclasses implement `_consume(final)`, which
    reads `self._buf`, calls `_emit_content` / `_emit_call`, and leaves in `self._buf` only what must wait.

    Linear streaming: a `_consume` that returns waiting for one of a few markers (a call's closer) says so with
    `_wait_for(markers)`; until one of them occurs in the text fed since (a marker split across deltas included),
    `feed` only keeps the delta, joining nothing and calling nothing, so a long call costs O(its length), not
    O(length²). Same results: the subclass promises that, without a new occurrence of those markers, `_consume`
    on the longer buffer would change nothing.

    One instance per request choice. Use either `feed(...)`* + `finish()` or `extract(text)`, once.

    Args:
        tools: the request's `tools` list (OpenAI format); used for schema coercion where the format needs it.
        new_id: tool-call id factory (tests pass a deterministic one).
    """

    name = ""

    def __init__(self, tools: Optional[list[dict[str, Any]]] = None, *,
                 new_id: Callable[[], str] = make_tool_call_id):
        self.tools = tools_by_name(tools)
        self._new_id = new_id
        self._buf = ""
        self._out: list[dict[str, Any]] = []
        self._num_calls = 0
        self._waiting_for: tuple[str, ...] = ()  # set by _wait_for; cleared before every _consume
        self._pending: list[str] = []  # text fed while waiting, not yet joined to self._buf
        self._window = ""  # the last (longest marker - 1) characters fed, for a marker split across deltas

    @property
    def tools_called(self) -> bool:
        """True once any tool call was emitted (the choice then finishes with `finish_reason: "tool_calls"`)."""
        return self._num_calls > 0

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """Consume the next piece of content text; return the delta bodies now complete (possibly none)."""
        if self._waiting_for:
            self._pending.append(delta_text)
            window = self._window + delta_text
            if not any(m in window for m in self._waiting_for):
                keep = max(map(len, self._waiting_for)) - 1
                self._window = window[-keep:] if keep else ""
                return []
            self._join_pending()
        else:
            self._buf += delta_text
        self._consume(final=False)
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """End of output: resolve everything held (partial markers and unfinished calls become content)."""
        self._join_pending()
        self._consume(final=True)
        if self._buf:
            self._emit_content(self._buf)
            self._buf = ""
        return self._take()

    def extract(self, text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
        """Whole output -> `(content or None, [tool calls as OpenAI message dicts])`; same as streaming it."""
        return assemble_deltas(self.feed(text) + self.finish())

    # ------------------------------------------------------------------------------------ for subclasses
    def _consume(self, final: bool) -> None:
        raise NotImplementedError

    def _wait_for(self, markers: tuple[str, ...]) -> None:
        """Called by `_consume` as it returns: nothing changes until one of `markers` (non-empty strings) occurs in
        the text fed from now on, or the output ends."""
        self._waiting_for = markers
        keep = max(map(len, markers)) - 1
        self._window = self._buf[-keep:] if keep else ""

    def _join_pending(self) -> None:
        if self._pending:
            self._buf += "".join(self._pending)
            self._pending = []
        self._waiting_for, self._window = (), ""

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        if self._out and set(self._out[-1]) == {"content"}:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _emit_call(self, name: str, arguments: dict[str, Any]) -> None:
        index = self._num_calls
        self._num_calls += 1
        self._out.append({"tool_calls": [{"index": index, "id": self._new_id(), "type": "function",
                                          "function": {"name": name, "arguments": ""}}]})
        self._out.append({"tool_calls": [{"index": index,
                                          "function": {"arguments": json.dumps(arguments, ensure_ascii=False)}}]})

    def _take(self) -> list[dict[str, Any]]:
        out, self._out = self._out, []
        return out
