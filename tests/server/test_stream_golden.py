"""The lean streaming path (plain dicts, one encode per chunk) writes the same JSON as the pydantic-per-chunk code it
replaced: every event of both endpoints, streamed and not, compared with the golden responses that code wrote
(tests/server/data/golden_streams.jsonl; golden_streams.py says how), modulo ids and `created`."""

from __future__ import annotations

import pytest

from golden_streams import CASES, collect, load_golden

GOLDEN = load_golden()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_same_events_as_the_pydantic_chunks(name, stream):
    key = f"{name}/{'stream' if stream else 'plain'}"
    got = collect(name, stream)
    want = GOLDEN[key]
    if stream:
        assert sorted(got) == sorted(want), key
        for index in want:
            assert len(got[index]) == len(want[index]), (key, index)
            for k, (g, w) in enumerate(zip(got[index], want[index])):
                assert g == w, (key, index, k)
    else:
        assert got == want


def test_golden_covers_what_it_claims():
    """The cases exercise logprobs, n > 1, usage, stop strings and the parsers (else the comparison proves little)."""
    streamed = {k: v for k, v in GOLDEN.items() if k.endswith("/stream")}
    choices = [ch for events in streamed.values() for group in events.values() for e in group
               for ch in e.get("choices", [])]
    assert any(ch.get("logprobs") and ch["logprobs"].get("top_logprobs") for ch in choices)  # completions logprobs
    assert any(ch.get("logprobs") and ch["logprobs"].get("content") for ch in choices)  # chat logprobs
    assert any(ch["delta"].get("tool_calls") for ch in choices if "delta" in ch)
    assert any(ch["delta"].get("reasoning_content") for ch in choices if "delta" in ch)
    assert {ch.get("finish_reason") for ch in choices} >= {"stop", "length", "tool_calls"}
    assert any(isinstance(ch.get("stop_reason"), str) for ch in choices)
    assert sum("none" in events for events in streamed.values()) >= 4  # usage chunks
    assert any("1" in events for events in streamed.values())  # n > 1 / several prompts
