"""One chat request's output handling: which parsers run (`--reasoning-parser`, `--tool-call-parser`, the request's
`tool_choice`), one `ChatOutputParser` per choice (n > 1: each choice has its own state), and the finish reason.

Rules:
* The tool-choice plan (`plan_tool_choice`) is made while the request is prepared; a refused `tools` /
  `tool_choice` is a 400 naming `tool_choice`.
* When any parser runs, the request is detokenized with `skip_special_tokens=False` (the MiniMax-M3 markers
  `<mm:think>`, `</mm:think>` and `]<]minimax[>[` are special tokens, as are Llama's `<|python_tag|>`; vLLM's tool
  parsers make the same change). The engine never puts the text of the token that ended the output (EOS or a
  stop token id) in the output, so the end-of-turn marker does not reach the client.
* `finish_reason` is "tool_calls" when the choice stopped by itself ("stop") after emitting a tool call (OpenAI's
  meaning: "the model called a tool"); "length" and "abort" are kept, the client must know the output was cut.
* `parallel_tool_calls: false` keeps the first parsed call (index 0) and drops the others, streaming and not; the
  text around them is kept. ladle cannot stop the model from writing more calls, so it filters them, as vLLM does
  (its `maybe_filter_parallel_tool_calls`, applied to both chat generators).
* A `tool_choice` the output missed ("required" with no call) is logged as a warning, the answer is returned as
  generated (tool_choice.py explains why).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ladle.config import ServerConfig
from ladle.server.errors import OpenAIError
from ladle.server.parsers import (ChatOutputParser, ToolChoiceError, make_chat_output_parser, plan_tool_choice,
                                  unmet_tool_choice)
from ladle.server.parsers.tool_call_base import assemble_deltas

logger = logging.getLogger("ladle.server")


class ChatOutputs:
    """Per-request parser setup and per-choice parsers.

    Args:
        limits: the server config (`tool_call_parser`, `reasoning_parser`, `enable_auto_tool_choice`).
        req: the ChatCompletionRequest (`tools`, `tool_choice`, `chat_template_kwargs`).
    Raises OpenAIError (400, param "tool_choice") for a refused tool choice.
    """

    def __init__(self, limits: ServerConfig, req: Any):
        try:
            self.plan = plan_tool_choice(req.tool_choice, req.tools, tool_parser=limits.tool_call_parser,
                                         enable_auto_tool_choice=limits.enable_auto_tool_choice)
        except ToolChoiceError as e:
            raise OpenAIError(str(e), 400, e.param) from None
        self.tool_parser = limits.tool_call_parser if self.plan.run_parser else None
        self.reasoning_parser = limits.reasoning_parser
        self.template_kwargs = req.chat_template_kwargs
        self.tools = req.tools
        self.first_call_only = req.parallel_tool_calls is False
        self._parsers: dict[int, ChatOutputParser] = {}
        self._calls: dict[int, list[dict[str, Any]]] = {}

    @property
    def active(self) -> bool:
        """True when the output goes through a parser (then special tokens are detokenized)."""
        return bool(self.tool_parser or self.reasoning_parser)

    def _parser(self, index: int) -> ChatOutputParser:
        parser = self._parsers.get(index)
        if parser is None:
            parser = make_chat_output_parser(self.reasoning_parser, self.tool_parser,
                                             chat_template_kwargs=self.template_kwargs, tools=self.tools)
            self._parsers[index] = parser
        return parser

    def feed(self, index: int, text_delta: str, final: bool) -> list[dict[str, Any]]:
        """Streaming: choice `index`'s next text -> OpenAI delta bodies (all held text too when `final`)."""
        if not self.active:
            return [{"content": text_delta}]
        parser = self._parser(index)
        bodies = (parser.feed(text_delta) if text_delta else []) + (parser.finish() if final else [])
        if self.first_call_only:
            bodies = [b for b in map(_first_call_only, bodies) if b]
        self._calls.setdefault(index, []).extend(b for b in bodies if "tool_calls" in b)
        if final:
            self._warn_unmet(assemble_deltas(self._calls.pop(index))[1])
        return bodies

    def message(self, index: int, text: str) -> dict[str, Any]:
        """Non-streaming: choice `index`'s whole text -> ChatResponseMessage fields
        (`content`, `reasoning_content`, `tool_calls`)."""
        if not self.active:
            return {"content": text}
        out = self._parser(index).extract(text)
        if self.first_call_only:
            out["tool_calls"] = out["tool_calls"][:1]
        self._warn_unmet(out["tool_calls"])
        return out

    def finish_reason(self, index: int, reason: Optional[str]) -> Optional[str]:
        """The finish reason to report: "tool_calls" for a choice that stopped after calling a tool."""
        parser = self._parsers.get(index)
        if reason == "stop" and parser is not None and parser.tools_called:
            return "tool_calls"
        return reason

    def _warn_unmet(self, tool_calls: list[dict[str, Any]]) -> None:
        if self.plan.run_parser and (message := unmet_tool_choice(self.plan, tool_calls)) is not None:
            logger.warning("%s; returning the output as generated", message)


def _first_call_only(body: dict[str, Any]) -> dict[str, Any]:
    """A delta body without its tool-call items past the first call (index > 0); {} when nothing is left."""
    if "tool_calls" not in body:
        return body
    items = [item for item in body["tool_calls"] if item["index"] == 0]
    rest = {k: v for k, v in body.items() if k != "tool_calls"}
    return dict(rest, tool_calls=items) if items else rest
