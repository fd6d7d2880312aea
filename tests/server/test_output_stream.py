"""The API side of the engine client: each step's outputs are put into a per-request RequestOutputStream; a consumer
that fell behind reads everything since its last read as one RequestOutput (text, token ids and logprobs in order,
finish reason and cumulative fields of the last), and an error put after outputs comes after them."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from fake_engine import FakeTokenizer
from ladle.config import EngineConfig
from ladle.core.outputs import EngineOutput
from ladle.core.sampling_params import SamplingParams
from ladle.engine import core_messages as msg
from ladle.engine.client import CompletionOutput, EngineError, RequestOutput
from ladle.engine.core_client import CoreProcessEngine
from ladle.engine.output_processor import OutputProcessor
from ladle.engine.output_stream import RequestOutputStream, merge_many_request_outputs


class DetokTokenizer(FakeTokenizer):
    """The fake byte tokenizer with the keyword the IncrementalDetokenizer passes."""

    def decode(self, ids, skip_special_tokens=False, **kw):
        return super().decode(ids, skip_special_tokens)


class _Alive:
    exitcode = None

    def is_alive(self):
        return True


class _Sink:
    def __init__(self):
        self.messages = []

    def send(self, data, flags=0):
        self.messages.append(msg.to_core_decoder.decode(data))


def _engine() -> CoreProcessEngine:
    ready = msg.Ready(model_name="m", tokenizer=pickle.dumps(None), engine_config=pickle.dumps(EngineConfig()),
                      max_model_len=256)
    engine = CoreProcessEngine(_Alive(), None, _Sink(), None, "", ready)
    engine.tokenizer = DetokTokenizer()  # set here, not pickled: the test module need not be importable by name
    engine._processor = OutputProcessor(engine.tokenizer)
    return engine


def _step(request_id, token_ids, finish=None):
    lps = [[(t, -0.5 - t / 1000, 1), ((t + 1) % 256, -2.0, 2)] for t in token_ids]
    return msg.StepOutputs([EngineOutput(request_id, list(token_ids), new_logprobs=lps, finish_reason=finish)], {})


def test_lagging_consumer_reads_one_merged_output():
    text = "héllo, wörld"
    ids = list(text.encode())

    async def scenario():
        engine = _engine()
        engine._reader = asyncio.get_running_loop().create_future()  # no socket reader: the test feeds _handle
        params = SamplingParams(max_tokens=len(ids), logprobs=1, temperature=0.0)
        agen = engine.generate([72, 105], params, request_id="r")
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)
        engine._handle(msg.AddAck("r"))
        engine._handle(_step("r", ids[:1]))
        out1 = await first
        for i in range(1, len(ids) - 1):  # the consumer does not read: these pile up in its stream
            engine._handle(_step("r", ids[i:i + 1]))
        engine._handle(_step("r", ids[-1:], finish="length"))
        assert engine._streams["r"].ready() is True
        out2 = await agen.__anext__()
        with pytest.raises(StopAsyncIteration):
            await agen.__anext__()
        return out1, out2

    out1, out2 = asyncio.run(scenario())
    assert out1.outputs[0].text_delta == "h" and not out1.finished
    c = out2.outputs[0]
    assert out2.finished and c.finish_reason == "length"
    assert out1.outputs[0].text_delta + c.text_delta == text and c.text == text  # cumulative on the finishing one
    assert c.token_ids_delta == ids[1:] and c.token_ids == ids
    assert [e[0][0] for e in c.logprobs_delta] == ids[1:] and len(c.logprobs) == len(ids)


def test_consumer_is_woken_once_per_interval():
    """The engine client's stream wakes the consumer on the first token, then once per 4 tokens, then on the finish:
    10 one-token steps are 4 outputs, though the consumer waits after every step (interval 1: 10 wake-ups)."""
    text = "abcdefghij"

    async def scenario(interval: int) -> list:
        engine = _engine()
        engine._reader = asyncio.get_running_loop().create_future()  # no socket reader: the test feeds _handle
        params = SamplingParams(max_tokens=len(text), temperature=0.0)
        got: list = []

        async def consume():
            async for out in engine.generate([72, 105], params, request_id="r", stream_interval=interval):
                got.append(out.outputs[0].text_delta)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)
        engine._handle(msg.AddAck("r"))
        for i, ch in enumerate(text.encode()):
            await asyncio.sleep(0)  # the consumer runs whenever it was woken
            engine._handle(_step("r", [ch], finish="length" if i == len(text) - 1 else None))
        await task
        return got

    assert asyncio.run(scenario(4)) == ["a", "bcde", "fghi", "j"]
    assert asyncio.run(scenario(1)) == list(text)


def test_stream_merges_keeps_inputs_and_raises_after_outputs():
    a = RequestOutput("r", [1], [
        CompletionOutput(0, text_delta="a", token_ids_delta=[1]),
        CompletionOutput(1, text_delta="x", token_ids_delta=[9], logprobs_delta=[[(9, -1.0, 1)]])],
        queue_time=0.5, prompt_logprobs=[None])
    b = RequestOutput("r", [1], [
        CompletionOutput(1, text_delta="y", token_ids_delta=[8], logprobs_delta=[[(8, -2.0, 1)]], finish_reason="stop",
                         stop_reason=8, text="xy", token_ids=[9, 8]),
        CompletionOutput(2, text_delta="q", token_ids_delta=[5])], finished=False)
    m = merge_many_request_outputs([a, b])
    assert [(c.index, c.text_delta, c.token_ids_delta) for c in m.outputs] == [(0, "a", [1]), (1, "xy", [9, 8]),
                                                                               (2, "q", [5])]
    assert m.outputs[1].logprobs_delta == [[(9, -1.0, 1)], [(8, -2.0, 1)]] and m.outputs[1].finish_reason == "stop"
    assert m.outputs[1].stop_reason == 8 and m.outputs[1].token_ids == [9, 8] and m.outputs[1].text == "xy"
    assert m.queue_time == 0.5 and m.prompt_logprobs == [None] and a.outputs[1].text_delta == "x"  # a untouched

    async def scenario():
        stream = RequestOutputStream()
        reader = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        stream.put(a)
        got_a = await reader
        stream.put(b)
        stream.put(EngineError("core died"))
        got_b = await stream.get()
        error = await stream.get()  # returned, not raised: the caller tells it from its own cancellation
        return got_a, got_b, error

    got_a, got_b, error = asyncio.run(scenario())
    assert got_a is a and got_b is b and isinstance(error, EngineError) and str(error) == "core died"


def test_a_consumer_cancelled_while_waiting_aborts_its_request():
    """Cancelling the consumer (client gone) while it waits for outputs sends the abort that frees the blocks."""

    async def scenario():
        engine = _engine()
        engine._reader = asyncio.get_running_loop().create_future()
        agen = engine.generate([72, 105], SamplingParams(max_tokens=8), request_id="r")
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)
        engine._handle(msg.AddAck("r"))
        engine._handle(_step("r", [72]))
        await first
        waiting = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return engine._to_core.messages

    sent = asyncio.run(scenario())
    assert isinstance(sent[-1], msg.AbortRequests) and sent[-1].child_ids == ["r"]


def _merge_pair(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """The reference: `a` followed by `b` as one output, one choice at a time (merge_many_request_outputs does a
    backlog in one pass)."""
    outputs, where = list(a.outputs), {c.index: i for i, c in enumerate(a.outputs)}
    for c in b.outputs:
        i = where.get(c.index)
        if i is None:
            where[c.index] = len(outputs)
            outputs.append(c)
            continue
        p = outputs[i]
        lps = p.logprobs_delta if c.logprobs_delta is None else (p.logprobs_delta or []) + c.logprobs_delta
        outputs[i] = CompletionOutput(index=p.index, text=c.text, token_ids=c.token_ids,
                                      text_delta=p.text_delta + c.text_delta,
                                      token_ids_delta=p.token_ids_delta + c.token_ids_delta, logprobs=c.logprobs,
                                      logprobs_delta=lps, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      error=c.error)
    return RequestOutput(request_id=b.request_id, prompt_token_ids=b.prompt_token_ids, outputs=outputs,
                         finished=b.finished, num_cached_tokens=b.num_cached_tokens,
                         prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
                         queue_time=a.queue_time if a.queue_time is not None else b.queue_time)


def test_backlog_merged_once_equals_pairwise_merges():
    """merge_many_request_outputs (what `get` returns for a backlog) is the fold of the pairwise reference merge, on
    random outputs: choices appearing and finishing at random, logprobs on some outputs only, prompt logprobs /
    queue time arriving late."""
    import functools
    import random

    rng = random.Random(2026)

    def choice(index: int) -> CompletionOutput:
        lps = None
        if rng.random() < 0.6:
            lps = [[(rng.randrange(256), -rng.random(), 1)] for _ in range(rng.randrange(3))]
        fin = rng.choice([None, None, "stop", "length"])
        return CompletionOutput(index=index, text=str(rng.random()) if fin else "",
                                token_ids=[rng.randrange(256) for _ in range(rng.randrange(1, 4))] if fin else [],
                                text_delta=rng.choice(["a", "bé", "", "😀"]),
                                token_ids_delta=[rng.randrange(256) for _ in range(rng.randrange(3))],
                                logprobs=lps if fin else None, logprobs_delta=lps, finish_reason=fin,
                                stop_reason=rng.choice([None, "x", 5]), error=rng.choice([None, "e"]))

    for _ in range(500):
        outs = [RequestOutput(request_id="r", prompt_token_ids=[1, 2],
                              outputs=[choice(i) for i in rng.sample(range(4), rng.randrange(0, 4))],
                              finished=rng.random() < 0.2, num_cached_tokens=rng.randrange(5),
                              prompt_logprobs=rng.choice([None, [None, [(1, -rng.random(), 1)]]]),
                              queue_time=rng.choice([None, rng.random()]))
                for _ in range(rng.randrange(1, 8))]
        assert merge_many_request_outputs(outs) == functools.reduce(_merge_pair, outs)
