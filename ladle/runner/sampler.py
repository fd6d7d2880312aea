"""Vectorised sampler: one batch of logits rows in, sampled token ids (and logprobs) out.

Order (ARCHITECTURE.md "Sampling and logprobs"): penalties -> temperature -> min_p -> top_k -> top_p, then
sample. Rows with temperature 0 take the argmax of the penalised logits. Logprobs are the raw model
log-softmax (before penalties and temperature).

No per-request Python loop in the math and no device->host sync: every per-request parameter is a [N]
tensor built on the host (`request_state.build_sampling_tensors`). Randomness is counter-based: every row
has a 64-bit seed (the request's `seed`, or for unseeded requests one drawn from the engine's generator when
the runner first sees the request) and the draw hashes (seed, position, vocab index), so a seeded request
samples the same tokens at the same positions whatever the batch, and after a preemption.

The draw is `ladle.kernels.sampling.race` (Triton on CUDA; its torch twin `race_ref` on CPU): the exponential-race
form of the Gumbel-max trick, argmax_i p_i / q_i with q_i ~ Exp(1) from the hashed uniforms, which picks i
with probability p_i (Efraimidis & Spirakis 2006).
"""

from __future__ import annotations

from dataclasses import dataclass
import random
from typing import Optional

import torch

try:  # Triton ships with CUDA torch and in CI; a triton-less install (e.g. macOS) uses the local twin below
    from ladle.kernels.sampling import race, race_ref
except ImportError:  # pragma: no cover - exercised only without triton
    race = race_ref = None

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons; constants 0x7feb352d, 0x846ca68b) on int64 tensors holding uint32 values. Products
    may wrap past 2^63; their low 32 bits stay exact and are masked after every multiply."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _race_fallback(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Used only when ladle.kernels.sampling (Triton) cannot be imported: the same exponential race with a
    counter-based hash of (seed, position, index); deterministic, but not bit-equal to the kernel's hash."""
    key = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) + 0x9E3779B9))
    key = _mix32(key ^ _mix32((positions & _MASK32) + 0x85EBCA6B))
    idx = torch.arange(probs.shape[1], device=probs.device, dtype=torch.int64)
    h = _mix32(_mix32(key[:, None] ^ _mix32(idx[None, :] * 2 + 1)) + key[:, None])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return (probs / -torch.log(u)).argmax(dim=-1)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one step, already on the sampler's device. N = rows.

    temperature [N] float32 (0 = greedy); top_k [N] int64 (vocab_size = off); top_p [N] float32;
    min_p [N] float32; presence/frequency/repetition [N] float32;
    seeds [N] int64 (every row has one); positions [N] int64 (absolute position of the token being sampled);
    prompt_ids [N, Lp] int64 and output_ids [N, Lo] int64, padded with -1 (only when has_penalties);
    banned_ids [N, Lb] int64 padded with -1: tokens masked to -inf (stop/EOS ids before min_tokens), or None.
    Host flags (Python bools) let whole stages be skipped without looking at device data.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    prompt_ids: Optional[torch.Tensor]
    output_ids: Optional[torch.Tensor]
    banned_ids: Optional[torch.Tensor]
    all_greedy: bool
    has_penalties: bool
    has_top_k: bool
    has_top_p: bool
    has_min_p: bool


def _token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids [N, L] int64 padded with -1 -> counts [N, V] int32 (occurrences of each token per row)."""
    n = ids.shape[0]
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.int32, device=ids.device)
    safe = torch.where(ids < 0, vocab_size, ids)  # padding lands in a spare column
    counts.scatter_add_(1, safe, torch.ones_like(safe, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """vLLM semantics. logits [N, V] float32 -> new tensor.

    repetition (CTRL paper, arXiv:1909.05858): for tokens seen in prompt or output, positive logits are
    divided by the penalty and negative ones multiplied. frequency: logit -= f * count(output);
    presence: logit -= p * [count(output) > 0] (OpenAI API definition; outputs only).
    """
    vocab = logits.shape[1]
    out_counts = _token_counts(t.output_ids, vocab)
    seen = (_token_counts(t.prompt_ids, vocab) > 0) | (out_counts > 0)
    rep = t.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - t.frequency_penalty[:, None] * out_counts.to(logits.dtype)
    logits = logits - t.presence_penalty[:, None] * (out_counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p * max probability. min_p [N] float32."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """One ascending sort serves both masks. top_k [N] int64 (>= V disables), top_p [N] float32 (1 disables).

    top_k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept).
    top_p keeps the smallest set of most likely tokens whose probability mass reaches top_p (always at
    least the most likely token), computed after top_k as in vLLM.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if top_k is not None:
        k = top_k.clamp(1, vocab)
        kth = sorted_logits.gather(1, (vocab - k)[:, None])  # [N, 1] k-th largest value
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1.0 - top_p[:, None])
        drop[:, -1] = False  # the most likely token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    """Samples one token per row. Its only state is the host generator that seeds unseeded requests."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = torch.device(device)
        self._host_rng = random.Random(seed)

    def draw_seed(self) -> int:
        """A fresh seed for an unseeded request (from the engine's generator, seeded by --seed)."""
        return self._host_rng.getrandbits(63)

    def process_logits(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Penalties, banned ids, temperature, min_p, top_k, top_p. logits [N, V] float32 -> [N, V] float32
        ready for sampling (rows with temperature 0 are divided by 1)."""
        logits = logits.to(torch.float32)
        if t.has_penalties:
            logits = apply_penalties(logits, t)
        if t.banned_ids is not None:
            logits = _ban(logits, t.banned_ids)
        if t.all_greedy:
            return logits
        temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
        logits = logits / temp[:, None]
        if t.has_min_p:
            logits = apply_min_p(logits, t.min_p)
        if t.has_top_k or t.has_top_p:
            logits = apply_top_k_top_p(logits, t.top_k if t.has_top_k else None,
                                       t.top_p if t.has_top_p else None)
        return logits

    def sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """logits [N, V] float32 (raw model logits) -> sampled token ids [N] int64 (on device)."""
        processed = self.process_logits(logits, t)
        greedy_ids = processed.argmax(dim=-1)
        if t.all_greedy:
            return greedy_ids
        probs = processed.softmax(dim=-1).contiguous()
        # CPU: the torch twin directly (the Triton interpreter, which CPU test runs switch on, is far too slow)
        draw = (race if probs.is_cuda else race_ref) or _race_fallback
        random_ids = draw(probs, t.seeds, t.positions)
        return torch.where(t.temperature > 0, random_ids, greedy_ids)


def _ban(logits: torch.Tensor, banned_ids: torch.Tensor) -> torch.Tensor:
    """Set logits of banned ids [N, Lb] (-1 padded) to -inf."""
    vocab = logits.shape[1]
    mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    safe = torch.where(banned_ids < 0, vocab, banned_ids)
    mask.scatter_(1, safe, True)
    return logits.masked_fill(mask[:, :vocab], float("-inf"))


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> torch.Tensor:
    """Raw log-softmax logprobs of chosen tokens plus the top alternatives, packed for one host copy.

    logits [N, V] (raw), token_ids [N] int64, num_top >= 0 -> [N, 3 + 2 * num_top] float32:
    column 0 the token id, 1 its logprob, 2 its 1-based rank (1 + number of tokens with a strictly higher
    logprob), then num_top (id, logprob) pairs in descending order. Token ids and ranks are exact in float32
    below 2^24.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
    cols = [token_ids[:, None].to(torch.float32), chosen, rank.to(torch.float32)]
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(num_top, dim=-1)
        pairs = torch.stack([top_ids.to(torch.float32), top_vals], dim=-1).flatten(1)  # [N, 2k]
        cols.append(pairs)
    return torch.cat(cols, dim=1)


def unpack_logprobs(row: list[float], num_top: int) -> list[tuple[int, float, int]]:
    """One row of `compute_logprobs` (as a Python list) -> TokenLogprobs: (id, logprob, rank) for the chosen
    token, then the first `num_top` alternatives with ranks 1..num_top."""
    entries = [(int(row[0]), float(row[1]), int(row[2]))]
    for j in range(num_top):
        entries.append((int(row[3 + 2 * j]), float(row[4 + 2 * j]), j + 1))
    return entries
