"""More than 20 top logprobs end to end through the offline LLM on a tiny random Llama: SamplingParams takes no
fixed cap (the server's --max-logprobs and the LLM's vocabulary bound it), and the runner's packing
(`compute_logprobs` / `unpack_logprobs`) gives k = 30 alternatives that match an independent float64 reference
(transformers with the same weights)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "engine"))
from helpers import hf_twin, make_bundle, tiny_model  # noqa: E402

from ladle.core.sampling_params import SamplingParams  # noqa: E402
from ladle.engine.llm import LLM  # noqa: E402

K = 30


def _check_entry(entry, token: int, ref_row: torch.Tensor) -> None:
    """entry: the offline form, a dict token id -> Logprob holding `token` (its key first) and the K alternatives
    (`token` once: K + 1 keys, or K when it is one of them); ref_row: float64 log-softmax [V]."""
    assert next(iter(entry)) == token and abs(entry[token].logprob - ref_row[token].item()) < 1e-4
    assert entry[token].rank == 1 + int((ref_row > ref_row[token] + 1e-6).sum())
    alts = sorted(((tid, lp.logprob, lp.rank) for tid, lp in entry.items()), key=lambda e: e[2])[:K]
    assert len(entry) == (K if token in {a for a, _, _ in alts} else K + 1)
    assert len(alts) == K and [r for _, _, r in alts] == list(range(1, K + 1))
    values = [v for _, v, _ in alts]
    assert values == sorted(values, reverse=True)
    for a, v, _ in alts:
        assert abs(v - ref_row[a].item()) < 1e-4
    assert values[-1] >= ref_row.topk(K).values[-1].item() - 1e-4  # the K best, not just K of them


def test_offline_llm_returns_30_top_logprobs_matching_a_reference():
    model = tiny_model(seed=3)
    llm = LLM(bundle=make_bundle(model))
    prompt = [(11 * j) % 500 + 1 for j in range(9)]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    out = llm.generate([prompt], params)[0]
    generated = out.outputs[0].token_ids
    with torch.inference_mode():
        logits = hf_twin(model)(torch.tensor([prompt + generated])).logits[0].to(torch.float64)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):  # prompt token p is predicted by position p - 1
        _check_entry(out.prompt_logprobs[p], prompt[p], ref[p - 1])
    for i, token in enumerate(generated):
        _check_entry(out.outputs[0].logprobs[i], token, ref[len(prompt) - 1 + i])


def test_offline_llm_bounds_logprobs_by_the_vocabulary():
    from fake_engine import FakeTokenizer  # a vocabulary of 258

    llm = LLM(bundle=make_bundle(tiny_model(seed=0), tokenizer=FakeTokenizer()))
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be in \\[0, 258\\] \\(the vocabulary size\\)"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, **{field: 259}))
    assert not llm.core.has_unfinished_requests()


def test_sampling_params_takes_no_fixed_logprobs_cap():
    assert SamplingParams(logprobs=100, prompt_logprobs=100).logprobs == 100
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: -1})
