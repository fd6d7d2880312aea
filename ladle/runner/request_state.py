"""The runner's per-request state and the per-step SamplingTensors built from it.

State lives from the step a request appears in `SchedulerOutput.new_requests` until its id appears in
`finished_request_ids` or `preempted_request_ids` (a preempted request comes back as a new request with
its outputs so far). The runner appends each sampled token itself, so penalty counts and min_tokens see
prompt + outputs without the scheduler re-sending them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ladle.core.outputs import NewRequestData
from ladle.core.sampling_params import SamplingParams
from ladle.runner.sampler import SamplingTensors


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    sample_seed: int = 0  # the request's seed (folded to int64), or one drawn by the engine when unseeded
    banned_before_min: list[int] = field(default_factory=list)  # ids masked while outputs < min_tokens

    @classmethod
    def from_new(cls, new: NewRequestData, eos_token_ids: Sequence[int],
                 unseeded_seed: int = 0) -> "RequestState":
        """`unseeded_seed`: used when sampling_params.seed is None (the runner draws it from its generator)."""
        sp = new.sampling_params
        banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))
        seed = _fold_seed(sp.seed) if sp.seed is not None else _fold_seed(unseeded_seed)
        return cls(new.request_id, list(new.prompt_token_ids), list(new.output_token_ids), sp, seed,
                   sorted(set(banned)))

    def token_at(self, position: int) -> int:
        """The token at absolute `position` of prompt + outputs."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def has_penalties(self) -> bool:
        sp = self.sampling_params
        return sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Ragged int lists -> [N, max(len, 1)] int64 padded with -1."""
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64).to(device)


def build_sampling_tensors(states: list[RequestState], positions: list[int], vocab_size: int,
                           device: torch.device) -> SamplingTensors:
    """One row per sampling request. positions[i]: absolute position of the token row i samples.

    Host-side only (lists -> tensors); the device math lives in the sampler.
    """
    sps = [s.sampling_params for s in states]
    temps = [float(sp.temperature) for sp in sps]
    top_k = [vocab_size if sp.top_k is None or sp.top_k < 1 else min(sp.top_k, vocab_size) for sp in sps]
    has_pen = any(s.has_penalties for s in states)
    banned = [s.banned_before_min if len(s.output_token_ids) < s.sampling_params.min_tokens else []
              for s in states]

    def f32(values):
        return torch.tensor(values, dtype=torch.float32).to(device)

    def i64(values):
        return torch.tensor(values, dtype=torch.int64).to(device)

    return SamplingTensors(
        temperature=f32(temps),
        top_k=i64(top_k),
        top_p=f32([sp.top_p for sp in sps]),
        min_p=f32([sp.min_p for sp in sps]),
        presence_penalty=f32([sp.presence_penalty for sp in sps]),
        frequency_penalty=f32([sp.frequency_penalty for sp in sps]),
        repetition_penalty=f32([sp.repetition_penalty for sp in sps]),
        seeds=i64([s.sample_seed for s in states]),
        positions=i64(positions),
        prompt_ids=_padded([s.prompt_token_ids for s in states], device) if has_pen else None,
        output_ids=_padded([s.output_token_ids for s in states], device) if has_pen else None,
        banned_ids=_padded(banned, device) if any(banned) else None,
        all_greedy=all(t == 0 for t in temps),
        has_penalties=has_pen,
        has_top_k=any(k < vocab_size for k in top_k),
        has_top_p=any(sp.top_p < 1 for sp in sps),
        has_min_p=any(sp.min_p > 0 for sp in sps),
    )


def _fold_seed(seed: int | None) -> int:
    """Any Python int -> a signed int64 (seeds beyond 64 bits are folded by xor of 64-bit words)."""
    if seed is None:
        return 0
    s = seed & ((1 << 64) - 1) if seed >= 0 else seed % (1 << 64)
    rest = abs(seed) >> 64
    while rest:
        s ^= rest & ((1 << 64) - 1)
        rest >>= 64
    return s - (1 << 64) if s >= (1 << 63) else s
