"""The runner's per-request state and the per-step SamplingTensors built from it.

State lives from the step a request appears in `SchedulerOutput.new_requests` until its id appears in
`finished_request_ids` or `preempted_request_ids` (a preempted request comes back as a new request with
its outputs so far). The runner appends each sampled token itself when it reaches the host, so penalty counts and
min_tokens see prompt + outputs without the scheduler re-sending them. Under asynchronous scheduling the next step
is built before that: `num_pending_outputs` counts the tokens sampled but not yet appended, so the min_tokens rule
(which needs only the count) stays exact; penalties (which need the values) make the engine run that step
synchronously (Scheduler.async_ineligible_reason).

Host->device copies go through `input_batch.to_device` (pinned memory and a non-blocking copy on CUDA), so building a
step never waits for the step in flight.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from ladle.core.outputs import NewRequestData
from ladle.core.sampling_params import SamplingParams
from ladle.runner.input_batch import to_device
from ladle.runner.sampler import SamplingTensors

_SERIALS = itertools.count()


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    sample_seed: int = 0  # the request's seed (folded to int64), or one drawn by the engine when unseeded
    banned_before_min: list[int] = field(default_factory=list)  # ids masked while outputs < min_tokens
    serial: int = field(default_factory=_SERIALS.__next__)  # unique per state object (keys the runner's caches)
    table_row: int = -1  # this request's row in the runner's persistent host block table (-1: none yet)
    num_table_blocks: int = 0  # block ids already written to that row
    table_last_block: int = -1  # the last of them (a cheap check that the written prefix is still the table's)
    num_pending_outputs: int = 0  # tokens sampled by launched steps, not yet appended (they are on their way)

    @classmethod
    def from_new(cls, new: NewRequestData, eos_token_ids: Sequence[int],
                 unseeded_seed: int = 0) -> "RequestState":
        """`unseeded_seed`: used when sampling_params.seed is None (the runner draws it from its generator)."""
        sp = new.sampling_params
        banned = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(eos_token_ids))
        seed = _fold_seed(sp.seed if sp.seed is not None else unseeded_seed)
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
    return to_device(torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64), device)


@dataclass
class StaticSampling:
    """The part of SamplingTensors that depends only on which requests are in the batch (in order), so the
    runner builds it once per batch composition instead of every step. Device tensors [N]; host flags."""

    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64, 0 = off (SamplingParams' encoding, passed through unchanged)
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    presence_penalty: torch.Tensor  # [N] float32
    frequency_penalty: torch.Tensor  # [N] float32
    repetition_penalty: torch.Tensor  # [N] float32
    seeds: torch.Tensor  # [N] int64
    all_greedy: bool
    has_penalties: bool
    has_top_k: bool
    has_top_p: bool
    has_min_p: bool
    may_ban: bool  # some row has banned ids and min_tokens > 0
    prompt_ids: Optional[torch.Tensor] = None  # [N, Lp] int64 padded with -1, only when has_penalties


def build_static_sampling(states: list[RequestState], vocab_size: int, device: torch.device) -> StaticSampling:
    """Per-row parameters as two packed host arrays, two host->device copies (float32 [6, N], int64 [2, N]),
    plus the padded prompt ids when some row has penalties (a prompt never changes, so they are cached too)."""
    sps = [s.sampling_params for s in states]
    temps = [float(sp.temperature) for sp in sps]
    top_k = [min(sp.top_k, vocab_size) for sp in sps]  # 0 = off (as in SamplingParams); k >= vocab keeps all
    floats = to_device(torch.tensor([temps, [sp.top_p for sp in sps], [sp.min_p for sp in sps],
                                     [sp.presence_penalty for sp in sps], [sp.frequency_penalty for sp in sps],
                                     [sp.repetition_penalty for sp in sps]], dtype=torch.float32), device)
    pad = [0] * (len(states) % 2)  # rows of the int64 pack start 16-byte aligned (seeds go to a Triton kernel)
    ints = to_device(torch.tensor([top_k + pad, [s.sample_seed for s in states] + pad], dtype=torch.int64), device)
    n = len(states)
    has_penalties = any(s.has_penalties for s in states)
    return StaticSampling(
        temperature=floats[0], top_p=floats[1], min_p=floats[2], presence_penalty=floats[3],
        frequency_penalty=floats[4], repetition_penalty=floats[5], top_k=ints[0, :n], seeds=ints[1, :n],
        all_greedy=all(t == 0 for t in temps),
        has_penalties=has_penalties,
        has_top_k=any(0 < k < vocab_size for k in top_k),
        has_top_p=any(sp.top_p < 1 for sp in sps),
        has_min_p=any(sp.min_p > 0 for sp in sps),
        may_ban=any(s.banned_before_min and s.sampling_params.min_tokens > 0 for s in states),
        prompt_ids=_padded([s.prompt_token_ids for s in states], device) if has_penalties else None,
    )


def build_sampling_tensors(states: list[RequestState], positions: Union[list[int], torch.Tensor], vocab_size: int,
                           device: torch.device, static: Optional[StaticSampling] = None) -> SamplingTensors:
    """One row per sampling request. positions[i]: absolute position of the token row i samples (a list, or an
    int64 tensor already on `device`). `static`: `build_static_sampling(states, ...)` when the caller cached it.

    Host-side only (lists -> tensors); the device math lives in the sampler.
    """
    if static is None:
        static = build_static_sampling(states, vocab_size, device)
    banned = None
    if static.may_ban:
        rows = [s.banned_before_min
                if len(s.output_token_ids) + s.num_pending_outputs < s.sampling_params.min_tokens else []
                for s in states]
        banned = _padded(rows, device) if any(rows) else None
    if not isinstance(positions, torch.Tensor):
        positions = to_device(torch.tensor(positions, dtype=torch.int64), device)
    has_pen = static.has_penalties
    return SamplingTensors(
        temperature=static.temperature,
        top_k=static.top_k,
        top_p=static.top_p,
        min_p=static.min_p,
        presence_penalty=static.presence_penalty,
        frequency_penalty=static.frequency_penalty,
        repetition_penalty=static.repetition_penalty,
        seeds=static.seeds,
        positions=positions,
        prompt_ids=static.prompt_ids,
        output_ids=_padded([s.output_token_ids for s in states], device) if has_pen else None,
        banned_ids=banned,
        all_greedy=static.all_greedy,
        has_penalties=has_pen,
        has_top_k=static.has_top_k,
        has_top_p=static.has_top_p,
        has_min_p=static.has_min_p,
    )


def _fold_seed(seed: int) -> int:
    """Any Python int -> a signed int64 (seeds beyond 64 bits are folded by xor of 64-bit words)."""
    s = seed & ((1 << 64) - 1) if seed >= 0 else seed % (1 << 64)
    rest = abs(seed) >> 64
    while rest:
        s ^= rest & ((1 << 64) - 1)
        rest >>= 64
    return s - (1 << 64) if s >= (1 << 63) else s
