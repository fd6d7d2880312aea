"""Reasoning parsers: split model output into `reasoning_content` and `content`.

`minimax_m3` (spec: shared/design/minimax_m3.md §4.2; marker strings from the MiniMax-M3 chat template as
reproduced by vLLM's and llama.cpp's MiniMax parsers): reasoning is `<mm:think>R</mm:think>`. Whether the output
starts inside reasoning is decided by the request (`chat_template_kwargs.thinking_mode == "enabled"`: the chat
template ends the prompt with `<mm:think>`), never by scanning the prompt, whose system block quotes both markers.

Rules, in the order the output is read:
* starting inside reasoning: an optional leading `<mm:think>` (after whitespace) is dropped; text up to the first
  `</mm:think>` is reasoning; no closer means the whole output is reasoning (a truncated turn);
* starting outside (`disabled` / `adaptive` / unset): a leading `<mm:think>` (after whitespace) opens reasoning as
  above; a leading bare `</mm:think>` (the "disabled" pre-close echoed) is dropped; anything else is content;
* once content has started, markers are ordinary text (one reasoning block per turn).
A partial marker at the end of the stream is flushed as text of the current section.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ladle.server.parsers.markers import split_at_marker

THINK_OPEN = "<mm:think>"
THINK_CLOSE = "</mm:think>"

_START_INSIDE, _START_OUTSIDE, _REASONING, _CONTENT = "start_inside", "start_outside", "reasoning", "content"


class ReasoningParser:
    """Streaming splitter of one request's output. One instance per request (and per choice when n > 1).

    Use either `feed(...)`* + `finish()` (streaming) or `extract(text)` (non-streaming), once.
    """

    name = ""

    @classmethod
    def for_request(cls, chat_template_kwargs: Optional[Mapping[str, Any]]) -> "ReasoningParser":
        """A parser for one request, its starting state taken from the request's `chat_template_kwargs`."""
        return cls()

    def feed(self, delta_text: str) -> tuple[str, str]:
        """Consume the next piece of output text; return `(reasoning_delta, content_delta)` (either may be "")."""
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        """End of output: flush text held back as a possible marker prefix; `(reasoning_delta, content_delta)`."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """Whole output -> `(reasoning_content or None, content or None)`; same result as streaming it."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2) or None, (c1 + c2) or None


class MiniMaxM3ReasoningParser(ReasoningParser):
    """`<mm:think>…</mm:think>` splitter (rules in the module docstring).

    Args:
        starts_in_reasoning: True when the prompt pre-opened reasoning (`thinking_mode == "enabled"`).
    """

    name = "minimax_m3"

    def __init__(self, starts_in_reasoning: bool = False):
        self.starts_in_reasoning = starts_in_reasoning
        self._state = _START_INSIDE if starts_in_reasoning else _START_OUTSIDE
        self._held = ""  # text not yet attributed (a possible marker prefix or leading whitespace)

    @classmethod
    def for_request(cls, chat_template_kwargs: Optional[Mapping[str, Any]]) -> "MiniMaxM3ReasoningParser":
        """Starting state from the request's `chat_template_kwargs.thinking_mode` ("enabled" -> inside)."""
        mode = (chat_template_kwargs or {}).get("thinking_mode")
        return cls(starts_in_reasoning=mode == "enabled")

    def feed(self, delta_text: str) -> tuple[str, str]:
        text, self._held = self._held + delta_text, ""
        reasoning, content = [], []
        while text:
            if self._state == _CONTENT:
                content.append(text)
                break
            if self._state == _REASONING:
                before, marker, after = split_at_marker(text, (THINK_CLOSE,))
                reasoning.append(before)
                if marker is None:
                    self._held = after
                    break
                self._state, text = _CONTENT, after
                continue
            text = self._leading(text)  # one of the two start states
            if text is None:
                break
        return "".join(reasoning), "".join(content)

    def _leading(self, text: str) -> Optional[str]:
        """Start states: decide from the first non-space characters; None = wait for more (text held)."""
        body = text.lstrip()
        openers = (THINK_OPEN,) if self._state == _START_INSIDE else (THINK_OPEN, THINK_CLOSE)
        for marker in openers:
            if body.startswith(marker):
                self._state = _REASONING if marker == THINK_OPEN else _CONTENT
                return body[len(marker):]
        if any(m.startswith(body) for m in openers):  # "" or a proper prefix of a marker: undecided
            self._held = text
            return None
        self._state = _REASONING if self._state == _START_INSIDE else _CONTENT
        return text

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state in (_START_INSIDE, _REASONING):
            return held, ""
        return "", held
