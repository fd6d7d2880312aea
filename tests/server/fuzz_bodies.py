"""Hypothesis strategies for request bodies of /v1/completions, /v1/chat/completions, /tokenize and /detokenize,
and the property every response must have (2xx, or 4xx with an OpenAI error body; never 5xx).

A body is a field map where each field is, at random, a plausible value or a wild one (any JSON value: text with
lone surrogates, control and zero-width characters; NaN / Infinity literals, 1e308, 2**70; nested lists and
dicts); fields go missing, unknown ones appear, and now and then the whole body is not an object or not JSON.
`Scale` keeps the bodies cheap: the real model gets short prompts, few tokens and few choices.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Optional

from hypothesis import strategies as st

SPECIAL_TEXT = ["\ud800", "\udfff", "a\udc80b", "\x00", "\x1b[31m", "\u200b", "\u200d", "\ufeff", "\u202e",
                "\U0010ffff", "😀", "你好", "\r\n", "\t", "<|im_start|>", "<|im_end|>", "{{ raise_exception('x') }}",
                "{% for %}", "</s>", "\\u0000", " " * 64]
EXTREME_NUMBERS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1e-40, 3.5e38, -0.0, 2 ** 63,
                   2 ** 64 + 1, 10 ** 30, -(2 ** 63) - 1, 0, -1, 1, 0.5]


@dataclass(frozen=True)
class Scale:
    text_len: int = 40         # characters per generated text piece
    list_len: int = 6          # ordinary list lengths (messages, stop strings, prompts)
    huge_list: int = 300       # "huge list" cases (beyond the default limits of the fuzzed server)
    max_tokens: int = 8        # largest plausible max_tokens
    n: int = 3                 # largest plausible n
    vocab: int = 258           # token ids beyond this are out of range


FAKE = Scale()
REAL = Scale(text_len=16, list_len=3, huge_list=80, max_tokens=3, n=2, vocab=49152)


def text(scale: Scale) -> st.SearchStrategy[str]:
    """Arbitrary unicode, surrogates included (Hypothesis leaves category Cs out unless asked)."""
    any_char = st.characters(exclude_categories=())
    piece = st.one_of(st.text(any_char, max_size=scale.text_len), st.sampled_from(SPECIAL_TEXT),
                      st.text(st.sampled_from("ab \n.,"), min_size=1, max_size=scale.text_len))
    return st.lists(piece, max_size=3).map("".join)


def numbers() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(EXTREME_NUMBERS), st.floats(), st.integers(-(2 ** 70), 2 ** 70))


def wild(scale: Scale) -> st.SearchStrategy[Any]:
    """Any JSON value (NaN and Infinity included, as Python's json reads them)."""
    scalar = st.one_of(st.none(), st.booleans(), numbers(), text(scale))
    return st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(text(scale), inner, max_size=4)),
                        max_leaves=8)


def _or_wild(scale: Scale, plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(plausible, plausible, plausible, wild(scale))


def _sampling_fields(scale: Scale) -> dict[str, st.SearchStrategy[Any]]:
    prob = st.floats(0, 1)
    return {
        "n": st.integers(1, scale.n),
        "temperature": st.one_of(st.sampled_from([0, 0.7, 1.0, 1e-30, 1e-40]), st.floats(0, 5)),
        "top_p": prob, "top_k": st.integers(-1, 100), "min_p": prob,
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.one_of(st.floats(0.5, 2), st.sampled_from([1e-30, 1e30, 1e-38])),
        "seed": st.integers(-(2 ** 70), 2 ** 70),
        "stop": st.one_of(text(scale), st.lists(text(scale), max_size=scale.list_len)),
        "stop_token_ids": st.lists(st.integers(-2, scale.vocab + 2), max_size=scale.list_len),
        "max_tokens": st.integers(0, scale.max_tokens), "min_tokens": st.integers(0, scale.max_tokens),
        "ignore_eos": st.booleans(), "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                              "continuous_usage_stats": st.booleans()}),
        "user": text(scale), "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
        "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=2),
    }


def _body(scale: Scale, required: dict, optional: dict) -> st.SearchStrategy[Any]:
    """A JSON object with `required` fields (each sometimes missing or wild) and `optional` ones (each sometimes
    present, plausible or wild), plus unknown fields; sometimes not an object at all."""
    req = {k: _or_wild(scale, v) for k, v in required.items()}
    opt = {k: _or_wild(scale, v) for k, v in optional.items()}
    unknown = st.dictionaries(text(scale).filter(lambda k: k not in required and k not in optional), wild(scale),
                              max_size=2)
    dropped = st.sets(st.sampled_from(sorted(required))) if required else st.just(set())
    obj = st.tuples(st.fixed_dictionaries(req, optional=opt), unknown, dropped) \
        .map(lambda t: {**{k: v for k, v in t[0].items() if k not in t[2]}, **t[1]})
    return st.one_of(obj, obj, obj, obj, obj, obj, obj, wild(scale))


def prompt(scale: Scale) -> st.SearchStrategy[Any]:
    ids = st.lists(st.integers(-3, scale.vocab + 3), max_size=scale.list_len * 4)
    return st.one_of(text(scale), st.lists(text(scale), max_size=scale.list_len), ids,
                     st.lists(ids, max_size=scale.list_len),
                     st.lists(st.just("x"), min_size=scale.huge_list, max_size=scale.huge_list))


def content(scale: Scale) -> st.SearchStrategy[Any]:
    part = st.fixed_dictionaries({"type": st.one_of(st.just("text"), st.sampled_from(["image_url", "audio"]),
                                                    wild(scale)),
                                  "text": _or_wild(scale, text(scale))})
    nested = st.lists(st.lists(part, max_size=2), max_size=2)  # content parts nested one level too deep
    return st.one_of(st.none(), text(scale), st.lists(part, max_size=scale.list_len), nested)


def messages(scale: Scale) -> st.SearchStrategy[Any]:
    tool_call = st.fixed_dictionaries({"id": text(scale), "type": st.just("function"),
                                       "function": st.fixed_dictionaries({"name": text(scale),
                                                                          "arguments": text(scale)})})
    message = st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), text(scale)),
         "content": content(scale)},
        optional={"name": text(scale), "tool_calls": st.lists(_or_wild(scale, tool_call), max_size=2),
                  "tool_call_id": text(scale), "reasoning_content": text(scale)})
    return st.one_of(st.lists(_or_wild(scale, message), min_size=1, max_size=scale.list_len),
                     st.lists(st.just({"role": "user", "content": "hi"}), min_size=scale.huge_list,
                              max_size=scale.huge_list))


def tools(scale: Scale) -> st.SearchStrategy[Any]:
    tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": text(scale), "description": text(scale), "parameters": st.dictionaries(text(scale), wild(scale),
                                                                                       max_size=3)})})
    return st.lists(_or_wild(scale, tool), max_size=3)


def template_kwargs(scale: Scale) -> st.SearchStrategy[Any]:
    keys = st.one_of(st.sampled_from(["enable_thinking", "tokenize", "add_generation_prompt", "messages",
                                      "conversation", "return_dict"]), text(scale))
    return st.dictionaries(keys, wild(scale), max_size=3)


def completion_body(scale: Scale, model: str) -> st.SearchStrategy[Any]:
    optional = {**_sampling_fields(scale), "model": st.sampled_from([model, "no-such-model"]),
                "echo": st.booleans(), "logprobs": st.integers(0, 5), "suffix": text(scale),
                "best_of": st.integers(1, 2)}
    return _body(scale, {"prompt": prompt(scale)}, optional)


def chat_body(scale: Scale, model: str) -> st.SearchStrategy[Any]:
    optional = {**_sampling_fields(scale), "model": st.sampled_from([model, "no-such-model"]),
                "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
                "max_completion_tokens": st.integers(0, scale.max_tokens), "tools": tools(scale),
                "tool_choice": st.sampled_from(["none", "auto", "required"]),
                "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                "chat_template_kwargs": template_kwargs(scale), "add_generation_prompt": st.booleans(),
                "continue_final_message": st.booleans(), "echo": st.booleans()}
    return _body(scale, {"messages": messages(scale)}, optional)


def tokenize_body(scale: Scale, model: str) -> st.SearchStrategy[Any]:
    optional = {"model": st.just(model), "prompt": text(scale), "messages": messages(scale),
                "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
                "continue_final_message": st.booleans(), "chat_template_kwargs": template_kwargs(scale),
                "return_token_strs": st.booleans()}
    return _body(scale, {}, optional)


def detokenize_body(scale: Scale, model: str) -> st.SearchStrategy[Any]:
    return _body(scale, {"tokens": st.lists(st.integers(-3, scale.vocab + 3), max_size=scale.list_len * 4)},
                 {"model": st.just(model)})


ENDPOINTS = {"/v1/completions": completion_body, "/v1/chat/completions": chat_body, "/tokenize": tokenize_body,
             "/detokenize": detokenize_body}


def encode(body: Any) -> bytes:
    """JSON as Python writes it: lone surrogates escaped (\\ud800), NaN / Infinity as bare literals."""
    return json.dumps(body).encode()


def raw_bodies() -> st.SearchStrategy[bytes]:
    """Bytes that are not JSON, or JSON with invalid UTF-8 / an unpaired surrogate escape in a string."""
    return st.one_of(st.binary(max_size=64), st.sampled_from([
        b"", b"{", b"null", b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800"}', b'{"prompt": "\\udfff\\ud800"}',
        b'{"prompt": NaN, "temperature": -Infinity}', b'{"prompt": "a", "n": 1' + b"0" * 5000 + b"}",
        b'{"prompt": "a", "temperature": 1e999}', b"[" * 2000 + b"]" * 2000, b'{"prompt": "a"}' * 2]))


def cap_for_real(body: Any, max_tokens: int) -> Any:
    """Keep a body the real model must run cheap: a plausible max_tokens / max_completion_tokens above
    `max_tokens` (or a missing one, which means "everything left") becomes `max_tokens`."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and max_tokens < value <= 1 << 20:
            body[key] = max_tokens
    if "max_tokens" not in body:
        body["max_tokens"] = max_tokens
    return body


def check_response(status: int, content_type: str, payload: bytes, what: str) -> Optional[dict]:
    """Assert the property: 2xx, or 4xx with an OpenAI error body. A 200 stream holds no error event with a
    5xx code and ends with [DONE]. Returns the parsed JSON of a non-stream response."""
    assert status < 500, f"{what}: {status} {payload[:500]!r}"
    if status >= 400:
        err = json.loads(payload)["error"]
        assert set(err) == {"message", "type", "param", "code"}, (what, err)
        assert isinstance(err["message"], str) and err["message"] and err["code"] == status, (what, err)
        assert "Traceback" not in err["message"] and "internal error" not in err["message"], (what, err)
        return None
    assert 200 <= status < 300, (what, status)
    if content_type.startswith("text/event-stream"):
        text = payload.decode()
        assert text.endswith("data: [DONE]\n\n"), (what, text[-300:])
        for block in text.split("\n\n")[:-2]:
            event = json.loads(block[len("data: "):])
            assert "error" not in event or event["error"]["code"] < 500, (what, event)
        return None
    return json.loads(payload) if payload else None
