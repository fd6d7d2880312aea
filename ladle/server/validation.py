"""Checks at the edge: what a request may hold before anything reaches the tokenizer, the chat template or the
engine. Each failure is an OpenAIError(400) whose `param` names the field (a dotted path such as
`messages[0].content[1].text`).

- Text: every string of the request's known fields (and every key of their dicts) must be encodable as UTF-8;
  JSON may carry a lone UTF-16 surrogate ("\\ud800"), which Python keeps in the str and tokenizers refuse.
- Numbers: every float must be finite and inside float32's range (the sampler computes in float32, where 1e308
  is infinity).
- Fields (/v1/chat/completions, /v1/completions): a field ladle knows but does not honour (OpenAI's logit_bias,
  response_format json_schema, audio, ...; vLLM's guided_json, use_beam_search, ...) is refused unless its value
  is equivalent to leaving it out; an unknown field is refused; metadata fields no output depends on (user,
  metadata, safety_identifier, prompt_cache_key) pass. The message names the field and what ladle offers instead.
- stream_options: only with stream true (a response that is not streamed has no chunks to shape), never
  continuous_usage_stats.
- Limits (ServerConfig): n, logprobs / top_logprobs (also at most the vocabulary size), prompts per request, stop
  strings (count, length) and stop_token_ids (count, vocabulary range). max_tokens is bounded by max_model_len (resolve_max_tokens).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional

from pydantic import BaseModel

from ladle.config import ServerConfig
from ladle.server.errors import OpenAIError

FLOAT32_MAX = 3.4028234663852886e38  # largest finite IEEE-754 binary32 value


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
    """check_value on every declared field of a parsed request (check_request_fields checks the undeclared ones)."""
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
    stop_token_ids; and the fields ladle does not honour or does not know (check_request_fields)."""
    check_model_fields(req)
    check_request_fields(req)
    if req.stream_options is not None and req.stream is not True:  # OpenAI: only with stream true; refused, not ignored
        raise OpenAIError("stream_options applies to streamed responses only: send it with stream: true, or leave it "
                          "out (a response that is not streamed always carries usage)", 400, "stream_options")
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


# ---------------------------------------------------------------------------------------------- request fields
# Top-level request fields ladle knows but does not honour. Each entry: (off, what ladle offers instead); `off(value,
# req)` is True for the values equivalent to leaving the field out (clients send defaults), which are accepted.
# Sources: OpenAI's request bodies (github.com/openai/openai-openapi, openapi.yaml: CreateChatCompletionRequest,
# CreateCompletionRequest, CreateModelResponseProperties; the same lists in docs.rs/async-openai, types::chat::
# CreateChatCompletionRequest) and vLLM's extensions (vllm/entrypoints/openai/protocol.py: ChatCompletionRequest,
# CompletionRequest, the chat-/completion-sampling-params and -extra-params blocks).
Off = Callable[[Any, Any], bool]


def _is(*values: Any) -> Off:
    """Off for None and each of `values` (type-strict: True is not 1)."""
    return lambda v, req: v is None or any(type(v) is type(x) and v == x for x in values)


_NULL = _is()
_EMPTY = _is([], {})
_CONSTRAINED = "ladle has no constrained (guided / structured) decoding; leave it out"


def _no_bias(v: Any, req: Any) -> bool:
    return v is None or (isinstance(v, dict) and all(type(b) in (int, float) and b == 0 for b in v.values()))


def _text_format(v: Any, req: Any) -> bool:
    return v is None or v == {"type": "text"}


def _best_of_n(v: Any, req: Any) -> bool:
    return v is None or (type(v) is int and v == req.n)


def _equal_one(v: Any, req: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 1)


UNHONOURED_COMMON: dict[str, tuple[Off, str]] = {
    # OpenAI
    "logit_bias": (_no_bias, "ladle's sampler has no per-token bias; leave it out or send {}"),
    "response_format": (_text_format, 'ladle has no constrained decoding (JSON mode / JSON schema); leave it out or '
                                      'send {"type": "text"}'),
    "best_of": (_best_of_n, "ladle returns every sequence it samples (no best-of ranking); leave it out or set it "
                            "equal to n"),
    "service_tier": (_is("auto", "default"), 'ladle serves every request in one tier; leave it out or send "auto"'),
    # vLLM
    "use_beam_search": (_is(False), "ladle has no beam search; leave it out or false (n samples independently)"),
    "length_penalty": (_equal_one, "ladle has no beam search, so no length penalty; leave it out or 1.0"),
    "spaces_between_special_tokens": (_is(True), "ladle's detokenizer has one behaviour (vLLM's default, true); "
                                                 "leave it out"),
    "truncate_prompt_tokens": (_NULL, "ladle does not truncate prompts; shorten the prompt (a prompt longer than "
                                      "max_model_len is a 400)"),
    "prompt_logprobs": (_NULL, "ladle gives prompt logprobs through /v1/completions with echo: true and logprobs: k"),
    "allowed_token_ids": (_NULL, "ladle's sampler has no token allow-list; leave it out"),
    "bad_words": (_EMPTY, "ladle's sampler has no banned words; leave it out (stop / stop_token_ids end the output)"),
    "logits_processors": (_EMPTY, "ladle runs no per-request logits processors; leave it out"),
    "return_tokens_as_token_ids": (_is(False), "ladle returns token strings in logprobs; leave it out or false"),
    "return_token_ids": (_is(False), "ladle does not return token ids in responses; /tokenize gives them"),
    "priority": (_is(0), "ladle's scheduler serves requests first come, first served; leave it out or 0"),
    "request_id": (_NULL, "ladle makes its own response ids; send an X-Request-Id header (echoed back) instead"),
    "cache_salt": (_NULL, "ladle's prefix cache has no per-request salt; leave it out, or serve with "
                          "--no-enable-prefix-caching"),
    "kv_transfer_params": (_NULL, "ladle has no disaggregated prefill/decode; leave it out"),
    "vllm_xargs": (_EMPTY, "ladle has no custom request extensions; leave it out"),
    "mm_processor_kwargs": (_EMPTY, "ladle serves text-only models; leave it out"),
    "prompt_embeds": (_NULL, "ladle takes prompts as text or token ids; leave it out"),
    **{name: (_NULL, _CONSTRAINED) for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern", "structural_tag", "structured_outputs")},
}
UNHONOURED_CHAT: dict[str, tuple[Off, str]] = {
    # OpenAI
    "modalities": (lambda v, req: v is None or v == ["text"], 'ladle generates text only; leave it out or ["text"]'),
    "audio": (_NULL, "ladle generates text only; leave it out"),
    "prediction": (_NULL, "ladle has no predicted outputs (the output is the same without it); leave it out"),
    "web_search_options": (_NULL, "ladle has no web search; leave it out"),
    "reasoning_effort": (_NULL, "ladle does not pass reasoning_effort to the chat template; use chat_template_kwargs "
                                "(e.g. enable_thinking) where the model's template reads one"),
    "verbosity": (_NULL, "ladle has no verbosity control; leave it out (max_completion_tokens bounds the length)"),
    "store": (_is(False), "ladle keeps no completions to retrieve later; leave it out or false"),
    "prompt_cache_retention": (_is("in-memory", "in_memory"), "ladle's prefix cache keeps blocks only while memory "
                                                              "allows; leave it out"),
    "functions": (_EMPTY, "use tools (type function) instead: ladle parses tool calls for tools"),
    "function_call": (_is("none"), 'use tool_choice instead ("none", "auto" or a named function)'),
    # vLLM
    "echo": (_is(False), "ladle does not echo the last message in chat completions; /v1/completions has echo"),
    "include_reasoning": (_is(True), "ladle always returns reasoning_content when a reasoning parser runs; leave it "
                                     "out"),
    "add_special_tokens": (_is(False), "chat prompts carry the chat template's special tokens only; leave it out or "
                                       "false"),
    "documents": (_EMPTY, "ladle does not pass documents to the chat template; put them in the messages"),
    "chat_template": (_NULL, "ladle renders the model's own chat template; leave it out"),
    "prompt": (_NULL, "/v1/chat/completions takes messages; /v1/completions takes a prompt"),
}
UNHONOURED_COMPLETIONS: dict[str, tuple[Off, str]] = {
    "suffix": (_is(""), "ladle has no fill-in-the-middle; leave it out"),
    "add_special_tokens": (_is(True), "ladle adds the tokenizer's special tokens to text prompts; send the prompt as "
                                      "token ids to control them"),
    "messages": (_NULL, "/v1/completions takes a prompt; send messages to /v1/chat/completions"),
    **{name: (_EMPTY, "/v1/completions has no tool calls; use /v1/chat/completions")
       for name in ("tools", "tool_choice", "functions", "function_call")},
}
# Accepted whatever their value: identifiers and tags for the provider's logging, abuse monitoring or cache routing;
# no token of the output depends on them (OpenAI's `user`, `safety_identifier`, `metadata`, `prompt_cache_key`).
HARMLESS_FIELDS = frozenset({"metadata", "safety_identifier", "prompt_cache_key"})


def _shown(value: Any, limit: int = 80) -> str:
    """`value` as compact ASCII JSON, cut to `limit` characters (error messages quote what the client sent)."""
    s = json.dumps(value, ensure_ascii=True, default=str)
    return s if len(s) <= limit else s[:limit - 3] + "..."


UNHONOURED = {"/v1/chat/completions": {**UNHONOURED_COMMON, **UNHONOURED_CHAT},
              "/v1/completions": {**UNHONOURED_COMMON, **UNHONOURED_COMPLETIONS}}


def check_request_fields(req: BaseModel) -> None:
    """Refuse (400 naming the field) the top-level fields of a parsed request that ladle would otherwise ignore.

    req: a request model with extra="allow" (its undeclared fields are in `req.model_extra`) and a class attribute
    `api_path` ("/v1/completions"), which picks the table (UNHONOURED_COMMON plus the endpoint's own).
    A field of `unhonoured` passes only with an "off" value; one of HARMLESS_FIELDS always passes; any other
    undeclared field is unknown and refused, the message listing the fields ladle honours.
    """
    path = type(req).api_path
    unhonoured = UNHONOURED[path]
    extra = req.model_extra or {}
    unknown = []
    for name, value in extra.items():
        if name in unhonoured:
            off, offer = unhonoured[name]
            if not off(value, req):
                raise OpenAIError(f"{name}={_shown(value)} is not honoured by ladle: {offer}", 400, name)
        elif name not in HARMLESS_FIELDS:
            unknown.append(name)
    if unknown:
        names = ", ".join(_shown(n, 40) for n in sorted(unknown))
        honoured = ", ".join(sorted(type(req).model_fields))
        raise OpenAIError(f"unknown field{'s' if len(unknown) > 1 else ''} {names} for {path}: not a field of OpenAI's "
                          f"API or of vLLM's extensions that ladle knows, and ladle refuses what it would ignore; "
                          f"leave it out. Fields ladle honours: {honoured}; accepted with no effect on the output: "
                          f"{', '.join(sorted(HARMLESS_FIELDS))}", 400, sorted(unknown)[0])
    for name, value in extra.items():
        check_value(value, name)
