"""FP8 KV cache end to end on the tiny random Llama (issue 11, persistent plane): the cache layout is unchanged and
only its dtype differs, so prefix caching, chunked prefill and preemption must behave exactly as with auto.

Setups reused from tests/engine/test_engine.py (same prompts, pools and budgets) with kv_cache_dtype fp8_e4m3:
  - a prefix-cache hit gives the same greedy tokens as the miss;
  - chunked prefill (8-token budget) gives the same prompt logprobs as one-shot prefill (|diff| < 1e-4);
  - a pool small enough to force preemption + recompute gives the same greedy tokens as a roomy pool.
Each runs on the torch references (the CPU default); the first two also on the Triton kernels (CPU interpreter,
fewer prompts and tokens: the interpreter is slow), where preemption is covered by the kernel-level tests.
"""

from __future__ import annotations

import pytest
import torch

from helpers import make_bundle, tiny_model

from ladle.config import RunnerConfig
from ladle.core.sampling_params import SamplingParams
from ladle.engine.llm import LLM
from ladle.observe import dispatch

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
FP8 = "fp8_e4m3"
BACKENDS = {"torch": None, "triton": RunnerConfig(enforce_eager=True, attention_backend="TRITON_ATTN")}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def _tokens(outs) -> list:
    return [o.outputs[0].token_ids for o in outs]


def test_fp8_cache_is_allocated_in_fp8_and_holds_more_tokens(model):
    auto = make_bundle(model, num_blocks=17)
    fp8 = make_bundle(model, num_blocks=17, kv_cache_dtype=FP8)
    same_bytes = make_bundle(model, num_blocks=17, kv_cache_dtype="fp8_e5m2")
    runner = fp8.core.runner
    assert {c.key_cache.dtype for c in runner.kv_caches} == {torch.float8_e4m3fn}
    assert {c.value_cache.dtype for c in runner.kv_caches} == {torch.float8_e4m3fn}
    assert all(c.k_scale == 1.0 and c.v_scale == 1.0 for c in runner.kv_caches)  # no calibrated scales given
    assert same_bytes.core.runner.kv_caches[0].key_cache.dtype == torch.float8_e5m2
    # the same byte budget (that of 17 fp32 blocks) holds 4x the blocks at 1 byte per element
    bytes_fp32 = auto.core.runner.kv_cache_bytes
    big = make_bundle(model, num_blocks=17 * 4, kv_cache_dtype=FP8)
    assert big.core.runner.kv_cache_bytes == bytes_fp32 and big.core.runner.num_blocks == 68


def test_fp8_cache_changes_logprobs(model):
    """The FP8 cache is really read: prompt logprobs move against auto (this random model's logits are peaky, so
    the moves are not small; the real-model agreement is tests/engine/test_fp8_kv_smollm2.py)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    a = LLM(bundle=make_bundle(model)).generate([PROMPTS[4]], params)[0]
    f = LLM(bundle=make_bundle(model, kv_cache_dtype=FP8)).generate([PROMPTS[4]], params)[0]
    diffs = [abs(x[tok].logprob - y[tok].logprob)
             for x, y, tok in zip(a.prompt_logprobs[1:], f.prompt_logprobs[1:], PROMPTS[4][1:])]
    assert max(diffs) > 1e-5 and all(d == d for d in diffs)  # moved, and no NaN


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fp8_prefix_hit_equals_miss(model, backend):
    dispatch.reset()
    llm = LLM(bundle=make_bundle(model, num_blocks=128, kv_cache_dtype=FP8, runner=BACKENDS[backend]))
    prompts, params = (PROMPTS, GREEDY) if backend == "torch" else (PROMPTS[2:4], SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True))
    miss = llm.generate(prompts, params)
    hit = llm.generate(prompts, params)
    assert sum(o.num_cached_tokens for o in miss) == 0 and sum(o.num_cached_tokens for o in hit) > 0
    assert _tokens(hit) == _tokens(miss)
    buckets = dispatch.snapshot()["ops"]["kv_store"]["buckets"]
    assert buckets and all(b.endswith("kv=fp8_e4m3") for b in buckets), buckets
    assert sum(b["executed"] for b in buckets.values()) == (0 if backend == "torch" else
                                                            sum(b["calls"] for b in buckets.values()))


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_fp8_chunked_prefill_equals_one_shot(model, backend):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    prompt = PROMPTS[3]
    runner = BACKENDS[backend]
    chunked = LLM(bundle=make_bundle(model, max_num_batched_tokens=8, kv_cache_dtype=FP8, runner=runner))
    one_shot = LLM(bundle=make_bundle(model, max_num_batched_tokens=512, kv_cache_dtype=FP8, runner=runner))
    out = chunked.generate([prompt], params)[0]
    ref = one_shot.generate([prompt], params)[0]
    for a, b, tok in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], prompt[1:]):
        assert next(iter(a)) == tok and abs(a[tok].logprob - b[tok].logprob) < 1e-4 and a[tok].rank == b[tok].rank
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_fp8_preemption_and_recompute_equal_no_preemption(model):
    runner = None
    roomy = LLM(bundle=make_bundle(model, num_blocks=128, kv_cache_dtype=FP8, runner=runner)).generate(PROMPTS, GREEDY)
    tight_bundle = make_bundle(model, num_blocks=12, max_num_batched_tokens=32, max_model_len=128,
                               kv_cache_dtype=FP8, runner=runner)
    tight = LLM(bundle=tight_bundle).generate(PROMPTS, GREEDY)
    assert tight_bundle.core.get_stats().num_preemptions_total > 0, "the pool should have forced preemption"
    assert _tokens(tight) == _tokens(roomy)
    stats = tight_bundle.core.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_checkpoint_kv_scales_reach_the_fp8_cache():
    """HF FP8-KV checkpoints carry per-tensor `self_attn.k_scale` / `v_scale` (or `kv_scale`): the Llama loader
    keeps them and the runner puts them into the FP8 caches (auto caches ignore them); the engine still runs."""
    model = tiny_model(seed=0)
    loaded = model.load_weights([("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
                                 ("model.layers.1.self_attn.kv_scale", torch.tensor([2.0])),
                                 ("model.layers.0.self_attn.v_proj.output_scale", torch.tensor(0.25))])
    assert loaded == set()  # no parameter was written
    assert model.kv_cache_scales() == [(0.5, 0.25), (2.0, 2.0)]
    fp8 = make_bundle(model, kv_cache_dtype=FP8)
    assert [(c.k_scale, c.v_scale) for c in fp8.core.runner.kv_caches] == [(0.5, 0.25), (2.0, 2.0)]
    auto = make_bundle(model)
    assert [(c.k_scale, c.v_scale) for c in auto.core.runner.kv_caches] == [(1.0, 1.0), (1.0, 1.0)]
    outs = LLM(bundle=fp8).generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    with pytest.raises(ValueError, match="per-tensor"):
        model.load_weights([("model.layers.0.self_attn.k_scale", torch.ones(2))])
