"""Test helpers for the output parsers: chunkings of a text and the streamed result of a parser over them."""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable, Iterator


def chunkings(text: str, seed: int = 0, num_random: int = 12) -> Iterator[list[str]]:
    """The whole text; one character at a time; every split into two pieces (a marker cut at every position);
    random chunkings (fixed seed)."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(num_random):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def counter_ids() -> Callable[[], str]:
    """Deterministic tool-call ids: call_0, call_1, ..."""
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream_deltas(parser: Any, pieces: list[str]) -> list[dict[str, Any]]:
    deltas: list[dict[str, Any]] = []
    for piece in pieces:
        deltas += parser.feed(piece)
    return deltas + parser.finish()


def check_delta_shapes(deltas: list[dict[str, Any]]) -> None:
    """Every delta is content, reasoning or tool calls in OpenAI's streaming shape; each call's header (index, id,
    type, name, arguments "") comes before its arguments; indices count up from 0."""
    seen: list[int] = []
    for delta in deltas:
        assert len(delta) == 1, delta
        if "tool_calls" not in delta:
            (key, value), = delta.items()
            assert key in ("content", "reasoning_content") and isinstance(value, str) and value, delta
            continue
        (item,) = delta["tool_calls"]
        if "id" in item:
            assert item["index"] == len(seen) and item["type"] == "function", item
            assert item["function"]["arguments"] == "" and isinstance(item["function"]["name"], str)
            seen.append(item["index"])
        else:
            assert item["index"] in seen and set(item) == {"index", "function"}
            assert set(item["function"]) == {"arguments"}
