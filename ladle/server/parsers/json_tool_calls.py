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
                self._wait_for((self.CLOSE,))  # nothing changes before a closer arrives
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
    """`<|python_tag|>`? `{json}` (`;` `{json}`)* (module docstring).

    Streaming is linear in the output: a brace/string scanner follows each delta once and finds where the current
    object closes; the text is decoded only then (once per call), and the fed text is joined into the buffer only
    at such points (a call, malformed text, the end). Same results as decoding the whole buffer after every
    delta: a JSON object's text ends where its braces balance outside strings, and a balanced prefix that does not
    decode never decodes (the decoder stops at the error), so it waits for the end like an incomplete one.
    """

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._state = "deciding"  # -> "calls" | "content"
        self._ws = 0  # in "deciding": leading whitespace of self._buf already skipped
        self._decoder = json.JSONDecoder()
        # in "calls": self._buf holds the section from its start (from around the last call's end once a call was
        # made); self._tail the text fed since, not yet joined to it (self._tail_len characters).
        self._tail: list[str] = []
        self._tail_len = 0
        self._pos = 0  # where the next call (after separators) starts in self._buf
        self._at = 0  # how far the scanner has read, in self._buf + self._tail
        self._depth = 0  # brace depth of the object being read (0: between calls)
        self._in_str = self._escaped = False
        self._undecodable = False  # the object closed but did not decode: content once the output ends

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        if self._state != "calls":
            return super().feed(delta_text)
        offset = len(self._buf) + self._tail_len
        self._tail.append(delta_text)
        self._tail_len += len(delta_text)
        event = self._scan(delta_text, offset)
        if event is not None:  # a call closed or malformed text: join and parse
            self._parse_calls(final=False, event=event)
        return self._take()

    def _consume(self, final: bool) -> None:
        if self._state == "deciding":
            buf = self._buf
            while self._ws < len(buf) and buf[self._ws].isspace():  # what str.lstrip() strips
                self._ws += 1
            body = buf[self._ws:]
            if body.startswith(self.PYTHON_TAG) or body.startswith("{"):
                self._state = "calls"
                self._pos = self._at = self._ws + (len(self.PYTHON_TAG) if body.startswith(self.PYTHON_TAG) else 0)
            elif not final and self.PYTHON_TAG.startswith(body):  # "" or a prefix of the tag: undecided
                return
            else:
                self._state = "content"
        if self._state == "content":
            self._emit_content(self._buf)
            self._buf = ""
            return
        self._parse_calls(final)

    def _scan(self, text: str, offset: int) -> Optional[str]:
        """Read `text` (at `offset` in self._buf + self._tail) from self._at on: skip separators between calls
        (moving self._pos), follow braces and strings inside an object. Stops at "closed" (self._at just past the
        object's closing brace) or "malformed" (self._at at a character that cannot start a call); None when
        `text` ran out first."""
        if self._undecodable:
            self._at = offset + len(text)
            return None
        i = self._at - offset
        while i < len(text):
            c = text[i]
            i += 1
            if self._depth == 0:
                if c.isspace() or (c == ";" and self._num_calls > 0):
                    self._pos = offset + i
                    continue
                if c != "{":
                    self._at = offset + i - 1
                    return "malformed"
                self._depth = 1
            elif self._in_str:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c == "{":
                self._depth += 1
            elif c == "}":
                self._depth -= 1
                if self._depth == 0:
                    self._at = offset + i
                    return "closed"
        self._at = offset + len(text)
        return None

    def _parse_calls(self, final: bool, event: Optional[str] = None) -> None:
        """Join the fed text to the buffer and act on the scanner's events (`event`: one already found by
        `feed`): decode a closed object (a call, or malformed), treat malformed text as content, and at the end
        resolve what is left."""
        if self._tail:
            self._buf += "".join(self._tail)
            self._tail, self._tail_len = [], 0
        while True:
            found, event = event if event is not None else self._scan(self._buf, 0), None
            if found is None and not final:
                if self._num_calls > 0 and self._pos > 0:  # only what follows the last call is needed again
                    self._buf = self._buf[self._pos:]
                    self._at -= self._pos
                    self._pos = 0
                return
            if found is None and self._depth == 0 and not self._undecodable and self._num_calls > 0:
                self._buf = ""  # the output ended between calls
                return
            call = None  # the output ended inside an object or before any call, or malformed text: content
            if found == "closed":
                try:
                    obj, end = self._decoder.raw_decode(self._buf, self._pos)
                    call = call_from_json(obj, ("parameters", "arguments"))
                except (ValueError, RecursionError):  # not JSON, or nested too deep for the decoder
                    self._undecodable = True
                    continue  # it waits for the end, then it is content
            if call is None:  # malformed: the rest (or, with no call yet, everything) is content
                self._emit_content(self._buf if self._num_calls == 0 else self._buf[self._pos:])
                self._state, self._buf = "content", ""
                return
            self._emit_call(*call)
            self._pos = self._at = end
