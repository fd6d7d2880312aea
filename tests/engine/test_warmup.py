"""Kernel warm-up at startup (ladle/runner/warmup.py): the step shapes it runs, and that running it leaves the engine
exactly as it was (zeroed pool, no request state, the same tokens afterwards). It runs on CUDA only at startup;
here it is called directly on CPU engines (the tiny Llama and the tiny MiniMax-M3)."""

from __future__ import annotations

import pytest
import torch

from helpers import M3_ENGINE, make_bundle, tiny_model

from ladle.core.sampling_params import SamplingParams
from ladle.engine.llm import LLM
from ladle.runner.warmup import token_buckets, warm_up_kernels, warmup_step_shapes

PROMPTS = [[5, 9, 33, 7], list(range(40, 71)), [300, 2, 2, 8, 150, 77, 12, 19, 4]]


@pytest.mark.parametrize("max_tokens,max_seqs,max_len,block", [(32768, 128, 11264, 128), (96, 8, 64, 16),
                                                               (8192, 256, 40960, 16), (128, 2, 128, 128)])
def test_step_shapes_cover_each_bucket_within_the_limits(max_tokens, max_seqs, max_len, block):
    shapes = warmup_step_shapes(max_tokens, max_seqs, max_len, block)
    assert len({tuple(s) for s in shapes}) == len(shapes), "no step twice"
    for step in shapes:
        assert 1 <= len(step) <= max_seqs and sum(q for _, q in step) <= max_tokens
        assert all(q >= 1 and start >= 0 and start + q <= max_len for start, q in step)
    totals = {sum(q for _, q in s) for s in shapes}
    single = {s[0][1] for s in shapes if len(s) == 1 and s[0][0] == 0}
    for t in token_buckets(max_tokens):
        if max_seqs > 2 or t <= max_len:  # two requests and a cached context can always make t tokens then
            assert t in totals, f"no step of exactly {t} tokens"
        if t >= 16:
            assert t - 5 in totals, f"no step of {t} - 5 tokens (not a multiple of 16)"
        assert min(t, max_len) in single, "no single-request prefill (the == 1 specialisation)"
        if t >= 32 and max_seqs >= 16 and t <= max_len:
            assert any(len(s) == 16 and sum(q for _, q in s) == t for s in shapes), "16 requests (divisible by 16)"
            assert -(-3 * t // 5) in totals, "T x (top-k + 1) in the power of two below"
            pairs = {(sum(q for _, q in s) % 16 == 0, len(s) % 16 == 0) for s in shapes
                     if t // 2 < sum(q for _, q in s) <= t and len(s) > 1}
            assert pairs == {(True, True), (True, False), (False, True), (False, False)}, \
                "the MSA kernels' (T, B) divisibility pairs in every bucket"
    mixed = [s for s in shapes if any(q == 1 and start > 0 for start, q in s)]
    if max_seqs > 2:
        assert mixed and all(any(start > 0 and q > 1 for start, q in s) for s in mixed if sum(q for _, q in s) > 16), \
            "mixed steps carry decode rows and a prefill chunk over a cached context"
    assert token_buckets(32768)[:3] == [2, 4, 8] and token_buckets(32768)[-1] == 32768
    assert token_buckets(12000)[-2:] == [8192, 12000]


def _generate(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=6, ignore_eos=True)]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _check_warm_up_leaves_no_trace(make_llm):
    expected = _generate(make_llm())
    llm = make_llm()
    runner = llm.core.runner
    ran, seconds = warm_up_kernels(runner)
    assert ran > 0 and seconds >= 0
    assert not runner.requests, "warm-up keeps no request state"
    for cache in runner.kv_caches:  # the pool is as allocated: zeros
        for t in (cache.key_cache, cache.value_cache, cache.index_key_cache):
            assert t is None or not torch.count_nonzero(t.float())
    assert _generate(llm) == expected, "tokens after the warm-up differ (seeded and unseeded draws included)"
    return ran


def test_warm_up_leaves_the_llama_engine_as_it_was():
    model = tiny_model(seed=2)
    ran = _check_warm_up_leaves_no_trace(
        lambda: LLM(bundle=make_bundle(model, max_model_len=64, max_num_batched_tokens=96, max_num_seqs=8)))
    assert ran == len(warmup_step_shapes(96, 8, 64, 16)), "every shape fits this pool"


def test_warm_up_leaves_the_m3_engine_as_it_was(tiny_m3_dir):
    ran = _check_warm_up_leaves_no_trace(lambda: LLM(tiny_m3_dir, **{**M3_ENGINE, "max_num_batched_tokens": 160}))
    assert ran >= 8


def test_warm_up_writes_the_kv_pool_before_zeroing_it(monkeypatch):
    """The steps do reach the real pool (so the zeroing is not vacuous): stop the zeroing and blocks are written."""
    model = tiny_model(seed=2)
    runner = make_bundle(model, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4).core.runner
    monkeypatch.setattr(torch.Tensor, "zero_", lambda self: self)
    warm_up_kernels(runner)
    assert torch.count_nonzero(runner.kv_caches[0].key_cache[1:3]) > 0
    assert not torch.count_nonzero(runner.kv_caches[0].key_cache[0]), "the null block is never written"


def test_variant_rules_table_width_and_request_lookup_width():
    """The two rules that keep one compiled variant where a width per step made several (module docstring)."""
    import numpy as np

    from ladle.core.outputs import ScheduledChunk
    from ladle.kernels._common import reqs_p2
    from ladle.runner.input_batch import build_batch_inputs, table_width

    assert [table_width(n) for n in (0, 1, 16, 17, 88)] == [16, 16, 16, 32, 96]
    assert [reqs_p2(b) for b in (1, 31, 255, 256)] == [256, 256, 256, 512]
    chunks = [ScheduledChunk("a", [1, 2, 3], 0, [5], True), ScheduledChunk("b", [4], 20, [6, 7], True)]
    exact = np.array([[5, 0], [6, 7]], np.int32)  # a caller's table of the exact width is padded with block 0
    table = build_batch_inputs(chunks, 16, torch.device("cpu"), exact).attn_metadata.block_table
    assert table.shape == (2, 16) and table[:, :2].tolist() == exact.tolist() and not table[:, 2:].any()
