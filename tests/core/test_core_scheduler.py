"""Scheduler: chunked prefill, token budget, max_num_seqs, admission, aborts, prompt logprobs, stats."""

import pytest
from core_sim import FakeRunner, make_request, make_scheduler, run, tokens_of

from ladle.core.outputs import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, RequestRejected, RunnerOutput
from ladle.core.request import RequestStatus


def test_chunked_prefill_splits_and_samples_only_at_the_end():
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(1, 21)), max_tokens=3))  # 20 prompt tokens
    chunks = []
    run(sched, runner, on_step=lambda so: chunks.extend((c.start_position, len(c.token_ids), c.sample) for c in so.chunks))
    # 8 + 8 + 4 prompt tokens, then 2 decodes (the 3rd token is sampled by the last decode).
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True), (21, 1, True)]


def test_budget_shared_running_first_then_waiting_fcfs():
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=8)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", list(range(6)), max_tokens=5))
    sched.add_request(make_request("b", list(range(100, 108)), max_tokens=5))
    so = sched.schedule()
    # a takes 6 tokens, b gets the remaining 4 of its 8-token prompt.
    assert [(c.request_id, len(c.token_ids), c.sample) for c in so.chunks] == [("a", 6, True), ("b", 4, False)]
    assert [n.request_id for n in so.new_requests] == ["a", "b"]
    sched.update(so, runner.execute(so))
    sched.add_request(make_request("c", list(range(200, 220)), max_tokens=5))
    so = sched.schedule()
    # Running first: a decodes (1), b finishes its prompt (4); c (waiting) gets the 5 left.
    assert [(c.request_id, len(c.token_ids)) for c in so.chunks] == [("a", 1), ("b", 4), ("c", 5)]
    assert [n.request_id for n in so.new_requests] == ["c"]  # only the first time


def test_max_num_seqs_respected():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    runner = FakeRunner(4)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", [i + 1] * 3, max_tokens=2))
    so = sched.schedule()
    assert [c.request_id for c in so.chunks] == ["r0", "r1"]
    assert sched.get_stats().num_running == 2 and sched.get_stats().num_waiting == 3
    sched.update(so, runner.execute(so))
    so = sched.schedule()  # r0, r1 decode; no room for r2
    assert [c.request_id for c in so.chunks] == ["r0", "r1"] and not so.new_requests
    sched.update(so, runner.execute(so))  # r0, r1 finish (max_tokens=2)
    so = sched.schedule()
    assert [c.request_id for c in so.chunks] == ["r2", "r3"]
    sched.update(so, runner.execute(so))
    outputs = run(sched, runner)  # run() asserts len(chunks) <= max_num_seqs every step
    assert sorted(outputs) == ["r2", "r3", "r4"]


def test_finished_ids_reported_next_step_and_blocks_freed_same_step():
    sched = make_scheduler()
    runner = FakeRunner(4)
    free0 = sched.get_stats().num_free_blocks
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    sched.add_request(make_request("b", [4, 5, 6], max_tokens=3))
    so = sched.schedule()
    outs = sched.update(so, runner.execute(so))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FINISH_LENGTH), ("b", None)]
    assert sched.get_stats().num_free_blocks == free0 - 1  # a's block is back already
    so = sched.schedule()
    assert so.finished_request_ids == ["a"] and [c.request_id for c in so.chunks] == ["b"]
    sched.update(so, runner.execute(so))
    assert sched.schedule().finished_request_ids == []


@pytest.mark.parametrize(
    "prompt_len, max_tokens, pattern",
    [
        (0, 4, "empty"),
        (10, 7, r"maximum context length is 16 tokens.*requested 17 tokens \(10 in the prompt, 7 in the completion\)"),
    ],
)
def test_rejected_at_admission(prompt_len, max_tokens, pattern):
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(RequestRejected, match=pattern):
        sched.add_request(make_request("a", [1] * prompt_len, max_tokens=max_tokens))
    assert not sched.has_unfinished_requests()


def test_request_that_can_never_fit_the_pool_is_refused():
    sched = make_scheduler(block_size=4, num_blocks=5, max_model_len=1000)  # 4 usable blocks = 16 tokens
    with pytest.raises(RequestRejected, match=r"20 tokens of KV cache.*5 blocks of 4 tokens.*only 4 blocks \(16 tokens\)"):
        sched.add_request(make_request("a", [1] * 12, max_tokens=9))
    # Exactly the pool: 12 + 5 - 1 = 16 KV tokens (the last sampled token needs no slot). Runs to the end.
    sched.add_request(make_request("b", [1] * 12, max_tokens=5))
    outs = run(sched, FakeRunner(4))
    assert len(tokens_of(outs["b"])) == 5 and outs["b"][-1].finish_reason == FINISH_LENGTH


def test_duplicate_id_is_an_engine_bug():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("a", [1]))


def test_abort_is_idempotent_and_frees_now():
    sched = make_scheduler()
    runner = FakeRunner(4)
    free0 = sched.get_stats().num_free_blocks
    sched.add_request(make_request("a", list(range(10)), max_tokens=8))
    sched.add_request(make_request("w", list(range(10)), max_tokens=8))
    sched.add_request(make_request("x", list(range(10)), max_tokens=8))
    so = sched.schedule()
    sched.update(so, runner.execute(so))
    outs = sched.finish_requests(["a", "nope"], FINISH_ABORT)
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outs] == [("a", FINISH_ABORT, [])]
    assert sched.finish_requests(["a"], FINISH_ABORT) == []
    outs = sched.fail_requests(["w"], "boom")
    assert outs[0].finish_reason == FINISH_ERROR and outs[0].error == "boom"
    assert sched.fail_requests(["w"], "boom") == []
    sched.finish_requests(["x"], FINISH_ABORT)
    st = sched.get_stats()
    assert st.num_free_blocks == free0 and st.num_running == 0 and not sched.has_unfinished_requests()
    assert sorted(sched.schedule().finished_request_ids) == ["a", "w", "x"]


def test_abort_of_waiting_request_is_not_reported_to_runner():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", [1, 2]))
    sched.add_request(make_request("b", [1, 2]))
    so = sched.schedule()
    assert [c.request_id for c in so.chunks] == ["a"]
    sched.finish_requests(["b"], FINISH_ABORT)
    assert sched.schedule().finished_request_ids == []
    assert sched.get_stats().num_waiting == 0


def test_chunk_of_request_aborted_before_update_is_ignored():
    sched = make_scheduler()
    runner = FakeRunner(4)
    sched.add_request(make_request("a", [1, 2, 3]))
    so = sched.schedule()
    ro = runner.execute(so)
    sched.finish_requests(["a"], FINISH_ABORT)
    assert sched.update(so, ro) == []


def test_prompt_logprobs_accumulate_across_chunks():
    sched = make_scheduler(max_num_batched_tokens=4)
    runner = FakeRunner(4)
    prompt = list(range(10, 20))  # 10 tokens -> 9 prompt logprobs, positions 0..8
    sched.add_request(make_request("a", prompt, max_tokens=2, prompt_logprobs=1))
    positions = []
    outs = run(sched, runner, on_step=lambda so: positions.append(so.chunks[0].prompt_logprob_positions))
    assert positions == [4, 4, 1, 0]  # chunks [0,4) [4,8) [8,10) then a decode
    first = outs["a"][0]
    assert first.prompt_logprobs == [None] + [[(prompt[p], -float(p), 1)] for p in range(1, 10)]
    assert outs["a"][1].prompt_logprobs is None
    assert first.new_logprobs == [[(first.new_token_ids[0], -0.5, 1)]]  # one TokenLogprobs per new token


def test_max_tokens_zero_computes_prompt_and_finishes():
    sched = make_scheduler(max_num_batched_tokens=4)
    runner = FakeRunner(4)
    sched.add_request(make_request("a", [5, 6, 7, 8, 9, 10], max_tokens=0, prompt_logprobs=0))
    samples = []
    outs = run(sched, runner, on_step=lambda so: samples.extend(c.sample for c in so.chunks))
    assert samples == [False, False]
    (out,) = outs["a"]
    assert out.finish_reason == FINISH_LENGTH and out.new_token_ids == []
    assert len(out.prompt_logprobs) == 6 and out.prompt_logprobs[0] is None


def test_stats_counters():
    sched = make_scheduler(block_size=4, num_blocks=33)
    runner = FakeRunner(4)
    st = sched.get_stats()
    assert (st.num_total_blocks, st.num_free_blocks, st.kv_cache_usage) == (32, 32, 0.0)
    prefix = list(range(1, 13))  # 3 full blocks
    sched.add_request(make_request("a", prefix + [50], max_tokens=3))
    run(sched, runner)
    sched.add_request(make_request("b", prefix + [60, 61], max_tokens=2))
    sched.add_request(make_request("c", [7] * 5, max_tokens=2, prompt_logprobs=1))  # not a cache query
    so = sched.schedule()
    st = sched.get_stats()
    assert st.num_running == 2 and st.num_waiting == 0
    # b holds 4 blocks (3 hit + 1), c holds 2.
    assert st.num_free_blocks == 26 and st.kv_cache_usage == pytest.approx(6 / 32)
    sched.update(so, runner.execute(so))
    run(sched, runner)
    st = sched.get_stats()
    assert st.prompt_tokens_total == 13 + 14 + 5
    assert st.prefix_cache_queries_total == 13 + 14
    assert st.prefix_cache_hits_total == 12
    assert st.num_preemptions_total == 0 and st.num_free_blocks == 32
    assert (st.num_running, st.num_waiting) == (0, 0)


def test_request_fields_after_run():
    sched = make_scheduler()
    req = make_request("a", [1, 2, 3, 4, 5], max_tokens=3)
    sched.add_request(req)
    assert req.status == RequestStatus.WAITING and req.first_scheduled_time is None
    outs = run(sched, FakeRunner(4))
    assert req.status == RequestStatus.FINISHED and req.finish_reason == FINISH_LENGTH
    assert req.first_scheduled_time >= req.arrival_time
    assert req.output_token_ids == tokens_of(outs["a"]) and req.num_tokens == 8
    assert req.all_token_ids == [1, 2, 3, 4, 5] + req.output_token_ids
    assert outs["a"][0].num_prompt_tokens == 5 and outs["a"][0].num_cached_tokens == 0


def test_empty_runner_output_for_sampled_chunk_is_a_bug():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2]))
    so = sched.schedule()
    with pytest.raises(AssertionError, match="no token"):
        sched.update(so, RunnerOutput())
