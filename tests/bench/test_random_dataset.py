"""The random workload: length distribution, shared prefix and determinism, over many draws.

Uses a word-level tokenizer (ids <-> "w{id}"), for which decode/encode round-trips exactly, so the drawn lengths
are the final lengths and can be checked against the closed-form bounds (bench_methodology.md §1.5).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ladle.bench.datasets import random_length_bounds, sample_random


class WordTokenizer:
    def __init__(self, vocab_size=500, special=(0, 1), num_special_to_add=1):
        self.vocab_size = vocab_size
        self.special_ids = set(special)
        self.num_special_tokens_to_add = num_special_to_add
        self.max_model_len = None

    def encode(self, text):
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def _ids(req):
    return [int(w[1:]) for w in req.prompt.split()]


def test_vllm_symmetric_range_over_many_draws():
    tok = WordTokenizer()
    reqs = sample_random(tok, 3000, input_len=101, output_len=50, range_ratio=0.5, seed=3, num_workers=1)
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.expected_output_len for r in reqs])
    real = 101 - 1  # minus num_special_tokens_to_add
    assert ins.min() == math.floor(real * 0.5) and ins.max() == math.ceil(real * 1.5)  # 50, 150 both reached
    assert outs.min() == 25 and outs.max() == 75
    assert abs(ins.mean() - real) < 2.0 and abs(outs.mean() - 50) < 1.0  # uniform: mean at the centre
    # integer-uniform: every length in range occurs, none is rare (expected 3000/101 ~ 30 each)
    counts = np.bincount(ins - 50, minlength=101)
    assert counts.min() >= 10
    assert all(len(_ids(r)) == r.prompt_len for r in reqs)
    assert not any(set(_ids(r)) & tok.special_ids for r in reqs)


def test_inferencex_range_mode():
    assert random_length_bounds(8192, 1024, 0.8, 0, "inferencex") == (6553, 8192, 819, 1024)
    assert random_length_bounds(8192, 1024, 0.8, 0, "vllm") == (1638, 14746, 204, 1844)
    tok = WordTokenizer(num_special_to_add=0)
    reqs = sample_random(tok, 2000, 100, 20, 0.8, seed=0, range_mode="inferencex", num_workers=1)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) == 80 and max(ins) == 100 and min(outs) == 16 and max(outs) == 20


def test_prefix_shared_and_bodies_distinct():
    tok = WordTokenizer(num_special_to_add=0)
    reqs = sample_random(tok, 200, 40, 8, 0.0, prefix_len=25, seed=1, num_workers=1)
    prefixes = {tuple(_ids(r)[:25]) for r in reqs}
    assert len(prefixes) == 1
    assert all(r.prompt_len == 65 for r in reqs)
    # vLLM's body: allowed[(offset + i + k) % len(allowed)] -- consecutive allowed ids
    allowed = [i for i in range(500) if i not in (0, 1)]
    for i, r in enumerate(reqs[:20]):
        body = _ids(r)[25:]
        start = allowed.index(body[0])
        assert body == [allowed[(start + k) % len(allowed)] for k in range(40)]
    assert len({tuple(_ids(r)[25:]) for r in reqs}) > 150


def test_deterministic_under_seed():
    tok = WordTokenizer()
    a = sample_random(tok, 50, 64, 16, 0.3, prefix_len=5, seed=7, num_workers=4)
    b = sample_random(tok, 50, 64, 16, 0.3, prefix_len=5, seed=7, num_workers=1)
    c = sample_random(tok, 50, 64, 16, 0.3, prefix_len=5, seed=8, num_workers=1)
    assert [(r.prompt, r.expected_output_len) for r in a] == [(r.prompt, r.expected_output_len) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_bad_ratio_rejected():
    with pytest.raises(ValueError):
        random_length_bounds(100, 10, 1.0, 0)


class LossyTokenizer(WordTokenizer):
    """Merges every "w2 w3" pair into one token on encode: the re-tokenised length differs from the drawn one."""

    def encode(self, text):
        out, ids = [], super().encode(text)
        i = 0
        while i < len(ids):
            if ids[i] == 2 and i + 1 < len(ids) and ids[i + 1] == 3:
                out.append(499)
                i += 2
            else:
                out.append(ids[i])
                i += 1
        return out


def test_decode_reencode_converges_to_target():
    tok = LossyTokenizer(vocab_size=500, num_special_to_add=0)
    reqs = sample_random(tok, 300, 30, 4, 0.0, seed=2, num_workers=1)
    assert all(len(tok.encode(r.prompt)) == r.prompt_len for r in reqs)
    assert sum(r.prompt_len == 30 for r in reqs) >= 295  # the 10-round pad/truncate loop reaches the target
