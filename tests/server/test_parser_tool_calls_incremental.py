"""The hermes and minimax_m3 tool-call parsers stream in linear work: while a call waits for its closer, a delta is
only kept (ToolCallParser._wait_for), so a long output fed one character at a time hands `_consume` O(length)
characters in all, and every feed returns exactly what the parser without waiting (consuming the whole buffer on
every delta) returned."""

from __future__ import annotations

import json
import random

import pytest

from ladle.server.parsers import HermesToolParser, MiniMaxM3ToolParser
from ladle.server.parsers.minimax_m3_tool_calls import NS
from parser_streaming import check_delta_shapes, counter_ids

PIECES = ["{", "}", "\"", "\\", "<", ">", "/", "tool", "call", "invoke", " ", "é", "x", "\n", "ab", "<tool_c", "</inv"]
TOOLS = [{"type": "function", "function": {"name": f"fn{i}", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "integer"}}}}} for i in range(64)]


def _words(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(low, high)))


def hermes_output(rng: random.Random, target: int) -> str:
    """Content, long calls (strings with braces, quotes, escapes, partial markers), a malformed call, and a last call
    left unclosed (complete JSON: it counts)."""
    text = "Intro. "
    while len(text) < target:
        args = {"s": _words(rng, 200, 1500), "n": rng.randint(-9, 9), "o": {"k": [1, {"d": None}]}}
        text += f"<tool_call>{json.dumps({'name': f'fn{rng.randint(0, 63)}', 'arguments': args})}</tool_call>"
        text += rng.choice(["", " and then ", "\n"])
    return text + '<tool_call>not json</tool_call> tail <tool_call>{"name": "fn1", "arguments": {}}'


def m3_output(rng: random.Random, target: int) -> str:
    """Content, wrappers of long invokes (values with `<`, `/`, partial markers), stray text inside a wrapper, and a
    last wrapper cut off inside an invoke."""
    def invoke() -> str:
        value = _words(rng, 200, 1500).replace("<", "&lt;")  # no literal tag inside a value
        return (f"{NS}<invoke name=\"fn{rng.randint(0, 63)}\">\n{NS}<s>{value}{NS}</s>\n{NS}<n>{rng.randint(-9, 9)}"
                f"{NS}</n>\n{NS}</invoke>\n")
    text = "Let me check."
    while len(text) < target:
        text += f"{NS}<tool_call>\n" + invoke() + rng.choice(["", "stray words\n"]) + invoke() + f"{NS}</tool_call>"
        text += rng.choice(["", " then ", "\n"])
    return text + f"{NS}<tool_call>\n" + invoke()[:300]


def _no_wait(cls):
    """The same parser without `_wait_for`: `_consume` on the whole buffer after every delta (the reference)."""
    return type(f"NoWait{cls.__name__}", (cls,), {"_wait_for": lambda self, markers: None})


def _run(parser, pieces: list[str]) -> tuple[list[list[dict]], int]:
    """Per-feed outputs (finish last) and the characters handed to `_consume` in all."""
    work = [0]
    consume = parser._consume

    def counting(final: bool) -> None:
        work[0] += len(parser._buf)
        consume(final)

    parser._consume = counting
    return [parser.feed(p) for p in pieces] + [parser.finish()], work[0]


@pytest.mark.parametrize("cls,make", [(HermesToolParser, hermes_output), (MiniMaxM3ToolParser, m3_output)],
                         ids=["hermes", "minimax_m3"])
def test_long_output_streams_in_linear_work_with_the_same_deltas(cls, make):
    rng = random.Random(11)
    text = make(rng, 20_000)
    assert len(text) >= 20_000
    chunkings = [list(text)]  # one character at a time, then random pieces (markers cut anywhere)
    for seed in range(3):
        r = random.Random(seed)
        cuts = sorted(r.sample(range(1, len(text)), k=400))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in chunkings:
        got, work = _run(cls(TOOLS, new_id=counter_ids()), pieces)
        want, reference_work = _run(_no_wait(cls)(TOOLS, new_id=counter_ids()), pieces)
        assert got == want  # the same deltas after the same feeds
        check_delta_shapes([d for out in got for d in out])
        if len(pieces) == len(text):
            assert sum(1 for out in got for d in out if "tool_calls" in d) >= 2 * 8  # the calls are there
            assert work <= 30 * len(text), work  # held marker prefixes between calls, each call's text once
            assert reference_work > 50 * len(text), reference_work  # the counter sees the quadratic reference


def test_a_marker_split_across_many_deltas_is_seen():
    text = "a<tool_call>" + '{"name": "f", "arguments": {"x": 1}}' + "</tool_call>b"
    for cut in range(1, 12):  # `</tool_call>` arrives in pieces of `cut` characters
        head, close = text[:-13], text[-13:-1]
        pieces = [head, *[close[i:i + cut] for i in range(0, len(close), cut)], "b"]
        got, _ = _run(HermesToolParser(new_id=counter_ids()), pieces)
        assert got == _run(_no_wait(HermesToolParser)(new_id=counter_ids()), pieces)[0]
        assert any("tool_calls" in d for d in got[-3]), got  # out with the closer's last piece, before "b"
