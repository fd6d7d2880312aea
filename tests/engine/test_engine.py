"""EngineCore / LLM behaviour on a tiny random Llama (fast): preemption, failures, n/seeds, stop strings,
logits layout, config resolution."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY_LLAMA, hf_greedy, hf_twin, make_bundle, tiny_model

from ladle.config import EngineConfig, CacheConfig, ModelConfig
from ladle.core.outputs import RequestRejected, ScheduledChunk
from ladle.core.sampling_params import SamplingParams
from ladle.engine.config_resolve import ConfigError, resolve_engine_config
from ladle.engine.llm import LLM
from ladle.runner.input_batch import build_batch_inputs
from ladle.runner.kv_cache import KVCacheTooSmall

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def test_preemption_with_tiny_pool_keeps_greedy_tokens(model):
    hf = hf_twin(model)  # independent reference: transformers with the same weights
    expected = [hf_greedy(hf, p, 24) for p in PROMPTS]
    bundle = make_bundle(model, num_blocks=12, max_num_batched_tokens=32,
                         max_model_len=128)  # 11 usable blocks of 16 tokens
    llm = LLM(bundle=bundle)
    outs = llm.generate(PROMPTS, GREEDY)
    assert bundle.core.get_stats().num_preemptions_total > 0, "the pool should have forced preemption"
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = bundle.core.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_seeded_sampling_survives_preemption(model):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    roomy_llm = LLM(bundle=make_bundle(model, num_blocks=128))
    roomy = roomy_llm.generate(PROMPTS, params)
    cached = roomy_llm.generate(PROMPTS, params)  # prefixes now hit the cache
    assert sum(o.num_cached_tokens for o in cached) > 0
    assert [o.outputs[0].token_ids for o in roomy] == [o.outputs[0].token_ids for o in cached]
    tight_bundle = make_bundle(model, num_blocks=12, max_num_batched_tokens=32, max_model_len=128)
    tight = LLM(bundle=tight_bundle).generate(PROMPTS, params)
    assert tight_bundle.core.get_stats().num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in roomy] == [o.outputs[0].token_ids for o in tight]


def test_failing_step_fails_only_its_requests(model):
    bundle = make_bundle(model, max_num_seqs=1)
    runner = bundle.core.runner
    real_execute = runner.execute

    def execute(sched_out):
        if any(c.token_ids[:1] == [13] and c.start_position == 0 for c in sched_out.chunks):
            raise RuntimeError("injected failure")
        return real_execute(sched_out)

    runner.execute = execute
    llm = LLM(bundle=bundle)
    outs = llm.generate([[13, 14, 15], [20, 21, 22]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert outs[0].outputs[0].finish_reason == "error" and "injected failure" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 5
    assert bundle.core.get_stats().num_free_blocks == bundle.core.get_stats().num_total_blocks
    again = llm.generate([[20, 21, 22]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_n_children_use_seed_plus_index(model):
    llm = LLM(bundle=make_bundle(model))
    params = SamplingParams(temperature=1.0, n=4, seed=100, max_tokens=12, ignore_eos=True)
    first = llm.generate([PROMPTS[1]], params)[0]
    choices = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len({tuple(c) for c in choices}) == 4, "n choices at temperature 1 should differ"
    assert [c.token_ids for c in llm.generate([PROMPTS[1]], params)[0].outputs] == choices
    single = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=102, max_tokens=12, ignore_eos=True))
    assert single[0].outputs[0].token_ids == choices[2]


def test_stop_string_through_engine(model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    llm = LLM(bundle=make_bundle(model, tokenizer=tok))
    base = llm.generate([PROMPTS[2]], GREEDY)[0].outputs[0]
    text = base.text
    # a stop string that starts inside one token and ends in a later one
    pieces = [tok.decode([t]) for t in base.token_ids]
    offsets, pos = [], 0
    for p in pieces:
        offsets.append(pos)
        pos += len(p)
    k = next(i for i in range(4, len(pieces) - 2) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    start = offsets[k] + len(pieces[k]) - 1
    stop = text[start:offsets[k + 1] + len(pieces[k + 1])]
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    first = text.find(stop)
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:first] and stop not in c.text
    assert len(c.token_ids) < len(base.token_ids)
    stats = llm.core.get_stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_rejections(model):
    llm = LLM(bundle=make_bundle(model, max_model_len=64))
    with pytest.raises(RequestRejected, match="64"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected):
        llm.generate([[1] * 64], SamplingParams(max_tokens=None))
    out = llm.generate([[1] * 60], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4  # max_tokens None = max_model_len - prompt length
    assert not llm.core.has_unfinished_requests()


def test_logits_layout_with_prompt_logprobs():
    chunks = [ScheduledChunk("a", [1, 2, 3, 4], 0, [1], sample=False, prompt_logprob_positions=4),
              ScheduledChunk("b", [9], 16, [2, 3], sample=True),
              ScheduledChunk("c", [5, 6, 7], 4, [4], sample=True, prompt_logprob_positions=2)]
    batch = build_batch_inputs(chunks, 16, torch.device("cpu"))
    assert batch.logits.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert batch.logits.num_logits_per_req == [4, 1, 3]
    assert batch.logits.sample_rows == [4, 7]
    md = batch.attn_metadata
    assert md.query_start_loc.tolist() == [0, 4, 5, 8]
    assert md.seq_lens.tolist() == [4, 17, 7] and md.context_lens.tolist() == [0, 16, 4]
    assert md.slot_mapping.tolist() == [16, 17, 18, 19, 3 * 16 + 0, 64 + 4, 64 + 5, 64 + 6]
    assert md.block_table.tolist() == [r + [0] * 14 for r in ([1, 0], [2, 3], [4, 0])]  # 16-column aligned
    assert batch.positions.tolist() == [0, 1, 2, 3, 16, 4, 5, 6]


def test_prompt_logprobs_match_full_forward(model):
    llm = LLM(bundle=make_bundle(model, max_num_batched_tokens=8))
    prompt = PROMPTS[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, logprobs=0))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    # reference: one unchunked forward of the whole prompt through a fresh engine's runner
    big = LLM(bundle=make_bundle(model, max_num_batched_tokens=512))
    ref = big.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    for a, b, tok in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], prompt[1:]):
        assert next(iter(a)) == tok and abs(a[tok].logprob - b[tok].logprob) < 1e-4 and a[tok].rank == b[tok].rank
    lp = out.outputs[0].logprobs[0]
    assert list(lp) == out.outputs[0].token_ids[:1] and lp[out.outputs[0].token_ids[0]].rank == 1  # greedy: rank 1


def test_config_resolution():
    hf = dict(TINY_LLAMA)
    cfg = resolve_engine_config(EngineConfig(model=ModelConfig(device="cpu")), hf)
    assert (cfg.model.dtype, cfg.model.max_model_len, cfg.cache.block_size) == ("float32", 256, 16)
    assert cfg.cache.kv_cache_memory_bytes == 2 << 30
    with pytest.raises(ConfigError, match="max_position_embeddings = 256"):
        resolve_engine_config(EngineConfig(model=ModelConfig(device="cpu", max_model_len=512)), hf)

    class Sparse:
        @classmethod
        def required_block_size(cls, hf_config):
            return 128

    assert resolve_engine_config(EngineConfig(model=ModelConfig(device="cpu")), hf, Sparse).cache.block_size == 128
    with pytest.raises(ConfigError, match="must be 128"):
        resolve_engine_config(EngineConfig(model=ModelConfig(device="cpu"), cache=CacheConfig(block_size=16)), hf,
                              Sparse)
    mm = {"text_config": dict(hf, max_position_embeddings=4096)}
    assert resolve_engine_config(EngineConfig(model=ModelConfig(device="cpu")), mm).model.max_model_len == 4096


def test_kv_pool_too_small_for_max_model_len(model):
    with pytest.raises(KVCacheTooSmall, match=r"max_model_len \(256 tokens\).*--max-model-len"):
        make_bundle(model, num_blocks=8, max_model_len=256)


def test_memory_profile_dummy_step_runs(model):
    """The CUDA profiling step (forward at max_num_batched_tokens, worst-case sampler) also runs on CPU."""
    runner = make_bundle(model, max_model_len=64).core.runner
    scratch = runner._dummy_step(150)  # 3 sequences of <= max_model_len
    per_block = sum(s.bytes_per_token(4) for s in runner.kv_cache_specs) * runner.block_size
    assert scratch == (1 + 4 + 4 + 2) * per_block


def test_cuda_only_arguments_on_cpu_are_refused_as_the_cli_refuses_their_flags():
    """`LLM(gpu_memory_utilization=..., device="cpu")` was accepted and then sized nothing (null in /version)."""
    with pytest.raises(ValueError, match="gpu_memory_utilization: applies on CUDA only, and this run is on CPU; on "
                                         "CPU the KV cache takes kv_cache_memory_bytes") as refused:
        LLM(gpu_memory_utilization=0.5, device="cpu")
    assert isinstance(refused.value, ConfigError) and "--" not in str(refused.value)  # the keywords, not the flags
    with pytest.raises(ValueError, match="cuda_graph_sizes: applies on CUDA only"):
        LLM(cuda_graph_sizes=(1, 8), device="cpu")
    with pytest.raises(ValueError) as both:  # the header names the Python call, not a command line
        LLM(gpu_memory_utilization=0.5, cuda_graph_sizes=(1, 8), device="cpu")
    assert str(both.value).startswith("2 settings of this LLM(...) call are refused")
    if not torch.cuda.is_available():  # auto resolves to CPU here
        with pytest.raises(ValueError, match="gpu_memory_utilization: applies on CUDA only"):
            LLM(gpu_memory_utilization=0.5)
