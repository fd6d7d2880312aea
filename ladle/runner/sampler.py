"""The engine's sampler: one batch of logits rows in, sampled token ids (and logprobs) out.

Order (ARCHITECTURE.md "Sampling and logprobs"): penalties -> temperature -> min_p -> top_k -> top_p, then
sample. This module owns the request-dependent steps — penalties, and banned ids (stop/EOS before min_tokens) — and
the logprob packing; temperature, min_p, top_k, top_p and the seeded draw are the op `ladle.kernels.sampling.sample`
(Triton race on CUDA, its torch reference elsewhere; the only implementation of those steps). Rows with
temperature 0 take the argmax of the penalised logits. Logprobs are the raw model log-softmax (before penalties and
temperature).

No per-request Python loop in the math and no device->host sync: every per-request parameter is a [N]
tensor built on the host (`request_state.build_sampling_tensors`). Randomness is counter-based: every row
has a 64-bit seed (the request's `seed`, or for unseeded requests one drawn from the engine's generator when
the runner first sees the request) and the draw hashes (seed, position, vocab index), so a seeded request
samples the same tokens at the same positions whatever the batch, on CPU and GPU, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
import random
from typing import Optional

import torch

from ladle.kernels.sampling import sample as sample_op


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one step, already on the sampler's device. N = rows.

    temperature [N] float32 (0 = greedy); top_k [N] int64 (0 = off: the one encoding, as in SamplingParams and
    ladle.kernels.sampling); top_p [N] float32 (1 = off); min_p [N] float32 (0 = off);
    presence/frequency/repetition [N] float32;
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


class Sampler:
    """Samples one token per row. Its only state is the host generator that seeds unseeded requests.

    `use_triton`: the backend asked for the draw (None: Triton on CUDA, the torch reference elsewhere — the Triton
    interpreter that CPU test runs switch on is far too slow for whole models); the op records its dispatch."""

    def __init__(self, device: torch.device, seed: int = 0, use_triton: Optional[bool] = None) -> None:
        self.device = torch.device(device)
        self._host_rng = random.Random(seed)
        self.use_triton = self.device.type == "cuda" if use_triton is None else use_triton

    def draw_seed(self) -> int:
        """A fresh seed for an unseeded request (from the engine's generator, seeded by --seed)."""
        return self._host_rng.getrandbits(63)

    def process_logits(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """The request-dependent steps: penalties, then banned ids. logits [N, V] (raw model logits) -> [N, V]
        float32, the logits `ladle.kernels.sampling.sample` takes (temperature and filters are the op's)."""
        logits = logits.to(torch.float32)
        if t.has_penalties:
            logits = apply_penalties(logits, t)
        if t.banned_ids is not None:
            logits = _ban(logits, t.banned_ids)
        return logits

    def sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """logits [N, V] (raw model logits) -> sampled token ids [N] int64 (on device)."""
        return sample_op(self.process_logits(logits, t), t.temperature, t.top_k, t.top_p, t.min_p, t.seeds,
                         t.positions, all_greedy=t.all_greedy, use_top_k=t.has_top_k, use_top_p=t.has_top_p,
                         use_min_p=t.has_min_p, use_triton=self.use_triton)


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
