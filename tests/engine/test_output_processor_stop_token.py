"""The token that ended a choice (EOS or a stop token id) is not detokenized into its text, also with
`skip_special_tokens=False` (which the chat parsers need for their special-token markers); with
`include_stop_str_in_output` it is (vLLM's behaviour)."""

from __future__ import annotations

import random

import pytest

from ladle.core.outputs import EngineOutput
from ladle.core.sampling_params import SamplingParams
from ladle.engine.output_processor import OutputProcessor

EOS = 300
SPECIAL = {EOS: "<|eot|>", 301: "<mm:think>"}


class _Tokenizer:
    """ids < 256 are bytes; 300/301 special tokens (skipped with skip_special_tokens)."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        out, buf = [], bytearray()
        for t in ids:
            if t in SPECIAL:
                out.append(buf.decode(errors="replace"))
                buf = bytearray()
                out.append("" if skip_special_tokens else SPECIAL[t])
            else:
                buf.append(t)
        return "".join(out) + buf.decode(errors="replace")


def _run(params: SamplingParams, ids: list[int], stop_reason=None) -> str:
    proc = OutputProcessor(_Tokenizer())
    proc.add_request("r", [65], params)
    text = ""
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        res = proc.process([EngineOutput("r", [tid], finish_reason="stop" if last else None,
                                         stop_reason=stop_reason if last else None)])
        text += "".join(o.text_delta for ro in res.request_outputs for o in ro.outputs)
    return text


@pytest.mark.parametrize("skip", [True, False])
def test_eos_text_never_reaches_the_output(skip):
    words = "".join(random.choice("abcdef ") for _ in range(random.randint(3, 12)))
    ids = [301] + list(words.encode()) + [EOS]
    text = _run(SamplingParams(max_tokens=50, skip_special_tokens=skip), ids)
    assert text == ("" if skip else "<mm:think>") + words


def test_stop_token_id_text_only_with_include_stop_str():
    ids = list(b"abc") + [ord("x")]
    assert _run(SamplingParams(max_tokens=50, stop_token_ids=[ord("x")]), ids, ord("x")) == "abc"
    params = SamplingParams(max_tokens=50, stop_token_ids=[ord("x")], include_stop_str_in_output=True)
    assert _run(params, ids, ord("x")) == "abcx"
