"""The engine core in its own process (ladle/engine/core_client.py + core_process.py) on the tiny MiniMax-M3 config
with dummy weights: the same greedy tokens as the in-process LLM, cancellation frees blocks within 1 s, a stop
string found by the server's detokenizer finishes the request in the core, a rejected or failing request leaves
the core serving, the observe records and host-time record come from the core, and a killed core turns unhealthy
within 2 s and ends the open stream with EngineError."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from ladle.core.outputs import RequestRejected
from ladle.core.sampling_params import SamplingParams
from ladle.engine.client import EngineError
from ladle.engine.core_client import CoreProcessEngine
from ladle.engine.engine_factory import engine_config_from_kwargs
from ladle.engine.llm import LLM
from ladle.tools.checkpoint_m3 import make_checkpoint

ENGINE = dict(load_format="dummy", max_model_len=256, kv_cache_memory_bytes=4 << 20)


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("m3core") / "tiny"), "tiny", config_only=True)


@pytest.fixture(scope="module")
def offline(m3_dir):
    return LLM(m3_dir, **ENGINE)


def _prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(rng.randrange(4, 20))] for _ in range(n)]


async def _collect(engine, prompt, params, request_id=None) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(prompt, params, request_id=request_id):
        tokens += out.outputs[0].token_ids_delta if out.outputs else []
    return tokens


async def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


def test_core_process_serves_like_the_offline_engine(m3_dir, offline):
    engine = CoreProcessEngine.start(engine_config_from_kwargs(m3_dir, **ENGINE))
    idle = engine.get_stats()  # known before any request (/metrics right after startup)
    assert idle.num_free_blocks == idle.num_total_blocks > 0 and idle.num_running == 0
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = _prompts(4, seed=int(time.time()))
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, greedy)]

    async def main() -> None:
        try:
            got = await asyncio.gather(*[_collect(engine, p, greedy) for p in prompts])
            assert [list(g) for g in got] == [list(e) for e in expected]
            stats = engine.get_stats()
            assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks > 0
            assert stats.generation_tokens_total == 4 * 12 and stats.request_success_total == {"length": 4}
            host = stats.step_host_seconds
            assert stats.num_steps > 0 and host["schedule"] > 0 and host["execute"] > 0 and host["process_outputs"] > 0
            steps = await engine.observe_snapshot("steps", last=1000)
            assert steps["totals"]["sampled"] == 4 * 12  # the record of the core process, not of this one
            assert set(await engine.observe_snapshot("shapes")) == {"gemm", "kernels", "tokens_scheduled", "measured"}
            with pytest.raises(EngineError):
                await engine.observe_snapshot("no-such-record")

            # cancellation (a client disconnect) frees the blocks within 1 s
            agen = engine.generate(prompts[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
            await agen.__anext__()
            assert engine.get_stats().num_running == 1
            await agen.aclose()
            assert await _wait(lambda: engine.get_stats().num_free_blocks == stats.num_total_blocks
                               and engine.get_stats().num_running == 0, 1.0)

            # a stop string matched by this process's detokenizer finishes the request in the core
            text = offline.generate([prompts[1]], greedy)[0].outputs[0].text
            stop = text[len(text) // 2:len(text) // 2 + 2]
            if stop.strip():
                outs = [o async for o in engine.generate(prompts[1], SamplingParams(
                    max_tokens=100, temperature=0.0, ignore_eos=True, stop=(stop,)))]
                assert outs[-1].outputs[0].finish_reason == "stop"
                assert await _wait(lambda: engine.get_stats().num_running == 0, 1.0)

            # a request that can never fit is refused; one the model cannot run fails alone; the core lives on
            with pytest.raises(RequestRejected):
                await _collect(engine, list(range(3, 300)), SamplingParams(max_tokens=4))
            with pytest.raises(RequestRejected):  # a duplicate in-flight id
                first = engine.generate(prompts[2], greedy, request_id="same")
                await first.__anext__()
                await _collect(engine, prompts[2], greedy, request_id="same")
            await first.aclose()
            outs = [o async for o in engine.generate([5, 10**6, 7], greedy)]  # beyond the vocabulary: its step fails
            assert outs[-1].outputs[0].finish_reason == "error" and outs[-1].outputs[0].error
            assert engine.is_healthy()
            assert await _collect(engine, prompts[3], greedy) == list(expected[3])
        finally:
            await engine.shutdown()
        assert not engine._proc.is_alive() and engine._proc.exitcode == 0

    asyncio.run(main())


def test_killed_core_turns_unhealthy_and_ends_streams(m3_dir):
    engine = CoreProcessEngine.start(engine_config_from_kwargs(m3_dir, **ENGINE))

    async def main() -> None:
        agen = engine.generate(_prompts(1, seed=3)[0], SamplingParams(max_tokens=200, temperature=0.0,
                                                                          ignore_eos=True))
        await agen.__anext__()
        os.kill(engine._proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert await _wait(lambda: not engine.is_healthy(), 2.0)
        assert time.monotonic() - killed < 2.0
        with pytest.raises(EngineError):
            async for _ in agen:
                pass
        with pytest.raises(EngineError):
            await _collect(engine, [5, 6, 7], SamplingParams(max_tokens=2))
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))
