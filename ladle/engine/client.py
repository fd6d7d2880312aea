"""The engine's interface to its clients (the HTTP server, benchmarks).

`EngineClient` is what `ladle/server` talks to. The engine core runs behind it in its own process
(ladle/engine/core_client.py, `ladle serve`'s default) or on a thread of the server (ladle/engine/async_engine.py,
`--no-engine-core-process`); ARCHITECTURE.md "Processes". Every method here is safe to call from the asyncio loop.
Outputs are already detokenized (UTF-8 safe, stop strings enforced).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Union

from ladle.core.outputs import TokenLogprobs
from ladle.core.sampling_params import SamplingParams
from ladle.engine.logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One choice (of `n`) of a request, as of this output.

    *_delta: what this output added (for streaming). text / token_ids / logprobs: cumulative, filled only on
    the output that finishes the choice (empty before, so a long stream costs O(n), not O(n^2)).
    logprobs / logprobs_delta: one TokenLogprobs per token from an EngineClient (what the server formats);
    `LLM.generate` returns vLLM's form instead, one dict token id -> Logprob per token (engine/logprobs.py).
    finish_reason: None while running; "stop", "length", "abort" or "error".
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs: Optional[Union[list[TokenLogprobs], SampleLogprobs]] = None
    logprobs_delta: Optional[Union[list[TokenLogprobs], SampleLogprobs]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step. `outputs` holds the choices that changed in this output
    (streaming) — `generate` yields until every choice has finished.

    request_id: the internal id (`cmpl-<uuid>`); prompt_logprobs: one entry per prompt token (None first), a
    TokenLogprobs from an EngineClient, a dict token id -> Logprob from `LLM.generate` (as CompletionOutput.logprobs).
    num_cached_tokens: prompt tokens served from the prefix cache (summed over choices' first one).
    prompt: the prompt text given to `LLM.generate` (None for a token-id prompt, and from an EngineClient), as vLLM.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[Union[list[Optional[TokenLogprobs]], PromptLogprobs]] = None
    queue_time: Optional[float] = None  # seconds from arrival to first scheduled (set once known)
    prompt: Optional[str] = None


@dataclass
class EngineStats:
    """A snapshot for `/metrics` (vLLM metric meanings). Counters are totals since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks in use, 0..1
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0  # tokens delivered in choices (OutputProcessor.num_generation_tokens)
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up
    prefix_cache_hits_total: int = 0  # of those, tokens hit
    request_success_total: dict = field(default_factory=dict)  # finish_reason -> count
    iteration_tokens_counts: tuple = ()  # steps per bucket of core.scheduler.ITERATION_TOKEN_BUCKETS (+ one above)
    iteration_tokens_sum: int = 0  # tokens of those steps
    num_steps: int = 0  # engine steps that ran the model
    # host seconds per step phase since start: schedule, execute, wait, update (EngineCore.step_host_s) and
    # process_outputs (detokenization + stop strings, OutputProcessor.process, on the engine's client side)
    step_host_seconds: dict = field(default_factory=dict)


class EngineError(RuntimeError):
    """The engine failed a request (its step raised) or the engine loop is dead."""


# Defined in core (the scheduler raises it at admission); re-exported here for the server.
from ladle.core.outputs import RequestRejected  # noqa: E402


class EngineClient(abc.ABC):
    """Async facade over the engine thread.

    Attributes every implementation sets: `tokenizer` (a transformers tokenizer with the chat template),
    `engine_config` (the resolved EngineConfig: max_model_len, block size and dtype filled in),
    `max_model_len` (int), `model_name` (served model name).
    """

    tokenizer: object
    engine_config: object
    max_model_len: int
    model_name: str

    @abc.abstractmethod
    def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: Optional[str] = None,
        stream_interval: int = 1,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; yield its outputs until finished.

        stream_interval: tokens per yielded output of a choice (`--stream-interval`): a choice's first output and
        its finishing one come at once, the others once that many tokens arrived (output_stream.RequestOutputStream,
        which every implementation feeds); 1 wakes the consumer on every step (a lagging one gets the steps merged).

        Raises RequestRejected (before the first yield) when the request can never fit, EngineError when the
        engine is dead. Cancelling the iterator (client disconnect) aborts every choice and frees its blocks
        at the next step boundary.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a request (all its choices); idempotent."""

    @abc.abstractmethod
    def is_healthy(self) -> bool:
        """False once the engine loop has died."""

    @abc.abstractmethod
    def get_stats(self) -> EngineStats:
        """Current counters for /metrics."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort everything and stop the engine thread."""
