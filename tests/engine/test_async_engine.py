"""AsyncEngine on a tiny random Llama: streaming, abort frees blocks, cancellation, failures, loop death."""

from __future__ import annotations

import asyncio
import time

import pytest

from helpers import make_bundle, tiny_model

from ladle.core.outputs import RequestRejected
from ladle.core.sampling_params import SamplingParams
from ladle.engine.async_engine import AsyncEngine
from ladle.engine.client import EngineError

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _wait_idle(engine: AsyncEngine, timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.get_stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks not returned within {timeout}s: {engine.get_stats()}")


def test_stream_matches_offline_and_finishes(model):
    async def main():
        engine = AsyncEngine(make_bundle(model))
        try:
            outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=10,
                                                                               ignore_eos=True))]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            tokens = [t for o in outs for t in o.outputs[0].token_ids_delta]
            assert tokens == outs[-1].outputs[0].token_ids and len(tokens) == 10
            assert outs[0].request_id.startswith("cmpl-")
            assert outs[0].queue_time is not None and 0 <= outs[0].queue_time < 60  # arrival -> first scheduled, s
            assert engine.get_stats().request_success_total.get("length") == 1
            return tokens
        finally:
            await engine.shutdown()

    from ladle.engine.llm import LLM

    tokens = _run(main())
    offline = LLM(bundle=make_bundle(model)).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10,
                                                                                   ignore_eos=True))
    assert tokens == offline[0].outputs[0].token_ids


def test_cancel_and_abort_free_blocks(model):
    async def main():
        engine = AsyncEngine(make_bundle(model))
        try:
            # 1. the client stops iterating (disconnect): the request is aborted at the next step boundary
            gen = engine.generate([1, 2, 3], LONG)
            async for _ in gen:
                assert engine.get_stats().num_running == 1
                break
            await gen.aclose()
            await _wait_idle(engine)
            # 2. a task cancelled while waiting for output (n=2: both children go)
            task = asyncio.create_task(_consume(engine.generate([4, 5], SamplingParams(
                temperature=1.0, n=2, max_tokens=200, ignore_eos=True))))
            for _ in range(500):  # cancel while both children run (a fixed sleep raced the 200 tokens on a fast host)
                if engine.get_stats().num_running == 2:
                    break
                await asyncio.sleep(0.001)
            assert engine.get_stats().num_running == 2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _wait_idle(engine)
            # 3. explicit abort by request id: the stream ends with finish_reason "abort"
            gen = engine.generate([7, 8], LONG, request_id="cmpl-explicit")
            first = await gen.__anext__()
            await engine.abort(first.request_id)
            rest = [o async for o in gen]
            assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
            await _wait_idle(engine)
            # the engine still serves
            outs = [o async for o in engine.generate([9], SamplingParams(temperature=0, max_tokens=3))]
            assert outs[-1].finished and engine.is_healthy()
        finally:
            await engine.shutdown()

    _run(main())


async def _consume(agen):
    async for _ in agen:
        pass


def test_rejection_before_first_output_and_duplicate_ids(model):
    async def main():
        engine = AsyncEngine(make_bundle(model, max_model_len=64))
        try:
            with pytest.raises(RequestRejected, match="64"):
                await engine.generate([1] * 60, SamplingParams(max_tokens=10)).__anext__()
            params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
            gen = engine.generate([1, 2], params, request_id="same")
            await gen.__anext__()
            with pytest.raises(RequestRejected):
                await engine.generate([1, 2], params, request_id="same").__anext__()
            await gen.aclose()
            await _wait_idle(engine)
        finally:
            await engine.shutdown()

    _run(main())


def test_failing_step_errors_its_stream_only(model):
    async def main():
        bundle = make_bundle(model)
        real = bundle.core.runner.execute

        def execute(so):
            if any(c.token_ids[:1] == [13] for c in so.chunks if c.start_position == 0):
                raise RuntimeError("boom")
            return real(so)

        bundle.core.runner.execute = execute
        engine = AsyncEngine(bundle)
        try:
            ok = [o async for o in engine.generate([3, 4], SamplingParams(temperature=0, max_tokens=4))]
            bad = [o async for o in engine.generate([13, 4], SamplingParams(temperature=0, max_tokens=4))]
            assert bad[-1].outputs[0].finish_reason == "error" and "boom" in bad[-1].outputs[0].error
            assert ok[-1].outputs[0].finish_reason == "length"
            assert engine.is_healthy()
            await _wait_idle(engine)
        finally:
            await engine.shutdown()

    _run(main())


def test_dead_loop_ends_streams_with_engine_error(model):
    async def main():
        bundle = make_bundle(model)
        engine = AsyncEngine(bundle)
        gen = engine.generate([1, 2, 3], LONG)
        await gen.__anext__()

        def broken():
            raise RuntimeError("scheduler exploded")

        bundle.core.scheduler.schedule = broken
        with pytest.raises(EngineError, match="scheduler exploded"):
            async for _ in gen:
                pass
        assert not engine.is_healthy()
        with pytest.raises(EngineError):
            await engine.generate([1], LONG).__anext__()
        await engine.shutdown()

    _run(main())


def test_bad_output_processing_fails_one_request(model):
    class Tok:  # decodes everything except token 99, which raises
        def decode(self, ids, **kw):
            if 99 in ids:
                raise ValueError("undecodable")
            return "".join(f"<{i}>" for i in ids)

    async def main():
        bundle = make_bundle(model)
        bundle.tokenizer = Tok()
        engine = AsyncEngine(bundle)
        try:
            bad = [o async for o in engine.generate([99, 1], SamplingParams(temperature=0, max_tokens=50))]
            assert bad[-1].outputs[0].finish_reason == "error" and "undecodable" in bad[-1].outputs[0].error
            await _wait_idle(engine)
            ok = [o async for o in engine.generate([5, 1], SamplingParams(temperature=0, max_tokens=3))]
            assert ok[-1].outputs[0].finish_reason == "length" and ok[-1].outputs[0].text.startswith("<")
            assert engine.is_healthy()
        finally:
            await engine.shutdown()

    _run(main())
