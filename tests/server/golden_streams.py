"""Golden responses of both endpoints, streamed and not, over the fake engine (no HTTP: the handlers are called as
the app calls them, and the StreamingResponse body is read as Starlette would send it).

`tests/server/data/golden_streams.jsonl` was written by the pydantic-per-chunk streaming code (before the lean output
path) with `python tests/server/golden_streams.py --write`; test_stream_golden.py checks that today's code produces
the same events, parsed, per choice index (ids, `created` and tool-call ids are random: normalised).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeEngineClient  # noqa: E402
from ladle.config import ServerConfig  # noqa: E402
from ladle.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402
from ladle.server.serving_chat import ChatHandler  # noqa: E402
from ladle.server.serving_common import ServingContext  # noqa: E402
from ladle.server.serving_completions import CompletionHandler  # noqa: E402

GOLDEN_PATH = os.path.join(os.path.dirname(__file__), "data", "golden_streams.jsonl")
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
NS = "]<]minimax[>["
M3_SCRIPT = (f"<mm:think>The user wants Paris, 3 days.</mm:think>Let me check.{NS}<tool_call>\n"
             f"{NS}<invoke name=\"get_weather\">\n{NS}<city>Paris{NS}</city>\n{NS}<days>3{NS}</days>\n"
             f"{NS}</invoke>\n{NS}</tool_call>")
HERMES_SCRIPT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
                 '</tool_call>')
M3 = dict(tool_call_parser="minimax_m3", reasoning_parser="minimax_m3", enable_auto_tool_choice=True)
HERMES = dict(tool_call_parser="hermes", enable_auto_tool_choice=True)
USAGE = {"stream_options": {"include_usage": True}}

# name -> (endpoint, server config, engine script, request body without `stream`)
CASES: dict[str, tuple[str, dict, Any, dict]] = {
    "cmpl_greedy": ("completions", {}, None, dict(prompt="Hello", max_tokens=24, temperature=0)),
    "cmpl_logprobs_n2_echo": ("completions", {}, None, dict(prompt="Hi", max_tokens=12, temperature=0.7, seed=5,
                                                            n=2, logprobs=2, echo=True)),
    "cmpl_stop_usage": ("completions", {}, None, dict(prompt="Hello", max_tokens=80, temperature=0, stop=["fox"],
                                                      **USAGE)),
    "cmpl_stop_included_ids": ("completions", {}, None, dict(prompt=[72, 105], max_tokens=80, temperature=0,
                                                             stop=["brown", "zzz"], include_stop_str_in_output=True)),
    "cmpl_two_prompts_usage": ("completions", {}, None, dict(prompt=["Hello", "Bye"], max_tokens=10, temperature=0,
                                                             logprobs=0, **USAGE)),
    "cmpl_script_stop": ("completions", {}, "short answer.", dict(prompt="Q", max_tokens=50, temperature=0)),
    "cmpl_max_tokens_0": ("completions", {}, None, dict(prompt="Hello", max_tokens=0, echo=True, logprobs=1,
                                                        **USAGE)),
    "chat_greedy_usage": ("chat", {}, None, dict(messages=MESSAGES, max_tokens=24, temperature=0, **USAGE)),
    "chat_logprobs_n2": ("chat", {}, None, dict(messages=MESSAGES, max_tokens=12, temperature=0.5, seed=3, n=2,
                                                logprobs=True, top_logprobs=2)),
    "chat_logprobs_0": ("chat", {}, None, dict(messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True)),
    "chat_stop": ("chat", {}, None, dict(messages=MESSAGES, max_tokens=80, temperature=0, stop=["quick"])),
    "chat_max_tokens_0": ("chat", {}, None, dict(messages=MESSAGES, max_tokens=0, **USAGE)),
    "chat_m3_tools_reasoning": ("chat", M3, M3_SCRIPT, dict(messages=MESSAGES, tools=TOOLS, temperature=0,
                                                            max_tokens=400, **USAGE)),
    "chat_hermes_tools_n2_logprobs": ("chat", HERMES, HERMES_SCRIPT, dict(messages=MESSAGES, tools=TOOLS, n=2,
                                                                          temperature=0, max_tokens=400, logprobs=True,
                                                                          top_logprobs=1)),
    "chat_m3_reasoning_cut": ("chat", M3, M3_SCRIPT, dict(messages=MESSAGES, temperature=0, max_tokens=20)),
}


def _normalise(value: Any) -> Any:
    """Random fields out: `id` of a response / chunk, `created`, tool-call ids."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "created" and isinstance(v, int):
                v = 0
            elif k == "id" and isinstance(v, str):
                v = v.split("-", 1)[0] if "-" in v else v.split("_", 1)[0] + "_*"
            out[k] = _normalise(v)
        return out
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    return value


def group_events(events: list) -> dict[str, list]:
    """Events per choice index (merge_runs interleaves prompts in arrival order, which may vary), plus the
    choice-less ones (usage) under "none"."""
    out: dict[str, list] = {}
    for e in events:
        choices = e.get("choices") or [None]
        key = str(choices[0]["index"]) if choices[0] is not None else "none"
        out.setdefault(key, []).append(e)
    return out


async def _run(name: str, stream: bool, stream_interval: int = 1) -> Any:
    endpoint, config, script, body = CASES[name]
    if not stream:  # stream_options belongs to streamed requests (400 otherwise); the plain response has usage anyway
        body = {k: v for k, v in body.items() if k != "stream_options"}
    engine = FakeEngineClient(step_delay=0)
    engine.script = script
    limits = ServerConfig(**config, **({"stream_interval": stream_interval} if stream_interval != 1 else {}))
    ctx = ServingContext(engine, None, limits=limits)
    try:
        if endpoint == "completions":
            response = await CompletionHandler(ctx).handle(CompletionRequest(**body, stream=stream), None)
        else:
            response = await ChatHandler(ctx).handle(ChatCompletionRequest(**body, stream=stream), None)
        if not stream:
            return _normalise(json.loads(response.body))
        raw = b""
        async for piece in response.body_iterator:
            raw += piece if isinstance(piece, bytes) else piece.encode()
    finally:
        ctx.executor.shutdown(wait=False)
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-2]:
        assert block.startswith("data: "), block
        events.append(_normalise(json.loads(block[len("data: "):])))
    return group_events(events)


def collect(name: str, stream: bool, stream_interval: int = 1) -> Any:
    """Case `name`'s response: the JSON body (stream False) or its events grouped by choice index."""
    return asyncio.run(_run(name, stream, stream_interval))


def collect_all() -> dict:
    return {f"{name}/{'stream' if stream else 'plain'}": collect(name, stream)
            for name in CASES for stream in (True, False)}


def load_golden() -> dict:
    with open(GOLDEN_PATH) as f:
        return dict(json.loads(line) for line in f)


if __name__ == "__main__":
    if "--write" in sys.argv:
        os.makedirs(os.path.dirname(GOLDEN_PATH), exist_ok=True)
        with open(GOLDEN_PATH, "w") as f:
            for k, v in sorted(collect_all().items()):  # one line per case
                f.write(json.dumps([k, v], ensure_ascii=False, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN_PATH}")
