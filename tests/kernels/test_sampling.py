"""Sampler: filters against a brute-force per-row implementation, the Triton race against its torch twin,
seeded reproducibility, and the race's distribution against the target probabilities."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import filtered_probs, race, race_ref, sample


def _brute_filter(logits, temp, k, p, min_p):
    """One row, written the slow obvious way (sorted list walk)."""
    probs = torch.softmax(logits.double() / (temp if temp > 0 else 1.0), -1)
    keep = [i for i in range(len(probs)) if probs[i] >= min_p * probs.max()]
    keep.sort(key=lambda i: -probs[i].item())
    if k > 0:
        keep = keep[:k]
    total = sum(probs[i].item() for i in keep)
    kept, mass = [], 0.0
    for i in keep:
        if mass >= p * total:
            break
        kept.append(i)
        mass += probs[i].item()
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out


def test_filters_match_brute_force():
    g = torch.Generator().manual_seed(0)
    b, v = 6, 40
    logits = torch.randn(b, v, generator=g) * 2
    temp = torch.tensor([1.0, 0.7, 1.3, 0.0, 2.0, 1.0])
    top_k = torch.tensor([0, 5, 0, 3, 40, 1], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.3, 0.8])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.05, 0.0, 0.2])
    got = filtered_probs(logits, temp, top_k, top_p, min_p)
    for i in range(b):
        want = _brute_filter(logits[i], temp[i].item(), top_k[i].item(), top_p[i].item(), min_p[i].item())
        assert torch.equal(got[i] > 0, want > 0), f"row {i} kept set differs"
        assert torch.allclose(got[i].double(), want, atol=1e-6)


def test_triton_race_equals_torch_twin():
    g = torch.Generator().manual_seed(1)
    probs = torch.rand(6, 1000, generator=g) * (torch.rand(6, 1000, generator=g) > 0.3)
    seeds = torch.tensor([0, 1, -7, 2**40 + 3, 123, 123], dtype=torch.int64)
    steps = torch.tensor([0, 0, 5, 2**33, 9, 10], dtype=torch.int64)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreted Triton kernel
    got = race(probs.to(dev), seeds.to(dev), steps.to(dev)).cpu()
    assert torch.equal(got, race_ref(probs, seeds, steps))


def test_race_distribution():
    """20000 independent draws (distinct seeds) from p: every frequency within 4 sigma of p."""
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0, 0.0, 0.0])
    n = 20000
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 17
    draws = race_ref(p.expand(n, -1).contiguous(), seeds, torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(draws, minlength=8).double() / n
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    assert (freq - p.double()).abs().le(4 * sigma + 1e-12).all(), freq
    assert freq[5:].sum() == 0


def test_sample_greedy_seeded_and_batch_invariant():
    g = torch.Generator().manual_seed(2)
    v = 300
    logits = torch.randn(4, v, generator=g)
    temp = torch.tensor([0.0, 1.0, 0.8, 1.0])
    top_k = torch.tensor([0, 50, 0, 10])
    top_p = torch.tensor([1.0, 0.95, 0.9, 1.0])
    min_p = torch.zeros(4)
    seeds = torch.tensor([5, 6, 7, 8], dtype=torch.int64)
    steps = torch.tensor([3, 3, 4, 0], dtype=torch.int64)
    toks = sample(logits, temp, top_k, top_p, min_p, seeds, steps)
    assert toks[0] == logits[0].argmax()
    allowed = filtered_probs(logits, temp, top_k, top_p, min_p) > 0
    assert all(allowed[i, toks[i]] for i in range(1, 4))
    # Same request (row 2) alone, in another batch position: same token.
    perm = torch.tensor([2, 0])
    again = sample(logits[perm], temp[perm], top_k[perm], top_p[perm], min_p[perm], seeds[perm], steps[perm])
    assert again[0] == toks[2]
    assert torch.equal(sample(logits, temp, top_k, top_p, min_p, seeds, steps, all_greedy=True), logits.argmax(-1))


@pytest.mark.gpu
def test_gpu_sample_matches_cpu():
    g = torch.Generator().manual_seed(3)
    b, v = 64, 49152
    logits = torch.randn(b, v, generator=g) * 3
    args = (torch.rand(b, generator=g) + 0.2, torch.randint(0, 100, (b,), generator=g),
            torch.rand(b, generator=g) * 0.5 + 0.5, torch.rand(b, generator=g) * 0.1,
            torch.randint(0, 2**62, (b,), generator=g), torch.randint(0, 4096, (b,), generator=g))
    cpu = sample(logits, *args)
    gpu = sample(logits.cuda(), *(a.cuda() for a in args))
    assert (gpu.cpu() == cpu).float().mean() > 0.97  # float summation order may flip a rare near-tie


def _tie_closed_keep(probs, k, p):
    """One row, float64, from the definitions with ties kept whole: top-k keeps every token >= the k-th largest;
    top-p keeps a token when the mass of strictly more likely tokens is below p of the (top-k) total."""
    vals = sorted(probs, reverse=True)
    kth = vals[min(k, len(vals)) - 1] if k > 0 else 0.0
    kept = [x if x >= kth else 0.0 for x in probs]
    total = sum(kept)
    return [x if x > 0 and sum(y for y in kept if y > x) < p * total else 0.0 for x in kept]


def test_ties_are_kept_whole_and_order_free():
    """bf16-rounded logits tie often; the kept set must not depend on the sort's order among equal values."""
    g = torch.Generator().manual_seed(5)
    b, v = 8, 64
    logits = (torch.randn(b, v, generator=g) * 2).to(torch.bfloat16).float()
    top = logits.max(dim=1, keepdim=True).values
    logits[:, :6] = top + 0.5  # a six-way tie at the top of each row ...
    logits[1::2, 0] = top[1::2, 0] + 1.0  # ... or just below the most likely token on odd rows
    temp = torch.rand(b, generator=g) + 0.5
    top_k = torch.tensor([0, 3, 4, 7, 1, 2, 5, 64])
    top_p = torch.tensor([0.3, 1.0, 0.6, 0.5, 1.0, 0.9, 0.2, 0.95])
    min_p = torch.zeros(b)
    got = filtered_probs(logits, temp, top_k, top_p, min_p, use_min_p=False)
    for i in range(b):
        probs = torch.softmax(logits[i] / temp[i], -1)
        want = torch.tensor(_tie_closed_keep(probs.tolist(), int(top_k[i]), float(top_p[i])))
        assert torch.equal(got[i] > 0, want > 0), f"row {i} kept set differs"
    perm = torch.randperm(v, generator=g)
    again = filtered_probs(logits[:, perm], temp, top_k, top_p, min_p, use_min_p=False)
    assert torch.equal(again > 0, got[:, perm] > 0), "kept set depends on column order"
