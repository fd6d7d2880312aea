"""One generation request as the scheduler sees it: token ids, progress, status, stop checks.

A request is a single sequence (the engine expands `n` into `n` requests). It is engine-owned and mutated
only by the scheduler: `num_computed_tokens` counts the tokens whose K/V are in the cache; the scheduler
feeds `all_token_ids[num_computed_tokens:num_tokens]` (ARCHITECTURE.md: schedule tokens, not phases).
"""

from __future__ import annotations

import enum
import time
from typing import Optional

from ladle.core.outputs import FINISH_LENGTH, FINISH_STOP, TokenLogprobs
from ladle.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # never scheduled yet
    RUNNING = "running"      # holds KV blocks; scheduled every step while the token budget allows
    PREEMPTED = "preempted"  # blocks freed, back in the waiting queue; recomputed when scheduled again
    FINISHED = "finished"    # finish_reason is set; blocks freed


class Request:
    """Prompt and output token ids plus scheduling state.

    Args:
        request_id: engine-unique id (`cmpl-<uuid>` or `cmpl-<uuid>-<i>` for choice i of `n`).
        prompt_token_ids: the prompt, at least one token (the scheduler refuses an empty prompt).
        sampling_params: `max_tokens` must already be filled (never None).
        eos_token_ids: the model's EOS ids (stop generation unless `ignore_eos`).
        arrival_time: `time.monotonic()` seconds; defaults to now.

    Fields the scheduler maintains: `output_token_ids`, `num_computed_tokens`, `num_inflight_tokens` (scheduled in
    steps whose results `Scheduler.update` has not applied yet; 0 between synchronous steps),
    `num_inflight_samples` (how many of those steps sample a token for it: 0 or 1), `num_cached_tokens`
    (prefix-cache hit tokens at its first scheduling), `status`, `finish_reason`, `stop_reason`,
    `first_scheduled_time` (monotonic seconds, set once), `num_preemptions`, `block_hashes` (hash chain of
    its full blocks, filled lazily by the KV cache manager), `prompt_logprobs` (accumulated across prefill
    chunks; one TokenLogprobs per prompt position 1..P-1).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: Optional[float] = None,
    ) -> None:
        assert sampling_params.max_tokens is not None, "the engine fills max_tokens before building a Request"
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_inflight_tokens = 0
        self.num_inflight_samples = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[object] = None
        self.first_scheduled_time: Optional[float] = None
        self.num_preemptions = 0

        self.block_hashes: list[int] = []
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs_sent = False

    # ---- sizes -------------------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known so far (the last one has no K/V yet while running)."""
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. The live list: callers must not mutate it."""
        return self._all_token_ids

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens  # type: ignore[return-value]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def samples_from_outputs(self) -> bool:
        """Its sampling reads the values of its previous outputs (repetition/presence/frequency penalties), so a
        step cannot sample for it before the previous step's token reached the host (asynchronous scheduling)."""
        sp = self.sampling_params
        return sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1

    # ---- mutation (scheduler only) -----------------------------------------------------------------

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """After a token was appended: decide whether the request is done.

        Order (ARCHITECTURE.md / vLLM): EOS (unless ignore_eos) and stop_token_ids, both only once at least
        `min_tokens` outputs exist; then max_tokens; then max_model_len. Sets `finish_reason` (and
        `stop_reason`: the stop token id; None for EOS) and returns True when finished. Does not change
        `status` (the scheduler does, when it frees the blocks).
        """
        params, outputs = self.sampling_params, self.output_token_ids
        num_outputs, last = len(outputs), outputs[-1]
        if num_outputs >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = FINISH_STOP, None
                return True
            if last in params.stop_token_ids:
                self.finish_reason, self.stop_reason = FINISH_STOP, last
                return True
        if num_outputs >= params.max_tokens or len(self._all_token_ids) >= max_model_len:
            self.finish_reason, self.stop_reason = FINISH_LENGTH, None
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"outputs={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
