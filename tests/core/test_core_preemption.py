"""Preemption by recompute (newest first, outputs kept) and a randomized stress run against a reference.

The reference for every request is the same request run alone in a huge pool with no prefix caching and a
huge budget: the fake runner's next token depends only on the context it reads back from the simulated KV
cache, so batching, chunking, preemption and prefix hits must not change a single output token.
"""

import random

import pytest
from core_sim import FakeRunner, check_pool, make_request, make_scheduler, run, tokens_of

from ladle.core.outputs import FINISH_ABORT


def _reference(prompt, max_tokens, eos=()):
    sched = make_scheduler(num_blocks=1024, max_num_batched_tokens=4096, max_model_len=4096,
                           enable_prefix_caching=False)
    sched.add_request(make_request("ref", prompt, max_tokens=max_tokens, eos=eos))
    outs = run(sched, FakeRunner(4))["ref"]
    return tokens_of(outs), outs[-1].finish_reason


def test_newest_preempted_and_recomputed_with_outputs_kept():
    # 6 usable blocks of 4; three 4-token prompts, 12 new tokens each (15 KV tokens = 4 blocks each).
    sched = make_scheduler(block_size=4, num_blocks=7, max_num_batched_tokens=64, enable_prefix_caching=False)
    runner = FakeRunner(4)
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12]}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=12))
    steps = []
    outs = run(sched, runner, on_step=steps.append)
    # Steps 1-5 use 2 blocks each (6). Step 6 feeds position 8 and needs a 3rd block per request: c (the
    # newest) is preempted and its 2 blocks go to a and b. Step 10 feeds position 12, a 4th block: b goes.
    assert [i for i, so in enumerate(steps, 1) if so.preempted_request_ids] == [6, 10]
    assert steps[5].preempted_request_ids == ["c"] and [c.request_id for c in steps[5].chunks] == ["a", "b"]
    assert steps[9].preempted_request_ids == ["b"] and [c.request_id for c in steps[9].chunks] == ["a"]
    assert not steps[5].new_requests and not steps[9].new_requests  # no admissions in a preempting step
    # a finishes at step 12. b (front of the queue: preempted last) comes back at step 13 as a new request
    # with its 9 outputs and recomputes 4 + 9 tokens from position 0; c follows at step 16 with 5 outputs.
    for step, rid, num_out in [(13, "b", 9), (16, "c", 5)]:
        so = steps[step - 1]
        (new,) = so.new_requests
        assert new.request_id == rid and new.output_token_ids == tokens_of(outs[rid])[:num_out]
        (chunk,) = so.chunks
        assert (chunk.request_id, chunk.start_position, len(chunk.token_ids), chunk.sample) == (rid, 0, 4 + num_out, True)
    assert steps[12].finished_request_ids == ["a"] and steps[15].finished_request_ids == ["b"]
    for rid, prompt in prompts.items():
        assert (tokens_of(outs[rid]), outs[rid][-1].finish_reason) == _reference(prompt, 12)
    assert sched.get_stats().num_preemptions_total == 2
    assert sched.get_stats().num_free_blocks == 6


def test_request_preempts_itself_when_it_is_the_newest():
    # 3 usable blocks; each request alone needs all 3 (4 + 9 - 1 = 12 KV tokens).
    sched = make_scheduler(block_size=4, num_blocks=4, enable_prefix_caching=False)
    sched.add_request(make_request("a", [1, 2, 3, 4], max_tokens=9))
    sched.add_request(make_request("b", [5, 6, 7, 8], max_tokens=9))
    steps = []
    outs = run(sched, FakeRunner(4), on_step=steps.append)
    assert steps[1].preempted_request_ids == ["b"] and [c.request_id for c in steps[1].chunks] == ["a"]
    assert tokens_of(outs["a"]) == _reference([1, 2, 3, 4], 9)[0]
    assert tokens_of(outs["b"]) == _reference([5, 6, 7, 8], 9)[0]


def test_preempted_request_resumes_from_its_cached_blocks():
    # 4 usable blocks. Step 1: a (1 token) takes 1 block, b (12 tokens) 3 full blocks, which get cached.
    # Step 2: b needs a 4th block for position 12; none is free and b is the newest, so b preempts itself.
    # Its freed blocks stay cached; step 3 resumes b with a 3-block hit and recomputes only position 12.
    sched = make_scheduler(block_size=4, num_blocks=5, max_num_batched_tokens=64)
    sched.add_request(make_request("a", [1], max_tokens=2))
    sched.add_request(make_request("b", list(range(20, 32)), max_tokens=2))
    steps = []
    outs = run(sched, FakeRunner(4), on_step=steps.append)
    assert steps[1].preempted_request_ids == ["b"] and [c.request_id for c in steps[1].chunks] == ["a"]
    (new,) = steps[2].new_requests
    assert new.request_id == "b" and len(new.output_token_ids) == 1
    (chunk,) = steps[2].chunks
    assert (chunk.start_position, len(chunk.token_ids)) == (12, 1)
    assert chunk.block_ids[:3] == steps[0].chunks[1].block_ids  # the same physical blocks
    assert tokens_of(outs["b"]) == _reference(list(range(20, 32)), 2)[0]
    st = sched.get_stats()
    assert st.prefix_cache_hits_total == 0  # a resume is not a prefix-cache query
    assert st.num_preemptions_total == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("caching", [True, False])
def test_stress_matches_reference(seed, caching):
    rng = random.Random(seed)
    eos = (0,)
    vocab = 40  # small: EOS (0) shows up now and then
    prefixes = [[rng.randrange(1, vocab) for _ in range(rng.randrange(4, 17))] for _ in range(3)]
    specs = {}
    for i in range(24):
        prompt = rng.choice(prefixes) + [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 20))]
        specs[f"r{i}"] = (prompt, rng.randrange(1, 20))
    sched = make_scheduler(block_size=4, num_blocks=24, max_num_seqs=6, max_num_batched_tokens=16,
                           max_model_len=128, enable_prefix_caching=caching)
    runner = FakeRunner(4, rule=lambda ctx: hash_mod(ctx, vocab))
    pending = list(specs)
    outputs: dict = {}
    aborted = None
    for step in range(5000):
        while pending and (step % 3 == 0 or not sched.has_unfinished_requests()):
            rid = pending.pop(0)
            sched.add_request(make_request(rid, specs[rid][0], max_tokens=specs[rid][1], eos=eos))
            if step % 3 == 0:
                break
        if not sched.has_unfinished_requests():
            break
        running_before = [r.request_id for r in sched.running]
        so = sched.schedule()
        assert not so.is_empty
        n = len(so.preempted_request_ids)
        assert so.preempted_request_ids == running_before[::-1][:n]  # newest first
        assert not (n and so.new_requests)  # a step that preempts admits nobody
        assert so.num_scheduled_tokens <= 16 and len(so.chunks) <= 6
        for out in sched.update(so, runner.execute(so)):
            outputs.setdefault(out.request_id, []).append(out)
        if step == 40 and aborted is None and sched.running:
            aborted = sched.running[-1].request_id
            (out,) = sched.finish_requests([aborted], FINISH_ABORT)
            outputs.setdefault(aborted, []).append(out)
        check_pool(sched)
    assert not sched.has_unfinished_requests() and not pending and aborted is not None
    stats = sched.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 23
    assert stats.num_preemptions_total > 0
    assert (stats.prefix_cache_hits_total > 0) == caching
    for rid, (prompt, max_tokens) in specs.items():
        got = tokens_of(outputs[rid])
        if rid == aborted:
            assert outputs[rid][-1].finish_reason == FINISH_ABORT
            continue
        want_tokens, want_reason = _reference_with(prompt, max_tokens, eos, vocab)
        assert (got, outputs[rid][-1].finish_reason) == (want_tokens, want_reason), rid
        assert all(o.finish_reason is None for o in outputs[rid][:-1])


def hash_mod(ctx, vocab):
    acc = 17
    for t in ctx:
        acc = (acc * 1_000_003 + t) % 2_147_483_647
    return acc % vocab


def _reference_with(prompt, max_tokens, eos, vocab):
    sched = make_scheduler(num_blocks=1024, max_num_batched_tokens=4096, max_model_len=4096,
                           enable_prefix_caching=False)
    sched.add_request(make_request("ref", prompt, max_tokens=max_tokens, eos=eos))
    outs = run(sched, FakeRunner(4, rule=lambda ctx: hash_mod(ctx, vocab)))["ref"]
    return tokens_of(outs), outs[-1].finish_reason
