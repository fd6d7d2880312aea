"""The runner's per-step shortcuts give exactly what the plain paths give: the persistent (incremental) block
table vs a table rebuilt from every chunk's block ids, the cached per-batch sampling tensors vs tensors rebuilt
from scratch, and the detokenizer's direct Rust decode vs `tokenizer.decode`. Driven through real engine steps
with preemption (rows and states dropped and re-created), finishes, min_tokens bans and logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import make_bundle, tiny_model

from ladle.core.sampling_params import SamplingParams
from ladle.engine.detokenizer import fast_decoder
from ladle.engine.llm import LLM
from ladle.runner.input_batch import build_batch_inputs
from ladle.runner.request_state import build_sampling_tensors

PROMPTS = [[(11 * i + 5 * j) % 500 + 1 for j in range(3 + 13 * i)] for i in range(8)]
PARAMS = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
          SamplingParams(temperature=1.0, top_p=0.8, max_tokens=30, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.7, top_k=5, min_p=0.05, max_tokens=12, min_tokens=6, stop_token_ids=[7]),
          SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.3, max_tokens=25, seed=3)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_incremental_block_table_and_cached_sampling_match_rebuilds(model, async_scheduling):
    bundle = make_bundle(model, num_blocks=14, max_num_batched_tokens=40, max_model_len=128, max_num_seqs=4,
                         async_scheduling=async_scheduling)
    runner = bundle.core.runner
    real_prepare, real_tensors = runner._prepare_inputs, runner._sampling_tensors
    seen = {"steps": 0, "cache_hits": 0}

    def prepare(chunks, placeholder_chunks=()):
        batch = real_prepare(chunks, placeholder_chunks)
        fresh = build_batch_inputs(chunks, runner.block_size, runner.device)  # table from the chunks' block ids
        assert _same(batch.attn_metadata.block_table, fresh.attn_metadata.block_table)
        assert _same(batch.attn_metadata.slot_mapping, fresh.attn_metadata.slot_mapping)
        seen["steps"] += 1
        return batch

    def tensors(states, positions, vocab_size):
        before = runner._static_cache
        got, num_top = real_tensors(states, positions, vocab_size)
        seen["cache_hits"] += before is runner._static_cache
        ref = build_sampling_tensors(states, positions, vocab_size, runner.device)
        for name, value in vars(ref).items():
            other = getattr(got, name)
            assert (_same(value, other) if isinstance(value, torch.Tensor) else value == other), name
        wanted = [s.sampling_params.logprobs for s in states if s.sampling_params.logprobs is not None]
        assert num_top == (max(wanted) if wanted else None)
        return got, num_top

    runner._prepare_inputs, runner._sampling_tensors = prepare, tensors
    params = [PARAMS[i % len(PARAMS)] for i in range(len(PROMPTS))]
    LLM(bundle=bundle).generate(PROMPTS, params)
    assert bundle.core.get_stats().num_preemptions_total > 0, "the pool should have forced preemption"
    assert seen["steps"] > 20 and seen["cache_hits"] > 0
    bundle.core.step()  # the last finishes reach the runner with the next schedule
    assert not runner.requests and sorted(runner._free_rows) == list(range(runner._block_table_cpu.shape[0]))


def test_rows_of_states_dropped_from_outside_are_reclaimed(model):
    bundle = make_bundle(model, max_num_seqs=2)
    llm = LLM(bundle=bundle)
    runner = bundle.core.runner
    for _ in range(3):  # EngineCore's failure path pops states without telling the runner's row list
        llm.generate([PROMPTS[1], PROMPTS[2]], PARAMS[0])
        runner.requests.clear()
        runner._free_rows.clear()
    out = llm.generate([PROMPTS[1], PROMPTS[2]], PARAMS[0])
    assert [len(o.outputs[0].token_ids) for o in out] == [20, 20]
    assert runner._block_table_cpu.shape[0] == 2  # reclaimed, not grown


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decoder_matches_tokenizer_decode(smollm2_tokenizer, skip):
    tok = smollm2_tokenizer
    decode = fast_decoder(tok, skip)
    assert decode is not None, "SmolLM2's tokenizer is a TokenizersBackend: the fast path must apply"
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) if rng.random() > 0.1 else rng.choice(special) for _ in range(rng.randint(0, 6))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_fast_decoder_declines_overridden_decode(smollm2_tokenizer):
    class Custom(type(smollm2_tokenizer)):
        def _decode(self, token_ids, **kwargs):  # noqa: D401 - a subclass that changes decoding
            return "x"

    tok = object.__new__(Custom)
    assert fast_decoder(tok, True) is None
