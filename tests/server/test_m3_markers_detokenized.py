"""MiniMax-M3's reasoning and tool-call markers are special tokens: with the synthetic M3 tokenizer
(ladle/tools/minimax_m3_tokenizer.py), token-by-token detokenization with `skip_special_tokens=False` (what the chat
handler asks for when a parser runs) hands the parsers every marker, and the end-of-turn token's text never
reaches the output; with the default `skip_special_tokens=True` the markers would be lost."""

from __future__ import annotations

import json
import random

import pytest

from ladle.core.outputs import EngineOutput
from ladle.core.sampling_params import SamplingParams
from ladle.engine.output_processor import OutputProcessor
from ladle.engine.tokenizer import load_tokenizer
from ladle.server.parsers import make_chat_output_parser
from ladle.tools.minimax_m3_tokenizer import EOS, write_tokenizer

NS = "]<]minimax[>["
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def m3_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("m3tok")
    write_tokenizer(str(out), vocab_size=1024, bos_id=1, eos_id=2, model_max_length=4096)
    return load_tokenizer(str(out))


def _detokenize(tokenizer, text: str, skip_special_tokens: bool) -> list[str]:
    """Text deltas of `text` + EOS generated one token at a time (finished by the EOS token)."""
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(EOS)]
    proc = OutputProcessor(tokenizer)
    prompt = tokenizer.encode("]~b]ai\n", add_special_tokens=False)
    proc.add_request("r", prompt, SamplingParams(max_tokens=len(ids), skip_special_tokens=skip_special_tokens))
    deltas = []
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        res = proc.process([EngineOutput("r", [tid], finish_reason="stop" if last else None)])
        deltas += [o.text_delta for ro in res.request_outputs for o in ro.outputs if o.text_delta]
    return deltas


def test_markers_reach_the_parsers(m3_tokenizer):
    city = random.choice(["Paris", "Oslo", "Lima"])
    days = random.randint(1, 9)
    output = (f"<mm:think>plan for {city}</mm:think>Checking.{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">\n"
              f"{NS}<city>{city}{NS}</city>\n{NS}<days>{days}{NS}</days>\n{NS}</invoke>\n{NS}</tool_call>")
    assert m3_tokenizer.convert_tokens_to_ids(NS) in m3_tokenizer.encode(output, add_special_tokens=False)
    deltas = _detokenize(m3_tokenizer, output, skip_special_tokens=False)
    assert "".join(deltas) == output  # every marker, and no end-of-turn text
    parser = make_chat_output_parser("minimax_m3", "minimax_m3", tools=TOOLS)
    bodies = [b for d in deltas for b in parser.feed(d)] + parser.finish()
    assert "".join(b.get("reasoning_content", "") for b in bodies) == f"plan for {city}"
    assert "".join(b.get("content", "") for b in bodies) == "Checking."
    args = "".join(tc["function"].get("arguments", "") for b in bodies for tc in b.get("tool_calls", []))
    assert json.loads(args) == {"city": city, "days": days} and parser.tools_called


def test_skipping_special_tokens_would_lose_them(m3_tokenizer):
    text = "".join(_detokenize(m3_tokenizer, f"<mm:think>r</mm:think>{NS}<tool_call>", skip_special_tokens=True))
    assert "<mm:think>" not in text and NS not in text
