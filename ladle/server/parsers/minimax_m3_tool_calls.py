"""`minimax_m3` tool calls: MiniMax-M3's namespaced XML format (shared/design/minimax_m3.md §4.3).

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">
    ]<]minimax[>[<city>Paris]<]minimax[>[</city>
    ]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

Every structural tag carries the namespace token `]<]minimax[>[` (a special token: the server must detokenize with
`skip_special_tokens=False` for this parser to see it). A wrapper holds one or more invokes; parameters are tags
named after the argument; nested objects are nested tags; arrays are repeated `<item>` children. Leaf values are
coerced by the tool's JSON schema (`schema_coercion`). Only the namespaced wrapper opens a call (un-namespaced
`<tool_call>` is the MiniMax-M2 style, wrong for M3 per §4.3).

Tolerances (§4.3 "robust parsers"): the namespace may be missing on `<invoke …>`, `</invoke>` and `</tool_call>`;
parameter tags left open are closed at `</invoke>`; an invoke cut short by `</tool_call>` ends there. Parameter
tags without the namespace are NOT recognised (they would collide with literal markup inside string values), so such
an invoke is malformed.

Malformed parts become content, verbatim: a wrapper with no valid invoke is returned whole (markers included);
in a wrapper with valid invokes, the malformed invokes and stray text are returned (whitespace-only text dropped).
Streaming emits each call when its `</invoke>` (or the wrapper's end) arrives; content outside wrappers streams
immediately except a possible prefix of the wrapper opener; text inside a wrapper waits for the wrapper's end
only when it is not a valid call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from ladle.server.parsers.markers import find_first, split_at_marker
from ladle.server.parsers.schema_coercion import coerce_leaf, items_schema, property_schema, wants
from ladle.server.parsers.tool_call_base import ToolCallParser

NS = "]<]minimax[>["
CALL_OPEN = NS + "<tool_call>"
CALL_CLOSES = (NS + "</tool_call>", "</tool_call>")
INVOKE_OPENS = (NS + "<invoke", "<invoke")
INVOKE_CLOSE = "</invoke>"  # a namespace token before it is part of the invoke segment

_NS_RE = re.escape(NS)
_INVOKE_HEAD = re.compile(rf"(?:{_NS_RE})?<invoke\s+name\s*=\s*(?:\"([^\"]*)\"|'([^']*)')\s*>")
_INVOKE_TAIL = re.compile(rf"(?:{_NS_RE})?</invoke>\s*$")
_TAG = re.compile(rf"{_NS_RE}<(/?)([^\s<>/]+)\s*>")
MAX_DEPTH = 64  # deeper parameter nesting is malformed (keeps the recursive conversion far from Python's limit)


class _Malformed(Exception):
    pass


@dataclass
class _Element:
    name: str
    children: list["_Element"] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


def _parse_elements(body: str) -> Optional[_Element]:
    """Namespaced tags of an invoke body -> element tree under a nameless root; None on a stray closing tag or
    nesting deeper than MAX_DEPTH.
    A closing tag closes any inner elements still open; elements open at the end are closed there."""
    root = _Element("")
    stack = [root]
    pos = 0
    for m in _TAG.finditer(body):
        stack[-1].text.append(body[pos:m.start()])
        pos = m.end()
        closing, tag = m.group(1) == "/", m.group(2)
        if not closing:
            if len(stack) > MAX_DEPTH:
                return None
            stack[-1].children.append(_Element(tag))
            stack.append(stack[-1].children[-1])
        elif tag in (e.name for e in stack[1:]):
            while stack.pop().name != tag:
                pass
        else:
            return None
    stack[-1].text.append(body[pos:])
    return root


def _object_value(el: _Element, schema: Optional[dict[str, Any]]) -> dict[str, Any]:
    if "".join(el.text).strip():
        raise _Malformed(f"text beside the child tags of <{el.name}>")
    return {c.name: _element_value(c, property_schema(schema, c.name)) for c in el.children}


def _element_value(el: _Element, schema: Optional[dict[str, Any]]) -> Any:
    if not el.children:
        return coerce_leaf("".join(el.text), schema)
    if wants(schema, "array") or (not wants(schema, "object") and all(c.name == "item" for c in el.children)):
        if "".join(el.text).strip():
            raise _Malformed(f"text beside the items of <{el.name}>")
        return [_element_value(c, items_schema(schema)) for c in el.children]
    return _object_value(el, schema)


def parse_invoke(segment: str, tools: dict[str, dict[str, Any]]) -> Optional[tuple[str, dict[str, Any]]]:
    """One `<invoke name="…">…</invoke>` segment -> (tool name, arguments); None when malformed.

    Args:
        segment: from the invoke's opening tag through its (optional) closing tag.
        tools: `{name: OpenAI function dict}`; the function's `parameters` schema drives leaf coercion.
    """
    head = _INVOKE_HEAD.match(segment)
    if head is None:
        return None
    name = head.group(1) if head.group(1) is not None else head.group(2)
    body = segment[head.end():]
    tail = _INVOKE_TAIL.search(body)
    root = _parse_elements(body[: tail.start()] if tail else body)
    if not name.strip() or root is None:
        return None
    try:
        return name.strip(), _object_value(root, tools.get(name.strip(), {}).get("parameters"))
    except _Malformed:
        return None


class MiniMaxM3ToolParser(ToolCallParser):
    """Streaming parser of the M3 tool-call format (module docstring)."""

    name = "minimax_m3"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_call = False  # inside a wrapper: self._buf holds its unread text
        self._raw: list[str] = []  # the wrapper's text so far (returned whole if no invoke in it is valid)
        self._junk: list[str] = []  # its malformed invokes and stray text
        self._wrapper_calls = 0

    def _consume(self, final: bool) -> None:
        while True:
            if not self._in_call:
                before, marker, self._buf = split_at_marker(self._buf, (CALL_OPEN,))
                self._emit_content(before)
                if marker is None:
                    return
                self._in_call, self._raw, self._junk, self._wrapper_calls = True, [marker], [], 0
            elif not self._step_wrapper(final):
                return

    def _step_wrapper(self, final: bool) -> bool:
        """Consume the next unit inside a wrapper (close, invoke, stray text); False = wait for more text."""
        buf = self._buf
        body = buf.lstrip()
        ws = buf[: len(buf) - len(body)]
        close = next((c for c in CALL_CLOSES if body.startswith(c)), None)
        if close is not None or (final and not body):
            self._consume_wrapper_text(ws + (close or ""), junk=False)
            self._close_wrapper()
            return True
        if body.startswith(INVOKE_OPENS):
            end = body.find(INVOKE_CLOSE)
            stop = find_first(body, CALL_CLOSES)
            if end >= 0 and (stop is None or end < stop[0]):
                segment = body[: end + len(INVOKE_CLOSE)]
            elif stop is not None:  # the wrapper ends inside the invoke: the invoke ends there
                segment = body[: stop[0]]
            elif final:  # truncated invoke
                self._consume_wrapper_text(buf, junk=True)
                return True
            else:  # progress needs `</invoke>` or a wrapper closer (each ends with `</tool_call>`)
                self._wait_for((INVOKE_CLOSE, "</tool_call>"))
                return False
            call = parse_invoke(segment, self.tools)
            self._consume_wrapper_text(ws + segment, junk=call is None)
            if call is not None:
                self._wrapper_calls += 1
                self._emit_call(*call)
            return True
        hit = find_first(buf, INVOKE_OPENS + CALL_CLOSES, len(ws) + 1)
        if hit is None and not final:  # progress needs an invoke opener or a wrapper closer (their common tails)
            self._wait_for(("<invoke", "</tool_call>"))
            return False
        self._consume_wrapper_text(buf if hit is None else buf[: hit[0]], junk=True)
        return True

    def _consume_wrapper_text(self, text: str, junk: bool) -> None:
        self._buf = self._buf[len(text):]
        self._raw.append(text)
        if junk:
            self._junk.append(text)

    def _close_wrapper(self) -> None:
        if self._wrapper_calls == 0:
            self._emit_content("".join(self._raw))
        elif "".join(self._junk).strip():
            self._emit_content("".join(self._junk))
        self._in_call = False
