"""Checks at the edge: what a request may hold before anything reaches the tokenizer, the chat template or the
engine. Each failure is an OpenAIError(400) whose `param` names the field (a dotted path such as
`messages[0].content[1].text`).

- Text: every string of the request's known fields (and every key of their dicts) must be encodable as UTF-8;
  JSON may carry a lone UTF-16 surrogate ("\\ud800"), which Python keeps in the str and tokenizers refuse.
- Numbers: every float must be finite and inside float32's range (the sampler computes in float32, where 1e308
  is infinity).
- Limits (ServerConfig): n, logprobs / top_logprobs (also at most the vocabulary size), prompts per request, stop
  strings (count, length) and stop_token_ids (count, vocabulary range). max_tokens is bounded by max_model_len (resolve_max_tokens).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from pydantic import BaseModel

from ladle.config import ServerConfig
from ladle.server.errors import OpenAIError

FLOAT32_MAX = 3.4028234663852886e38  # largest finite IEEE-754 binary32 value
# chat_template_kwargs keys that would override what the server passes to `apply_chat_template` itself.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "tools",
    "documents", "chat_template", "return_tensors", "return_dict", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs",
})


def _bad_text(s: str) -> Optional[int]:
    """Index of the first character UTF-8 cannot encode (a lone surrogate), or None."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def check_value(value: Any, param: str) -> None:
    """Walk `value` (str / float / int / bool / None / list / dict, as parsed JSON) and raise a 400 naming the path
    of the first string UTF-8 cannot encode or the first float that is not finite in float32."""
    if isinstance(value, str):
        pos = _bad_text(value)
        if pos is not None:
            raise OpenAIError(f"{param} is not valid Unicode text: it holds a lone UTF-16 surrogate "
                              f"(U+{ord(value[pos]):04X}) at character {pos}", 400, param)
    elif isinstance(value, float):
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise OpenAIError(f"{param} must be a finite number (within float32 range), got {value!r}", 400, param)
    elif isinstance(value, BaseModel):
        check_model_fields(value, param)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_value(item, f"{param}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_value(key, f"{param} key")
            check_value(item, f"{param}.{key}")


def check_model_fields(model: BaseModel, prefix: str = "") -> None:
    """check_value on every declared field of a parsed request (unknown fields were dropped by the parser)."""
    for name in type(model).model_fields:
        check_value(getattr(model, name), f"{prefix}.{name}" if prefix else name)


def check_int_range(value: Optional[int], low: int, high: int, param: str, hint: str = "") -> None:
    if value is not None and not low <= value <= high:
        raise OpenAIError(f"{param} must be in [{low}, {high}]{hint}, got {value}", 400, param)


def check_logprobs_count(value: Optional[int], limits: ServerConfig, vocab_size: int, param: str) -> None:
    """400 unless 0 <= value <= --max-logprobs, and at most the vocabulary size (top-k has no more to give)."""
    if vocab_size < limits.max_logprobs:
        check_int_range(value, 0, vocab_size, param, " (the vocabulary size)")
    check_int_range(value, 0, limits.max_logprobs, param, " (--max-logprobs)")


def check_sampling_fields(req: Any, limits: ServerConfig, vocab_size: int) -> None:
    """The fields both endpoints share (ladle.server.protocol._SamplingFields): text and numbers, n, stop strings,
    stop_token_ids."""
    check_model_fields(req)
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:  # refused, never ignored
        raise OpenAIError("not supported yet: stream_options.continuous_usage_stats (ladle sends usage once, in the "
                          "last chunk, with stream_options.include_usage)", 400, "stream_options")
    check_int_range(req.n, 1, limits.max_n, "n", " (--max-n)")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop_strings:
        raise OpenAIError(f"stop holds {len(stop)} strings; at most {limits.max_stop_strings} are allowed "
                          f"(--max-stop-strings)", 400, "stop")
    for i, s in enumerate(stop):
        if len(s) > limits.max_stop_string_chars:
            raise OpenAIError(f"stop[{i}] is {len(s)} characters long; at most {limits.max_stop_string_chars} are "
                              f"allowed (--max-stop-string-chars)", 400, "stop")
    ids = req.stop_token_ids or []
    if len(ids) > limits.max_stop_strings:
        raise OpenAIError(f"stop_token_ids holds {len(ids)} ids; at most {limits.max_stop_strings} are allowed "
                          f"(--max-stop-strings)", 400, "stop_token_ids")
    check_token_ids(ids, vocab_size, "stop_token_ids")


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """400 naming the first id outside [0, vocab_size)."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise OpenAIError(f"token id {t} in {param} is out of range [0, {vocab_size})", 400, param)


def check_template_kwargs(kwargs: Optional[dict], param: str = "chat_template_kwargs") -> None:
    """Keys that would replace an argument the server sets itself are refused (they raise inside the template
    call, or change its return type)."""
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise OpenAIError(f"{param}.{key} is set by the server and cannot be overridden", 400, param)
