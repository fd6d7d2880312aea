"""Asynchronous scheduling (--async-scheduling, ladle/engine/engine_core.py) against synchronous scheduling on the tiny
random Llama and the tiny MiniMax-M3 (dummy weights): the same tokens for mixed batches (lengths, max_tokens, stop
token ids, EOS, min_tokens), with preemption and prefix hits (checked to happen, one preemption with a token in
flight), seeded sampling and logprobs; penalties and prompt logprobs fall back to synchronous steps (dispatch
record); an abort while a token is in flight frees its blocks; a runner exception fails its requests and the
engine carries on; the flag is accepted at every tensor-parallel size and on the command line."""

from __future__ import annotations

import asyncio
import random

import pytest

from helpers import M3_ENGINE, m3_llm, make_bundle, tiny_model

from ladle.config import EngineConfig, ParallelConfig, SchedulerConfig
from ladle.core.sampling_params import SamplingParams
from ladle.engine.config_resolve import config_refusals
from ladle.engine.llm import LLM
from ladle.observe import dispatch

@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def m3_dir(tiny_m3_dir) -> str:
    return tiny_m3_dir


def _prompts(n: int, seed: int, prefix: tuple = (), lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, 400) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _llama(model, **kw):
    return lambda async_scheduling: LLM(bundle=make_bundle(model, async_scheduling=async_scheduling, **kw))


def _finishes(outs) -> list[tuple]:
    return [(tuple(c.token_ids), c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


def _first_new(toks: list[int], start: int) -> int:
    """The first index >= start whose token does not occur before it."""
    return next(j for j in range(start, len(toks)) if toks[j] not in toks[:j])


def _mixed_params(base: list[list[int]]) -> list[SamplingParams]:
    """Per prompt (from its synchronous greedy run `base`): a length limit, a stop token id seen in its output, EOS
    (the bundle's EOS is base[2][4]), and min_tokens = j with the stop token at output j (not earlier): it must stop
    exactly there, which needs the count of outputs including the one still in flight (masked one step too long
    otherwise)."""
    params = []
    for i, toks in enumerate(base):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[toks[5]]))
        elif kind == 2:
            params.append(SamplingParams(temperature=0, max_tokens=20))
        else:
            j = _first_new(toks, 4 + i // 4)
            params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=j,
                                         stop_token_ids=[toks[j]]))
    return params


def _check_mixed(make_llm, eos_of=None):
    prompts = _prompts(8, seed=5)
    base = [c[0] for c in _finishes(make_llm(False).generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))]
    params = _mixed_params(base)
    sync_llm, async_llm = make_llm(False), make_llm(True)
    expected = _finishes(sync_llm.generate(prompts, params))
    got = _finishes(async_llm.generate(prompts, params))
    assert got == expected
    reasons = [e[1] for e in expected]
    assert reasons.count("stop") >= 4 and reasons.count("length") >= 2, reasons  # not vacuous
    for i in (3, 7):  # min_tokens: stopped at output j = min_tokens, the first output it was allowed
        assert len(expected[i][0]) == params[i].min_tokens + 1 and expected[i][1] == "stop"
    stats = async_llm.core.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert async_llm.core._in_flight is None


def test_mixed_batch_matches_sync_tiny_llama(model):
    probe = LLM(bundle=make_bundle(model)).generate(_prompts(8, seed=5),
                                                    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eos = probe[2].outputs[0].token_ids[4]  # prompt 2 (EOS kind) ends at its 5th token at the latest
    _check_mixed(_llama(model, eos_token_ids=(eos,)))


def test_mixed_batch_matches_sync_tiny_m3(m3_dir):
    _check_mixed(m3_llm(m3_dir))


def test_length_limits_schedule_no_extra_step(model):
    """A request that max_tokens ends gets no placeholder step: async runs as many steps as sync."""
    prompts = _prompts(4, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 14, 14)]
    runs = {}
    for a in (False, True):
        llm = _llama(model)(a)
        runs[a] = (_finishes(llm.generate(prompts, params)), llm.core.num_steps)
    assert runs[True] == runs[False]


def test_scheduler_keeps_the_token_of_a_request_preempted_in_flight():
    """Scheduler level: B is preempted by the schedule of step 2 while its step-1 token is in flight; update 1 still
    appends that token (and reports it), and B resumes with it as a prompt token."""
    from ladle.core.request import Request, RequestStatus
    from ladle.core.outputs import PLACEHOLDER_TOKEN_ID, RunnerOutput
    from ladle.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), block_size=4, num_blocks=4,
                      max_model_len=32, enable_prefix_caching=False)  # 3 usable blocks
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b = Request("a", [1, 2, 3, 4], params), Request("b", [5, 6, 7, 8], params)
    sched.add_request(a)
    sched.add_request(b)
    step1 = sched.schedule()
    assert [(c.request_id, c.sample) for c in step1.chunks] == [("a", True), ("b", True)]
    step2 = sched.schedule()  # step 1 in flight: a gets a placeholder and the last block, b is preempted
    assert [c.token_ids for c in step2.chunks] == [[PLACEHOLDER_TOKEN_ID]] and step2.placeholder_chunks == [0]
    assert step2.chunks[0].start_position == 4 and step2.preempted_request_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_inflight_samples == 1
    outs = sched.update(step1, RunnerOutput(sampled_token_ids={"a": 40, "b": 50}))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("a", [40]), ("b", [50])]
    assert b.output_token_ids == [50] and b.num_computed_tokens == 0
    assert (b.num_inflight_tokens, a.num_inflight_tokens) == (0, 1)
    assert a.num_computed_tokens == 4 and a.all_token_ids == [1, 2, 3, 4, 40]
    sched.update(step2, RunnerOutput(sampled_token_ids={"a": 41}))
    assert a.output_token_ids == [40, 41] and a.num_computed_tokens == 5
    sched.finish_requests(["a"], "abort")
    step3 = sched.schedule()
    assert [n.output_token_ids for n in step3.new_requests] == [[50]]
    assert [(c.request_id, c.token_ids, c.sample) for c in step3.chunks] == [("b", [5, 6, 7, 8, 50], True)]


def test_scheduler_skips_placeholders_a_length_limit_ends():
    from ladle.core.request import Request
    from ladle.core.outputs import RunnerOutput
    from ladle.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(), block_size=4, num_blocks=16, max_model_len=8, enable_prefix_caching=False)
    short = Request("short", [1, 2], SamplingParams(temperature=0, max_tokens=1))  # max_tokens ends it
    long_ = Request("long", [1, 2, 3, 4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=1))  # both limits at once
    keep = Request("keep", [1, 2], SamplingParams(temperature=0, max_tokens=3))
    for r in (short, long_, keep):
        sched.add_request(r)
    step1 = sched.schedule()
    step2 = sched.schedule()
    assert [c.request_id for c in step2.chunks] == ["keep"]
    outs = sched.update(step1, RunnerOutput(sampled_token_ids={"short": 9, "long": 9, "keep": 9}))
    assert {o.request_id: o.finish_reason for o in outs} == {"short": "length", "long": "length", "keep": None}


def _count_inflight_preemptions(llm) -> list[int]:
    """Wrap the scheduler's preemption: the list grows by the victim's in-flight samples at each preemption."""
    scheduler, seen = llm.core.scheduler, []
    real = scheduler._preempt

    def preempt(request):
        seen.append(request.num_inflight_samples)
        real(request)

    scheduler._preempt = preempt
    return seen


@pytest.mark.parametrize("family", ["llama", "m3"])
def test_preemption_and_prefix_hits_match_sync(family, model, m3_dir):
    if family == "llama":
        make_llm = _llama(model, num_blocks=12, max_num_batched_tokens=32, max_model_len=128)
    else:
        roomy = LLM(m3_dir, **M3_ENGINE)
        per_block = roomy.core.runner.kv_cache_bytes // roomy.core.runner.num_blocks
        make_llm = m3_llm(m3_dir, kv_cache_memory_bytes=per_block * 12, max_num_batched_tokens=32)
    prefix = tuple(_prompts(1, seed=11, lo=40, hi=41)[0])  # 2.5 blocks shared by every prompt
    waves = [_prompts(4, seed=12, prefix=prefix, lo=4, hi=12), _prompts(4, seed=13, prefix=prefix, lo=4, hi=12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for a in (False, True):
        llm = make_llm(a)
        inflight = _count_inflight_preemptions(llm)
        results[a] = [_finishes(llm.generate(w, params)) for w in waves]
        stats = llm.core.get_stats()
        assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total >= 32, stats  # not vacuous
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert any(inflight), "no request was preempted with a token in flight"
    assert results[True] == results[False]


def test_seeded_sampling_matches_sync(model, m3_dir):
    prompts = _prompts(6, seed=21)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    for make_llm in (_llama(model), m3_llm(m3_dir)):
        expected = _finishes(make_llm(False).generate(prompts, params))
        assert _finishes(make_llm(True).generate(prompts, params)) == expected
        assert len({e[0] for e in expected}) == len(prompts)


def _logprob_entries(outs):
    """(token id, logprob to 3 places, rank) of each sampled token, per choice that asked for logprobs."""
    return [[(tid, round(entry[tid].logprob, 3), entry[tid].rank) for tid, entry in zip(c.token_ids, c.logprobs)]
            for o in outs for c in o.outputs if c.logprobs]


def _overlap_record() -> tuple[int, int, dict]:
    """(executed, not eligible, fallback reasons) of the dispatch op "async_scheduling" since the last reset."""
    record = dispatch.snapshot()["ops"]["async_scheduling"]
    executed = sum(b["executed"] for b in record["buckets"].values())
    not_eligible = sum(b["calls"] - b["eligible"] for b in record["buckets"].values())
    return executed, not_eligible, record["fallback_reasons"]


@pytest.mark.parametrize("special,reason", [
    (dict(max_tokens=6, repetition_penalty=1.5, frequency_penalty=0.5), "penalties read the previous step's tokens"),
    (dict(max_tokens=4, prompt_logprobs=2), "prompt logprobs not reported yet"),
])
def test_penalties_and_prompt_logprobs_fall_back_and_match(model, special, reason):
    """A request with penalties (or waiting for prompt logprobs) makes the steps it runs in synchronous; logprobs
    need no fallback. The others overlap again once it finished."""
    prompts = _prompts(4, seed=31)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, ignore_eos=True, **special),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    expected = LLM(bundle=make_bundle(model)).generate(prompts, params)
    dispatch.reset()
    got = LLM(bundle=make_bundle(model, async_scheduling=True)).generate(prompts, params)
    assert _finishes(got) == _finishes(expected)
    assert _logprob_entries(got) == _logprob_entries(expected) and _logprob_entries(got)
    assert [len(o.prompt_logprobs or ()) for o in got] == [len(o.prompt_logprobs or ()) for o in expected]
    if "prompt_logprobs" in special:
        tok = got[1].prompt_token_ids[1]
        assert got[1].prompt_logprobs[1][tok].logprob == pytest.approx(expected[1].prompt_logprobs[1][tok].logprob,
                                                                       abs=1e-4)
    executed, not_eligible, reasons = _overlap_record()
    assert executed > 0 and not_eligible > 0, reasons
    assert reasons.get(reason, 0) == not_eligible, reasons


def _collect(outputs, into: dict) -> None:
    for out in outputs:
        into.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            into.setdefault("finished", {})[out.request_id] = out.finish_reason


def test_abort_while_token_in_flight(model):
    prompts = _prompts(4, seed=41)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [c[0] for c in _finishes(LLM(bundle=make_bundle(model)).generate(prompts, params))]
    core = make_bundle(model, async_scheduling=True).core
    core.add_requests([core.make_request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    got: dict = {}
    while not got.get("r1"):
        _collect(core.step(), got)
    victim = core.scheduler.requests["r1"]
    assert core._in_flight is not None and victim.num_inflight_samples == 1  # its next token is on the device
    aborted = core.abort_requests(["r1"])
    assert [o.finish_reason for o in aborted] == ["abort"]
    assert core.scheduler.kv_cache_manager.get_block_ids("r1") == []
    before = list(got["r1"])
    while core.has_unfinished_requests():
        _collect(core.step(), got)
    assert got["r1"] == before  # its in-flight token was discarded
    assert [tuple(got[f"r{i}"]) for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert got["finished"] == {"r0": "length", "r2": "length", "r3": "length"}
    stats = core.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    # the runner holds no state but the ones the next schedule reports finished (as in synchronous mode)
    assert set(core.runner.requests) <= set(core.scheduler._finished_ids) and "r1" not in core.runner.requests


def test_runner_exception_at_launch_fails_its_requests(model):
    bundle = make_bundle(model, max_num_seqs=1, async_scheduling=True)
    runner = bundle.core.runner
    real_launch = runner.launch

    def launch(sched_out):
        if any(c.token_ids[:1] == [13] and c.start_position == 0 for c in sched_out.chunks):
            raise RuntimeError("injected failure")
        return real_launch(sched_out)

    runner.launch = launch
    llm = LLM(bundle=bundle)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([[13, 14, 15], [20, 21, 22]], params)
    assert outs[0].outputs[0].finish_reason == "error" and "injected failure" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 5
    stats = bundle.core.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    again = llm.generate([[20, 21, 22]], params)
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_runner_exception_while_waiting_fails_both_steps(model):
    prompts = _prompts(4, seed=51)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = _finishes(LLM(bundle=make_bundle(model)).generate(prompts, params))
    bundle = make_bundle(model, max_num_seqs=2, async_scheduling=True)
    runner = bundle.core.runner
    real_wait, calls = runner.wait, []

    def wait(step):
        calls.append(step)
        if len(calls) == 3:  # steps 3 (decode) and 4 (in flight, fed by 3) fail; requests 0 and 1 are in both
            raise RuntimeError("injected wait failure")
        return real_wait(step)

    runner.wait = wait
    llm = LLM(bundle=bundle)
    got = _finishes(llm.generate(prompts, params))
    assert [g[1] for g in got] == ["error", "error", "length", "length"]
    assert got[2:] == expected[2:]
    stats = bundle.core.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert _finishes(llm.generate(prompts[:2], params)) == expected[:2]  # the engine carries on


def test_thread_engine_with_async_scheduling(model):
    from ladle.engine.async_engine import AsyncEngine

    prompts = _prompts(4, seed=61)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [c[0] for c in _finishes(LLM(bundle=make_bundle(model)).generate(prompts, params))]

    async def main():
        engine = AsyncEngine(make_bundle(model, async_scheduling=True))
        try:
            async def one(p):
                return tuple([t async for o in engine.generate(p, params) for t in o.outputs[0].token_ids_delta])

            return await asyncio.gather(*[one(p) for p in prompts])
        finally:
            await engine.shutdown()

    assert list(asyncio.run(asyncio.wait_for(main(), 60))) == expected


def test_accepted_with_tensor_parallelism_and_on_the_command_line():
    """Unset: on with one rank, off with more until a multi-GPU run measures it; explicit on or off accepted at any
    size (the executor pipelines launch/wait on every rank, tests/distributed/test_tp_async.py)."""
    from ladle.engine.config_resolve import resolve_async_scheduling

    for tp in (1, 2, 4):
        for flag in (True, False, None):
            config = EngineConfig(scheduler=SchedulerConfig(async_scheduling=flag),
                                  parallel=ParallelConfig(tensor_parallel_size=tp))
            assert not [r for r in config_refusals(config) if "async" in r], (tp, flag)
            assert resolve_async_scheduling(flag, tp) is (flag if flag is not None else tp == 1), (tp, flag)
    from ladle.cli import serve_parser
    from ladle.cli_args import configs_from_args, parse_serve_args

    for argv, value in ((["--async-scheduling"], True), (["--no-async-scheduling"], False), ([], None)):
        engine, _ = configs_from_args(parse_serve_args(serve_parser(), argv))
        assert engine.scheduler.async_scheduling is value


def test_core_process_with_async_scheduling(m3_dir):
    """The engine-core process loop drives the same `step()`: greedy tokens as the synchronous offline engine, a
    cancelled stream frees its blocks, a failing request fails alone, the resolved config carries the flag."""
    from ladle.engine.core_client import CoreProcessEngine
    from ladle.engine.engine_factory import engine_config_from_kwargs

    prompts = _prompts(4, seed=71)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [c[0] for c in _finishes(m3_llm(m3_dir)(False).generate(prompts, greedy))]
    engine = CoreProcessEngine.start(engine_config_from_kwargs(m3_dir, async_scheduling=True, **M3_ENGINE))

    async def collect(prompt, params) -> list:
        return [o async for o in engine.generate(prompt, params)]

    async def main() -> None:
        try:
            assert engine.engine_config.scheduler.async_scheduling is True
            outs = await asyncio.gather(*[collect(p, greedy) for p in prompts])
            assert [tuple(o[-1].outputs[0].token_ids) for o in outs] == expected
            agen = engine.generate(prompts[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
            await agen.__anext__()
            await agen.aclose()
            failed = await collect([5, 10**6, 7], greedy)  # beyond the vocabulary: its step fails
            assert failed[-1].outputs[0].finish_reason == "error"
            assert tuple((await collect(prompts[3], greedy))[-1].outputs[0].token_ids) == expected[3]
            for _ in range(100):
                stats = engine.get_stats()
                if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
                    break
                await asyncio.sleep(0.01)
            assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
            assert stats.step_host_seconds["wait"] >= 0 and stats.step_host_seconds["execute"] > 0
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))
