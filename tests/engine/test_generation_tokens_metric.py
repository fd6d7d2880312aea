"""`vllm:generation_tokens_total` (EngineStats.generation_tokens_total) counts the tokens delivered in choices, the
sum of the completion_tokens the clients are told, as vLLM's frontend counts them (vllm/v1/engine/output_processor.py:
an output for a request it already finished is ignored before its stats are taken).

The case that told them apart: the engine core in its own process on the tiny MiniMax-M3 (dummy weights), requests
ending on stop strings. The API process finds the stop string and sends the finish back; until it arrives the core
keeps sampling tokens for that request, which nobody receives. Here the API process is made slower than a core step
(it sleeps after each batch with a stop hit, as a busy server detokenizing a large batch is against a GPU step of a
few ms), so those tokens are sampled every run, with synchronous and with asynchronous scheduling."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from ladle.core.sampling_params import SamplingParams
from ladle.engine.core_client import CoreProcessEngine
from ladle.engine.engine_factory import engine_config_from_kwargs
from ladle.tools.checkpoint_m3 import make_checkpoint

ENGINE = dict(load_format="dummy", max_model_len=256, kv_cache_memory_bytes=4 << 20)
MAX_TOKENS = 30
API_DELAY_S = 0.1  # several CPU steps of the tiny model


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("m3gen") / "tiny"), "tiny", config_only=True)


def _slow_on_stop_hits(engine: CoreProcessEngine) -> None:
    """The API process sleeps after processing a batch that found a stop string (before the finish is sent)."""
    processor = engine._processor
    process = processor.process

    def slow_process(outputs):
        result = process(outputs)
        if result.stop_hits:
            time.sleep(API_DELAY_S)
        return result

    processor.process = slow_process


async def _generate(engine, prompt: list[int], params: SamplingParams):
    """(token ids delivered, the final CompletionOutput)."""
    token_ids: list[int] = []
    async for out in engine.generate(prompt, params):
        token_ids += out.outputs[0].token_ids_delta
        final = out.outputs[0]
    return token_ids, final


def _stop_string(text: str) -> str:
    """Two printable characters from the middle of `text` (the dummy model's text is mostly replacement chars), else
    one. A replacement char never serves: the streamed text holds incomplete UTF-8 back, so it may never match."""
    for width in (2, 1):
        for start in range(len(text) // 3, len(text) - width + 1):
            stop = text[start:start + width]
            if stop.isprintable() and "\ufffd" not in stop and stop.strip():
                return stop
    raise AssertionError(f"no printable character in the last two thirds of {text!r}: pick other prompts")


async def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        await asyncio.sleep(0.01)
    return predicate()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generation_tokens_are_the_delivered_completion_tokens(m3_dir, async_scheduling):
    engine = CoreProcessEngine.start(engine_config_from_kwargs(m3_dir, async_scheduling=async_scheduling, **ENGINE))
    rng = random.Random(7)  # fixed prompts: a seed per run made a stop string of replacement chars now and then
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(4, 20))] for _ in range(6)]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        try:
            full = await asyncio.gather(*[_generate(engine, p, greedy) for p in prompts])
            assert engine.get_stats().generation_tokens_total == len(prompts) * MAX_TOKENS
            _slow_on_stop_hits(engine)
            stops = [_stop_string(final.text) for _, final in full]
            ended = await asyncio.gather(*[_generate(engine, p, SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=(s,))) for p, s in zip(prompts, stops)])
            assert [final.finish_reason for _, final in ended] == ["stop"] * len(prompts), stops
            assert all(len(t) == len(final.token_ids) < MAX_TOKENS for t, final in ended)
            assert await _wait(lambda: engine.get_stats().num_running == 0, 5.0)
            delivered = len(prompts) * MAX_TOKENS + sum(len(t) for t, _ in ended)
            sampled = (await engine.observe_snapshot("steps", last=10_000))["totals"]["sampled"]
            assert sampled > delivered  # the core did sample tokens nobody received
            assert engine.get_stats().generation_tokens_total == delivered
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))
