"""JSON tool-call formats of the Llama / Qwen families: `hermes` and `llama3_json`.

`hermes` (Hermes 2 Pro / Qwen2.5+ chat templates; format as described in NousResearch's Hermes-Function-Calling
README and vLLM's `hermes` parser docs): each call is `<tool_call>{"name": NAME, "arguments": {...}}</tool_call>`,
anywhere in the content; text around calls is content. A call left unclosed at the end of the output still counts
if its JSON is complete (a stop string may have eaten the closer).

`llama3_json` (Meta's Llama 3.1 "JSON based tool calling" prompt format, llama.com model card; vLLM's
`llama3_json` parser docs for the `<|python_tag|>` prefix and `;`-separated calls): the whole output is a tool
call section when it starts (after whitespace) with `<|python_tag|>` or `{`: one or more JSON objects
`{"name": NAME, "parameters": {...}}` (`"arguments"` accepted too) separated by `;`. Text after the last valid call
is content; if no call parses, the whole output is content.

Arguments are already typed JSON here, so no schema coercion is applied.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ladle.server.parsers.markers import split_at_marker
from ladle.server.parsers.tool_call_base import ToolCallParser


def call_from_json(obj: Any, argument_keys: tuple[str, ...]) -> Optional[tuple[str, dict[str, Any]]]:
    """`{"name": str, <argument key>: object or JSON-object string}` -> (name, arguments); None if malformed.
    A missing arguments key means no arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    args = obj[key] if key is not None else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


class HermesToolParser(ToolCallParser):
    """`<tool_call>{json}</tool_call>` (module docstring)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_call = False  # self._buf then holds the call body after OPEN

    def _consume(self, final: bool) -> None:
        while True:
            if not self._in_call:
                before, marker, self._buf = split_at_marker(self._buf, (self.OPEN,))
                self._emit_content(before)
                if marker is None:
                    return
                self._in_call = True
                continue
            end = self._buf.find(self.CLOSE)
            if end < 0 and not final:
                return
            body = self._buf if end < 0 else self._buf[:end]
            raw = self.OPEN + body + ("" if end < 0 else self.CLOSE)
            self._buf = "" if end < 0 else self._buf[end + len(self.CLOSE):]
            self._in_call = False
            self._resolve(body, raw)

    def _resolve(self, body: str, raw: str) -> None:
        try:
            call = call_from_json(json.loads(body), ("arguments", "parameters"))
        except (ValueError, RecursionError):  # not JSON, or nested too deep for the decoder
            call = None
        if call is None:
            self._emit_content(raw)
        else:
            self._emit_call(*call)


class Llama3JsonToolParser(ToolCallParser):
    """`<|python_tag|>`? `{json}` (`;` `{json}`)* (module docstring)."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._state = "deciding"  # -> "calls" | "content"
        self._pos = 0  # in "calls": parse position in self._buf (which keeps the section from its start)
        self._decoder = json.JSONDecoder()

    def _consume(self, final: bool) -> None:
        if self._state == "deciding":
            body = self._buf.lstrip()
            if body.startswith(self.PYTHON_TAG) or body.startswith("{"):
                self._state = "calls"
                self._pos = len(self._buf) - len(body)
                self._pos += len(self.PYTHON_TAG) if body.startswith(self.PYTHON_TAG) else 0
            elif not final and self.PYTHON_TAG.startswith(body):  # "" or a prefix of the tag: undecided
                return
            else:
                self._state = "content"
        if self._state == "content":
            self._emit_content(self._buf)
            self._buf = ""
            return
        self._parse_calls(final)

    def _parse_calls(self, final: bool) -> None:
        buf = self._buf
        while True:
            pos = self._skip_separators(buf, self._pos)
            if pos == len(buf) and not (final and self._num_calls == 0):
                if final:
                    self._buf = ""
                return
            call, end = None, pos
            if pos < len(buf) and buf[pos] == "{":
                try:
                    obj, end = self._decoder.raw_decode(buf, pos)
                    call = call_from_json(obj, ("parameters", "arguments"))
                except (ValueError, RecursionError):
                    if not final:
                        return  # maybe incomplete: wait for more text
            if call is None:  # malformed: the rest (or, with no call yet, everything) is content
                self._emit_content(buf if self._num_calls == 0 else buf[pos:])
                self._state, self._buf = "content", ""
                return
            self._emit_call(*call)
            self._pos = end

    def _skip_separators(self, buf: str, pos: int) -> int:
        while pos < len(buf) and (buf[pos].isspace() or (buf[pos] == ";" and self._num_calls > 0)):
            pos += 1
        return pos
