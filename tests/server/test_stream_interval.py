"""`--stream-interval N` (ServerConfig.stream_interval): a choice's first token and its finishing output go at once,
the others once N tokens arrived (vLLM's rule), so with one token per step and T tokens a choice streams
1 + ceil((T - 1) / N) chunks; the text, logprobs, tool calls and finish reason add up to the same as with N = 1.
The pacing is the request's RequestOutputStream's (the engine client wakes the consumer once per N tokens)."""

from __future__ import annotations

import asyncio
import math

import pytest

import golden_streams
from fake_engine import FakeEngineClient
from golden_streams import CASES, collect, load_golden
from ladle.config import ServerConfig
from ladle.engine.client import CompletionOutput, RequestOutput
from ladle.engine.output_stream import RequestOutputStream
from ladle.server.serving_common import ServingContext

SCRIPT = "Ladle streams tokens!"  # ASCII: one token per character, every output has text


def _summary(events: dict) -> dict:
    """Per choice: the concatenated text / content / reasoning, logprob tokens, tool-call pieces, finish reasons."""
    out = {}
    for index, group in events.items():
        s = {"text": "", "reasoning": "", "lp": [], "calls": {}, "finish": [], "stop": [], "usage": None}
        for e in group:
            if not e.get("choices"):
                s["usage"] = e["usage"]
                continue
            ch = e["choices"][0]
            delta = ch.get("delta", {"content": ch.get("text")})
            s["text"] += delta.get("content") or ""
            s["reasoning"] += delta.get("reasoning_content") or ""
            lp = ch.get("logprobs") or {}
            s["lp"] += lp.get("tokens") or [t["token"] for t in lp.get("content") or []]
            for tc in delta.get("tool_calls") or []:
                call = s["calls"].setdefault(tc["index"], {"name": "", "arguments": ""})
                call["name"] += (tc.get("function") or {}).get("name") or ""
                call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            s["finish"].append(ch.get("finish_reason"))
            s["stop"].append(ch.get("stop_reason"))
        s["finish"] = [f for f in s["finish"][:-1] if f] + s["finish"][-1:]  # only the last chunk finishes
        s["stop"] = [x for x in s["stop"] if x is not None]
        out[index] = s
    return out


@pytest.mark.parametrize("interval", [1, 4, 5, 100])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_chunk_count_follows_the_rule(monkeypatch, endpoint, interval):
    body = dict(max_tokens=100, temperature=0)
    body.update(prompt="Q") if endpoint == "completions" else body.update(messages=golden_streams.MESSAGES)
    monkeypatch.setitem(CASES, "interval_script", (endpoint, {}, SCRIPT, body))
    events = collect("interval_script", True, interval)["0"]
    role = 1 if endpoint == "chat" else 0
    assert len(events) == role + 1 + math.ceil((len(SCRIPT) - 1) / interval)
    choices = [e["choices"][0] for e in events[role:]]
    texts = [ch.get("text", ch.get("delta", {}).get("content")) for ch in choices]
    assert "".join(texts) == SCRIPT and len(texts[0]) == 1  # the first token at once
    assert all(len(t) == interval for t in texts[1:-1])
    assert [ch["finish_reason"] for ch in choices] == [None] * (len(choices) - 1) + ["stop"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_interval_4_adds_up_to_the_same_response(name):
    want = load_golden()[f"{name}/stream"]
    got = collect(name, True, 4)
    assert _summary(got) == _summary(want)
    if name not in ("cmpl_max_tokens_0", "chat_max_tokens_0"):
        assert sum(map(len, got.values())) < sum(map(len, want.values()))  # fewer chunks


def _paced(interval: int, outs: list[RequestOutput]) -> list[RequestOutput]:
    """What a consumer reads from a RequestOutputStream(interval) that it reads whenever `get` would not wait."""

    async def scenario():
        stream, got = RequestOutputStream(interval), []
        for out in outs:
            stream.put(out)
            if stream.ready():
                got.append(await stream.get())
        return got

    return asyncio.run(scenario())


def test_stream_merges_held_outputs():
    outs = [CompletionOutput(index=0, text_delta=c, token_ids_delta=[i], logprobs_delta=[[(i, -0.5, 1)]])
            for i, c in enumerate("abcdef")]
    outs[-1].finish_reason, outs[-1].text = "length", "abcdef"
    got = _paced(3, [RequestOutput("r", [1], [o], finished=o.finish_reason is not None) for o in outs])
    sent = [x for out in got for x in out.outputs]
    assert [(x.text_delta, x.token_ids_delta) for x in sent] == [("a", [0]), ("bcd", [1, 2, 3]), ("ef", [4, 5])]
    assert [len(x.logprobs_delta) for x in sent] == [1, 3, 2] and sent[-1].text == "abcdef"
    assert [x.finish_reason for x in sent] == [None, None, "length"] and outs[1].text_delta == "b"  # inputs untouched


@pytest.mark.parametrize("bad", [0, -2])
def test_interval_below_1_is_refused(bad):
    with pytest.raises(ValueError, match=f"--stream-interval {bad}: tokens per streamed chunk must be an integer >= 1"):
        ServingContext(FakeEngineClient(), None, limits=ServerConfig(stream_interval=bad))


def test_choices_are_paced_each_on_its_own():
    """n = 2: a choice that finishes goes at once, without the other choice's held tokens; those wait for theirs."""

    def out(tokens: dict, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", [1], [CompletionOutput(index=i, text_delta=t, token_ids_delta=[0] * len(t),
                                                         finish_reason="stop" if f else None)
                                        for i, (t, f) in tokens.items()], finished=finished)

    got = _paced(3, [out({0: ("a", 0), 1: ("x", 0)}), out({0: ("b", 0), 1: ("y", 1)}), out({0: ("c", 0)}),
                     out({0: ("d", 0)}), out({0: ("e", 0)}), out({0: ("f", 1)}, finished=True)])
    assert [[(c.index, c.text_delta) for c in o.outputs] for o in got] == [
        [(0, "a"), (1, "x")], [(1, "y")], [(0, "bcd")], [(0, "ef")]]
    assert [o.finished for o in got] == [False, False, False, True]


def test_paced_choices_count_each_sequence_once_in_the_latency_timer():
    """The paced outputs of the test above (6 steps; choice 1 stops at step 2, choice 0 is held around it) give the
    request timer 6 tokens per sequence, as unpaced outputs do. Taking each output's largest delta counted 7:
    choice 1's finish and choice 0's held tokens arrive in different outputs for the same steps."""
    from ladle.core.sampling_params import SamplingParams
    from ladle.server.metrics import RequestTimer
    from ladle.server.serving_common import PromptRun

    def out(tokens: dict, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", [1], [CompletionOutput(index=i, text_delta=t, token_ids_delta=[0] * len(t),
                                                         finish_reason="stop" if f else None)
                                        for i, (t, f) in tokens.items()], finished=finished)

    steps = [out({0: ("a", 0), 1: ("x", 0)}), out({0: ("b", 0), 1: ("y", 1)}), out({0: ("c", 0)}),
             out({0: ("d", 0)}), out({0: ("e", 0)}), out({0: ("f", 1)}, finished=True)]
    for interval in (1, 3):
        run = PromptRun(index=0, prompt_ids=[1], prompt_text="", params=SamplingParams(n=2),
                        timer=RequestTimer(None))
        for o in _paced(interval, steps):
            run.absorb(o)
        assert run.timer.num_tokens == 6 and run.finished, interval
