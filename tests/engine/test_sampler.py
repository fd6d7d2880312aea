"""Sampler against a float64 per-row reference written from the definitions (vLLM / OpenAI semantics)."""

from __future__ import annotations

import math

import pytest
import torch

from ladle.core.outputs import NewRequestData
from ladle.core.sampling_params import SamplingParams
from ladle.runner.request_state import RequestState, build_sampling_tensors
from ladle.runner.sampler import Sampler, compute_logprobs, unpack_logprobs

V = 50


_SEEDS = iter(range(1000, 10**6))


def _state(rid, sp, prompt=(1, 2, 3), outputs=()):
    """Like the runner: the request's seed, or a fresh one for unseeded requests."""
    return RequestState.from_new(NewRequestData(rid, list(prompt), list(outputs), sp), (), next(_SEEDS))


def ref_processed(logits_row, sp, prompt, outputs):
    """float64, one row, plain Python loops: penalties -> temperature -> min_p -> top_k -> top_p.
    Returns the list of kept token ids (set) and the processed logits."""
    x = [float(v) for v in logits_row]
    counts = {t: outputs.count(t) for t in set(outputs)}
    seen = set(prompt) | set(outputs)
    for t in range(len(x)):
        if t in seen:
            x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
        c = counts.get(t, 0)
        x[t] -= sp.frequency_penalty * c + sp.presence_penalty * (1 if c else 0)
    if sp.temperature == 0:
        return {max(range(len(x)), key=lambda i: x[i])}, x
    x = [v / sp.temperature for v in x]
    keep = set(range(len(x)))
    m = max(x)
    z = sum(math.exp(v - m) for v in x)
    p = [math.exp(v - m) / z for v in x]
    if sp.min_p > 0:
        keep = {i for i in keep if p[i] >= sp.min_p * max(p)}
    if sp.top_k > 0:
        kth = sorted((x[i] for i in keep), reverse=True)[min(sp.top_k, len(keep)) - 1]
        keep = {i for i in keep if x[i] >= kth}
    if sp.top_p < 1:
        zz = sum(math.exp(x[i] - m) for i in keep)
        order = sorted(keep, key=lambda i: x[i], reverse=True)
        kept, mass = set(), 0.0
        for i in order:
            kept.add(i)
            mass += math.exp(x[i] - m) / zz
            if mass >= sp.top_p - 1e-6:
                break
        keep = kept
    return keep, x


def _support(sampler, logits, states, trials=400):
    """Set of token ids the sampler ever picks per row over `trials` draws (unseeded rows)."""
    seen = [set() for _ in states]
    for trial in range(trials):
        t = build_sampling_tensors(states, [trial] * len(states), V, torch.device("cpu"))
        ids = sampler.sample(logits, t).tolist()
        for r, i in enumerate(ids):
            seen[r].add(i)
    return seen


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05),
])
def test_masks_match_reference_support(sp):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen, dtype=torch.float64).float() * 2
    states = [_state(f"r{i}", sp) for i in range(3)]
    got = _support(Sampler(torch.device("cpu"), seed=0), logits, states)
    for r in range(3):
        keep, _ = ref_processed(logits[r].tolist(), sp, [1, 2, 3], [])
        assert got[r] <= keep, f"row {r} sampled outside the allowed set"
        # every kept token with reasonable probability was seen
        assert len(got[r]) >= min(len(keep), 2)


def test_penalties_match_reference_greedy_and_processed():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, V, generator=gen, dtype=torch.float64).float() * 3
    sps = [SamplingParams(temperature=0, repetition_penalty=1.8),
           SamplingParams(temperature=0, presence_penalty=1.5),
           SamplingParams(temperature=0, frequency_penalty=0.7),
           SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=1.1)]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 7, 8]]
    outputs = [[9, 9, 1], [4, 10, 10, 10], [6, 6, 11], [7, 12, 12]]
    states = [_state(f"r{i}", sp, p, o) for i, (sp, p, o) in enumerate(zip(sps, prompts, outputs))]
    t = build_sampling_tensors(states, [20] * 4, V, torch.device("cpu"))
    sampler = Sampler(torch.device("cpu"))
    processed = sampler.process_logits(logits, t)
    for r in range(4):
        keep, ref = ref_processed(logits[r].tolist(), sps[r], prompts[r], outputs[r])
        torch.testing.assert_close(processed[r].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    ids = sampler.sample(logits, t).tolist()
    for r in range(4):
        keep, _ = ref_processed(logits[r].tolist(), sps[r], prompts[r], outputs[r])
        assert ids[r] in keep


def test_sampling_distribution_matches_softmax():
    """Exponential-race sampling: empirical frequencies within 4 sigma of softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0] + [-30.0] * (V - 5)])
    sp = SamplingParams(temperature=0.8)
    n = 4000
    rows = logits.repeat(n, 1)
    states = [_state(f"r{i}", sp) for i in range(n)]
    t = build_sampling_tensors(states, list(range(n)), V, torch.device("cpu"))
    ids = Sampler(torch.device("cpu"), seed=3).sample(rows, t)
    probs = torch.softmax(logits.double()[0] / 0.8, dim=-1)
    for tok in range(5):
        freq = (ids == tok).double().mean().item()
        sigma = math.sqrt(probs[tok].item() * (1 - probs[tok].item()) / n)
        assert abs(freq - probs[tok].item()) < 4 * sigma + 1e-3, (tok, freq, probs[tok].item())


def test_seeded_rows_repeat_and_differ_by_seed():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(1, V, generator=gen).repeat(4, 1)
    sps = [SamplingParams(temperature=1.0, seed=s) for s in (7, 7, 8, 9)]
    states = [_state(f"r{i}", sp) for i, sp in enumerate(sps)]
    draws = []
    for trial in range(2):
        sampler = Sampler(torch.device("cpu"), seed=100 + trial)  # engine generator differs: must not matter
        seq = []
        for pos in range(40):
            t = build_sampling_tensors(states, [pos] * 4, V, torch.device("cpu"))
            seq.append(sampler.sample(logits, t).tolist())
        draws.append(seq)
    assert draws[0] == draws[1], "seeded sampling is not repeatable"
    col = lambda r: [step[r] for step in draws[0]]  # noqa: E731
    assert col(0) == col(1)
    assert col(0) != col(2) and col(2) != col(3), "different seeds gave identical sequences"


def test_seeded_row_ignores_batch_composition():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, V, generator=gen)
    sp = SamplingParams(temperature=1.0, seed=42)
    alone = _state("a", sp)
    others = [_state("b", SamplingParams(temperature=0.5)), _state("c", SamplingParams(temperature=1.0, seed=1))]
    sampler = Sampler(torch.device("cpu"))
    for pos in range(20):
        t1 = build_sampling_tensors([alone], [pos], V, torch.device("cpu"))
        t3 = build_sampling_tensors([others[0], alone, others[1]], [pos] * 3, V, torch.device("cpu"))
        one = sampler.sample(logits[1:2], t1).item()
        three = sampler.sample(logits, t3).tolist()
        assert three[1] == one


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, 5] = 10.0
    logits[0, 6] = 9.0
    sp = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6])
    state = RequestState.from_new(NewRequestData("a", [1], [], sp), eos_token_ids=[5])
    t = build_sampling_tensors([state], [1], V, torch.device("cpu"))
    ids = Sampler(torch.device("cpu")).sample(logits, t).tolist()
    assert ids[0] not in (5, 6)
    state.output_token_ids += [1, 1]
    t = build_sampling_tensors([state], [3], V, torch.device("cpu"))
    assert Sampler(torch.device("cpu")).sample(logits, t).tolist() == [5]


def test_logprobs_are_raw_log_softmax_with_rank():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, V, generator=gen)
    chosen = torch.tensor([3, 17])
    packed = compute_logprobs(logits, chosen, 4).tolist()
    ref = torch.log_softmax(logits.double(), dim=-1)
    for r in range(2):
        entries = unpack_logprobs(packed[r], 4)
        tok, lp, rank = entries[0]
        assert tok == chosen[r].item()
        assert abs(lp - ref[r, tok].item()) < 1e-5
        assert rank == 1 + int((ref[r] > ref[r, tok]).sum())
        top = torch.topk(ref[r], 4)
        assert [e[0] for e in entries[1:]] == top.indices.tolist()
        assert [e[2] for e in entries[1:]] == [1, 2, 3, 4]
        for e, v in zip(entries[1:], top.values.tolist()):
            assert abs(e[1] - v) < 1e-5


def test_top_k_off_is_zero_from_params_to_tensors():
    """One encoding: -1 and 0 at the edge both become 0 in SamplingParams and in SamplingTensors.top_k."""
    assert SamplingParams().top_k == 0
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=0).top_k == 0
    with pytest.raises(ValueError):
        SamplingParams(top_k=-2)
    sps = [SamplingParams(top_k=-1), SamplingParams(top_k=0), SamplingParams(top_k=V + 9)]
    t = build_sampling_tensors([_state(f"r{i}", sp) for i, sp in enumerate(sps)], [4] * 3, V, torch.device("cpu"))
    assert t.top_k.tolist() == [0, 0, V] and not t.has_top_k
    t = build_sampling_tensors([_state("k", SamplingParams(top_k=7))], [4], V, torch.device("cpu"))
    assert t.top_k.tolist() == [7] and t.has_top_k


@pytest.mark.parametrize("field,value", [("seed", 2**63), ("seed", -(2**63) - 1), ("seed", 10**23), ("top_k", 2**70),
                                         ("min_tokens", 2**64), ("max_tokens", 2**63), ("n", 2**80)])
def test_integers_outside_int64_are_refused(field, value):
    """Every integer crosses the engine-core process boundary as a 64-bit integer: a wider one is a ValueError (a
    400 at the server) naming the field, in both engine layouts; the edges of the range are accepted."""
    with pytest.raises(ValueError, match=f"^{field} must fit in a signed 64-bit integer"):
        SamplingParams(**{field: value})
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)
    with pytest.raises(ValueError, match="^stop_token_ids must fit"):
        SamplingParams(stop_token_ids=[5, 2**64])


def test_triton_draw_equals_reference_draw():
    """The Sampler's two backends (the Triton race, interpreted on CPU, and its torch reference) hash alike."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, V, generator=gen) * 2
    sps = [SamplingParams(temperature=0.9, top_k=9, seed=11), SamplingParams(temperature=1.2, top_p=0.7),
           SamplingParams(temperature=0), SamplingParams(temperature=0.6, min_p=0.1, repetition_penalty=1.4),
           SamplingParams(temperature=1.0, seed=2**63 - 5)]
    states = [_state(f"r{i}", sp, outputs=(4, 4, 9)) for i, sp in enumerate(sps)]
    for pos in range(6):
        t = build_sampling_tensors(states, [pos + 3] * 5, V, torch.device("cpu"))
        ref = Sampler(torch.device("cpu")).sample(logits, t)
        tri = Sampler(torch.device("cpu"), use_triton=True).sample(logits, t)
        assert torch.equal(tri, ref)


def test_tiny_temperatures_are_raised_to_the_floor_for_every_caller():
    """Below 0.01 the logits / temperature division overflows float32; the floor lives in SamplingParams, so the
    offline LLM API gets it as the HTTP edge does (vLLM's floor, vllm/sampling_params.py `_MAX_TEMP`)."""
    from ladle.core.sampling_params import SamplingParams

    assert SamplingParams(temperature=1e-5).temperature == 0.01
    assert SamplingParams(temperature=0.0).temperature == 0.0 and SamplingParams(temperature=0.5).temperature == 0.5
