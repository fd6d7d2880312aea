"""The llama3_json tool-call parser streams in linear work: a long output fed one character at a time is decoded
once per call (not once per delta) and gives exactly the one-shot result."""

from __future__ import annotations

import json
import random

from ladle.server.parsers import Llama3JsonToolParser, assemble_deltas
from parser_streaming import check_delta_shapes, counter_ids, stream_deltas


class _CountingDecoder(json.JSONDecoder):
    """json.JSONDecoder counting raw_decode calls and the characters they were handed."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.chars = 0

    def raw_decode(self, s, idx=0):
        self.calls += 1
        self.chars += len(s) - idx
        return super().raw_decode(s, idx)


def _long_output(rng: random.Random, target: int) -> tuple[str, list[tuple[str, dict]]]:
    """`<|python_tag|>` then `;`-separated calls whose arguments hold strings with braces, quotes and escapes,
    nested objects and lists, until the text is about `target` characters long; then trailing words."""
    calls, text = [], "<|python_tag|>"
    while len(text) < target:
        pieces = ["{", "}", "\"", "\\", "[", "]", ";", " ", "é", "x", "\n", "ab"]
        args = {"s": "".join(rng.choice(pieces) for _ in range(rng.randint(50, 1500))),
                "nested": {"k": [rng.randint(-9, 9) for _ in range(rng.randint(1, 60))], "o": {"d": {"e": None}}},
                "f": rng.uniform(-1, 1)}
        calls.append((f"fn{len(calls)}", args))
        text += ("; " if len(calls) > 1 else "") + json.dumps({"name": calls[-1][0], "parameters": args})
    return text + " trailing words", calls


def test_streaming_a_long_output_decodes_each_call_once():
    text, calls = _long_output(random.Random(7), 20_000)
    assert len(text) >= 20_000 and len(calls) >= 5
    one_shot = Llama3JsonToolParser(new_id=counter_ids()).extract(text)
    assert one_shot[0] == "trailing words" and [c["function"]["name"] for c in one_shot[1]] == [n for n, _ in calls]
    assert [json.loads(c["function"]["arguments"]) for c in one_shot[1]] == [a for _, a in calls]

    parser = Llama3JsonToolParser(new_id=counter_ids())
    decoder = parser._decoder = _CountingDecoder()
    deltas = stream_deltas(parser, list(text))  # 1-character deltas
    check_delta_shapes(deltas)
    assert assemble_deltas(deltas) == one_shot
    # linear: one decode per call, each handed only what is left of the text (quadratic was ~len(text) decodes)
    assert decoder.calls <= len(calls) + 1, decoder.calls
    assert decoder.chars <= 2 * len(text), decoder.chars


def test_a_call_that_never_decodes_waits_for_the_end_without_decoding_again():
    # balanced braces, but not JSON: decoded once when the object closes, then nothing more until the end
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": \'g\'}' + " tail" * 2000
    parser = Llama3JsonToolParser(new_id=counter_ids())
    decoder = parser._decoder = _CountingDecoder()
    deltas = stream_deltas(parser, list(text))
    content, calls = assemble_deltas(deltas)
    assert (content, calls) == Llama3JsonToolParser(new_id=counter_ids()).extract(text)
    assert content == '{"name": \'g\'}' + " tail" * 2000 and [c["function"]["name"] for c in calls] == ["f"]
    assert decoder.calls == 2, decoder.calls
