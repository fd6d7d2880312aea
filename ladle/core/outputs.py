"""The contracts that cross component boundaries. Plain, picklable Python: no tensors.

Flow inside one engine step (ARCHITECTURE.md):
    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> RunnerOutput -> Scheduler.update()
and from the engine to its clients: EngineOutput (one per request per step that produced something).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ladle.core.sampling_params import SamplingParams

# Under asynchronous scheduling (EngineCore, --async-scheduling) a decode chunk of a request whose previous token is
# still being sampled by the step in flight feeds this id; the runner replaces it on the device by that step's sampled
# token before the forward. Never a real token id (ids are >= 0) and never in Request.all_token_ids.
PLACEHOLDER_TOKEN_ID = -1

# One token's logprob entry: (token_id, logprob, rank) for the sampled/prompt token first,
# then the top-k alternatives in descending order. rank is 1-based in the full vocabulary.
TokenLogprobs = list[tuple[int, float, int]]


@dataclass
class NewRequestData:
    """Sent to the runner the first step a request is scheduled (and again after a preemption).

    `prompt_token_ids`: the original prompt. `output_token_ids`: tokens generated before a preemption
    (recomputed as if prompt; penalties still count them as outputs). The runner keeps per-request state
    (penalty counts, seed) keyed by `request_id` until it appears in `finished_request_ids` or
    `preempted_request_ids`.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class ScheduledChunk:
    """One request's share of a step.

    token_ids:      tokens fed this step, len = num_scheduled_tokens >= 1 (prompt chunk, or the last
                    sampled token for a decode; [PLACEHOLDER_TOKEN_ID] when that token is still in flight, see
                    SchedulerOutput.placeholder_chunks).
    start_position: absolute position of token_ids[0] (== num_computed_tokens before the step).
    block_ids:      the request's whole block table after this step's allocation (physical ids).
    sample:         True when the chunk ends at the request's last known token, so a new token is sampled.
    prompt_logprob_positions: how many logits this chunk needs for prompt logprobs (0 normally). When
                    > 0 the runner computes logits at every fed position whose next token is a prompt token.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool
    prompt_logprob_positions: int = 0


@dataclass
class SchedulerOutput:
    """The only thing the runner receives each step.

    placeholder_chunks: indices into `chunks` of the decode chunks whose one token is PLACEHOLDER_TOKEN_ID: the
    token sampled for that request by the previous step the runner launched, which has not reached the host yet
    (asynchronous scheduling; always empty in synchronous mode).
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    placeholder_chunks: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class RunnerOutput:
    """What the runner returns for one step (plain lists; one device->host copy made it).

    sampled_token_ids: request_id -> the token sampled after its chunk (only chunks with sample=True).
    logprobs:          request_id -> TokenLogprobs of the sampled token (when sampling_params.logprobs is set).
    prompt_logprobs:   request_id -> one TokenLogprobs per prompt position covered by this chunk
                       (the logprob of prompt token i+1 given tokens <= i).
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class RequestRejected(ValueError):
    """A request that can never be served (prompt + max_tokens beyond max_model_len, or more blocks than the
    pool holds). Raised at admission; the server maps it to HTTP 400 with the message as is."""


FINISH_STOP = "stop"        # EOS, stop token id, or stop string
FINISH_LENGTH = "length"    # max_tokens or max_model_len
FINISH_ABORT = "abort"      # client disconnect, shutdown, or explicit abort
FINISH_ERROR = "error"      # the step that ran this request raised


@dataclass
class EngineOutput:
    """One request's progress in one step, engine -> clients (before detokenization).

    new_token_ids:   tokens appended this step (usually one).
    new_logprobs:    one TokenLogprobs per new token, when requested.
    prompt_logprobs: set once, on the first output, when requested (None for the first prompt token).
    finish_reason:   None while running; one of FINISH_* when finished.
    stop_reason:     the stop token id or stop string that finished it, if any.
    num_prompt_tokens, num_cached_tokens: for `usage` (cached = prefix-cache hit tokens).
    queue_time:      seconds from arrival to first scheduling (None until the request was scheduled).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: Optional[list[TokenLogprobs]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    error: Optional[str] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
