"""The offline API's logprobs in vLLM's shape: per position a dict token id -> Logprob(logprob, rank, decoded_token)
holding the sampled (prompt) token once plus the top k; checked against a float64 forward of the same weights
(transformers' Llama, tests/engine/helpers.py:hf_twin)."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, hf_twin, make_bundle, tiny_model

from ladle.core.sampling_params import SamplingParams
from ladle.engine.llm import LLM
from ladle.engine.logprobs import Logprob

BASE = [(11 * j) % 500 + 3 for j in range(10)]
K, PROMPT_K = 3, 2


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def prompt(model):
    """BASE (its tokens mostly far from the model's top choices) then the model's greedy continuation of it (each
    token its position's top-1): prompt logprobs see the prompt token outside and inside the top k."""
    return BASE + hf_greedy(hf_twin(model), BASE, 5)


def _reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V] float64 log-softmax of the next-token logits at every position."""
    hf = hf_twin(model).double()
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].double(), dim=-1)


def _check_position(entry: dict, token: int, ref: torch.Tensor, k: int, tokenizer) -> int:
    """Assert one position's dict against the float64 reference `ref` [V]; returns the token's reference rank."""
    assert isinstance(entry, dict) and all(isinstance(v, Logprob) for v in entry.values())
    assert next(iter(entry)) == token  # the sampled / prompt token's key first, and only once (dict keys)
    top = ref.topk(k).indices.tolist()
    rank = int((ref > ref[token]).sum()) + 1
    expected_ranks = {tid: j + 1 for j, tid in enumerate(top)}
    expected_ranks.setdefault(token, rank)
    assert {tid: lp.rank for tid, lp in entry.items()} == expected_ranks
    assert len(entry) == (k if token in top else k + 1)
    for tid, lp in entry.items():
        assert lp.logprob == pytest.approx(float(ref[tid]), abs=1e-4)
        assert lp.decoded_token == (None if tokenizer is None else tokenizer.decode([tid]))
    return rank


@pytest.mark.parametrize("temperature", [0.0, 4.0])
def test_sample_and_prompt_logprobs_are_vllm_dicts(model, prompt, smollm2_tokenizer, temperature):
    """Greedy: the sampled token is the top-1, one entry of rank 1 (it was listed twice). A hot temperature samples
    tokens outside the top k: k + 1 entries, the sampled one with its rank in the whole vocabulary."""
    llm = LLM(bundle=make_bundle(model, tokenizer=smollm2_tokenizer))
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=16, ignore_eos=True, logprobs=K,
                            prompt_logprobs=PROMPT_K)
    out = llm.generate([prompt], params)[0]
    choice = out.outputs[0]
    ref = _reference_logprobs(model, prompt + choice.token_ids)
    assert len(choice.logprobs) == len(choice.token_ids) == 16
    ranks = [_check_position(entry, tok, ref[len(prompt) - 1 + i], K, smollm2_tokenizer)
             for i, (tok, entry) in enumerate(zip(choice.token_ids, choice.logprobs))]
    if temperature == 0:
        assert set(ranks) == {1}
    else:
        assert max(ranks) > K, ranks  # not vacuous: some sampled token was outside the top k
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    prompt_ranks = [_check_position(entry, prompt[p], ref[p - 1], PROMPT_K, smollm2_tokenizer)
                    for p, entry in enumerate(out.prompt_logprobs) if p > 0]
    assert max(prompt_ranks) > PROMPT_K and min(prompt_ranks) <= PROMPT_K, prompt_ranks  # both shapes occur


def test_logprobs_zero_without_tokenizer(model, prompt):
    """logprobs=0: the sampled token alone; no tokenizer: decoded_token None (as vLLM without detokenization)."""
    out = LLM(bundle=make_bundle(model)).generate([prompt], SamplingParams(temperature=0, max_tokens=4,
                                                                           ignore_eos=True, logprobs=0))[0]
    choice = out.outputs[0]
    ref = _reference_logprobs(model, prompt + choice.token_ids)
    for i, (tok, entry) in enumerate(zip(choice.token_ids, choice.logprobs)):
        assert list(entry) == [tok] and entry[tok].rank == 1 and entry[tok].decoded_token is None
        assert entry[tok].logprob == pytest.approx(float(ref[len(prompt) - 1 + i, tok]), abs=1e-4)
    assert out.prompt_logprobs is None
