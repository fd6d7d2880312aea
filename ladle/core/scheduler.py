"""Continuous batching: which tokens of which requests run in the next step.

One loop over requests, not phases (ARCHITECTURE.md): each scheduled request feeds
`all_token_ids[num_computed_tokens : num_computed_tokens + n]`, where n is capped by the token budget, so a
long prompt is split into chunks across steps (chunked prefill), a prefix hit starts at the hit length, and
a decode is the n == 1 case. Per step:

 1. running requests in order (oldest first), each taking what is left of the budget; when the block pool
    cannot hold a request's new tokens, the newest running request is preempted (blocks freed, progress
    reset, back to the front of the waiting queue; recomputed later, its outputs kept) until it fits;
 2. then, if nothing was preempted, waiting requests first-come-first-served while the budget,
    `max_num_seqs` and the pool allow (the queue head blocks the rest: no overtaking).

`update` applies the runner's sampled tokens, runs the stop checks, registers full blocks in the prefix
cache and frees finished requests' blocks in the same step. Never imports torch.

Asynchronous scheduling (EngineCore with --async-scheduling): `schedule` may run while the previous step is still in
flight (scheduled, not yet applied by `update`). A request's progress then counts its in-flight tokens
(`Request.num_inflight_tokens`); a request whose in-flight step samples a token gets a decode chunk of one
PLACEHOLDER_TOKEN_ID (listed in `SchedulerOutput.placeholder_chunks`; the runner fills it on the device), unless
max_tokens or max_model_len already ends the request with that token. A request preempted while its token is in
flight still gets that token appended by `update` (kept, and recomputed as a prompt token on resume, as in
synchronous mode). Between synchronous steps nothing is in flight and all of this reduces to the plain loop.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Optional

from ladle.config import SchedulerConfig
from ladle.core.kv_cache_manager import KVCacheManager
from ladle.core.outputs import (
    FINISH_ERROR,
    FINISH_LENGTH,
    PLACEHOLDER_TOKEN_ID,
    EngineOutput,
    NewRequestData,
    RequestRejected,
    RunnerOutput,
    ScheduledChunk,
    SchedulerOutput,
)
from ladle.core.request import Request, RequestStatus


# Upper edges (tokens) of the per-step token histogram: vLLM's `vllm:iteration_tokens_total` buckets in eager mode
# (vllm/v1/metrics/loggers.py, build_cudagraph_buckets), with 16384 added for large --max-num-batched-tokens.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class SchedulerStats:
    """Snapshot for /metrics (vLLM meanings). Counters are totals since start; token counts in tokens.

    kv_cache_usage: fraction of usable blocks referenced by requests (cached-but-free blocks count as free).
    prompt_tokens_total: prompt tokens of requests at their first scheduling (cached ones included).
    prefix_cache_queries_total / hits_total: prompt tokens looked up in / served from the prefix cache.
    iteration_tokens_counts: per bucket of ITERATION_TOKEN_BUCKETS (then one for larger), the number of steps that
    scheduled that many tokens (at most the bucket's edge, more than the previous one); steps with none are not
    counted. iteration_tokens_sum: their tokens. /metrics exports them as vLLM's `vllm:iteration_tokens_total`.
    Generation tokens are not counted here but where choices receive them (OutputProcessor.num_generation_tokens):
    a token sampled for a request whose stop string was already found, or that was aborted, reaches no client.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prompt_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    iteration_tokens_counts: tuple = (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
    iteration_tokens_sum: int = 0


class Scheduler:
    """Token-budget scheduler with chunked prefill, preemption by recompute and prefix caching.

    Args:
        config: max_num_seqs and max_num_batched_tokens per step.
        block_size, num_blocks: KV pool geometry; num_blocks includes the null block 0.
        max_model_len: the context limit; prompt + max_tokens above it is refused at admission.
        enable_prefix_caching: automatic prefix caching.
    Not thread-safe: the engine thread is its only caller.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be positive: {config}")
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(block_size, num_blocks, enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in scheduling order: the last one is preempted first
        self._finished_ids: list[str] = []  # finished since the last schedule, runner holds their state
        self._sync_candidates: dict[str, None] = {}  # unfinished requests with penalties or prompt logprobs, in order
        self._stats = SchedulerStats()

    # ---- admission ---------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises RequestRejected (message gives the limit and the counts) when it can
        never run: empty prompt, prompt + max_tokens > max_model_len, or more blocks than the pool has.
        Raises ValueError for a duplicate request_id (an engine bug, not user input)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        num_prompt, max_tokens = request.num_prompt_tokens, request.max_tokens
        if num_prompt == 0:
            raise RequestRejected("The prompt is empty; at least one token is required.")
        if num_prompt + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the "
                f"completion). Please reduce the prompt or max_tokens."
            )
        # K/V is computed for every token except the last sampled one.
        num_kv_tokens = num_prompt + max(max_tokens - 1, 0)
        num_blocks = self.kv_cache_manager.num_blocks_for(num_kv_tokens)
        usable = self.kv_cache_manager.num_usable_blocks
        if num_blocks > usable:
            raise RequestRejected(
                f"The request needs up to {num_kv_tokens} tokens of KV cache ({num_prompt} in the prompt, "
                f"{max_tokens} in the completion) = {num_blocks} blocks of {self.block_size} tokens, but the "
                f"KV cache holds only {usable} blocks ({usable * self.block_size} tokens). Please reduce the "
                f"prompt or max_tokens."
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.samples_from_outputs or request.wants_prompt_logprobs:
            self._sync_candidates[request.request_id] = None

    # ---- schedule ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's chunks (see the module docstring). Mutates queues, block tables and
        request status; `num_computed_tokens` advances only in `update`."""
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(self._num_unscheduled(request), budget)
            if num_new <= 0:  # all it has is in flight, or the in-flight token ends it
                i += 1
                continue
            if not self._allocate_or_preempt(request, num_new, out):
                break  # the request preempted itself: it was the last running one
            self._add_chunk(out, request, num_new)
            budget -= num_new
            i += 1
        if not out.preempted_request_ids:
            budget = self._schedule_waiting(budget, out)
        if out.chunks:  # every chunk took its tokens from the budget (no second pass over the chunks)
            self._count_iteration(self.config.max_num_batched_tokens - budget)
        return out

    def _num_unscheduled(self, request: Request) -> int:
        """Tokens of a running request not yet scheduled: known tokens plus the one its in-flight step samples,
        minus computed and in-flight ones. 0 when the in-flight token reaches max_tokens or max_model_len (the
        request finishes at that step's update, so no placeholder is scheduled for it)."""
        end = request.num_tokens + request.num_inflight_samples
        if request.num_inflight_samples and (
                request.num_output_tokens + request.num_inflight_samples >= request.max_tokens
                or end >= self.max_model_len):
            return 0
        return end - request.num_computed_tokens - request.num_inflight_tokens

    def async_ineligible_reason(self) -> Optional[str]:
        """None when the next step may be scheduled before the step in flight has been applied (asynchronous
        scheduling), else why not. A running request
        - whose sampling reads its previous outputs' values (penalties): the host knows them only after `update`;
        - whose prompt logprobs are not reported yet: a preemption by the next `schedule` would reset the ones
          its in-flight step computes, and they would come with a later token instead of the first one."""
        for rid in self._sync_candidates:
            request = self.requests[rid]
            if request.status != RequestStatus.RUNNING:
                continue
            if request.samples_from_outputs:
                return "penalties read the previous step's tokens"
            if not request.prompt_logprobs_sent:
                return "prompt logprobs not reported yet"
        return None

    def _count_iteration(self, num_tokens: int) -> None:
        s = self._stats
        counts = list(s.iteration_tokens_counts)
        counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        s.iteration_tokens_counts = tuple(counts)
        s.iteration_tokens_sum += num_tokens

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate for `request`, preempting from the end of `running` until it fits. False when
        `request` itself had to be preempted."""
        while not self.kv_cache_manager.allocate_slots(request, request.num_inflight_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_request_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, budget: int, out: SchedulerOutput) -> int:
        """Admit waiting requests into `out` (module docstring, 2.); returns what is left of `budget`."""
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            if kv.num_free_blocks == 0:  # hits are whole blocks and >= 1 token is computed: a new block is needed,
                break  # so skip the prefix lookup that would fail anyway (it compares every hit block's tokens)
            request = self.waiting[0]
            if request.num_inflight_tokens:  # preempted while a step ran: resumed after that step's update
                break
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if not kv.allocate_slots(request, num_new, hit_blocks):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.status == RequestStatus.WAITING:  # first scheduling (not a resume)
                self._on_first_schedule(request, num_hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                )
            )
            self._add_chunk(out, request, num_new)
            budget -= num_new
        return budget

    def _on_first_schedule(self, request: Request, num_hit: int) -> None:
        request.first_scheduled_time = time.monotonic()
        request.num_cached_tokens = num_hit
        self._stats.prompt_tokens_total += request.num_prompt_tokens
        kv = self.kv_cache_manager
        if kv.enable_prefix_caching and not request.wants_prompt_logprobs:
            self._stats.prefix_cache_queries_total += request.num_prompt_tokens
            self._stats.prefix_cache_hits_total += num_hit

    def _add_chunk(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        """Append the request's next `num_new` tokens to `out` and count them in flight. Past the known tokens
        there is at most one position, the token its in-flight step samples: a placeholder."""
        start = request.num_computed_tokens + request.num_inflight_tokens
        end = start + num_new
        tokens = request.all_token_ids
        known = len(tokens)
        if end > known:
            assert end == known + 1 == start + 1, f"placeholder beyond one in-flight token: {request}"
            token_ids = [PLACEHOLDER_TOKEN_ID]
            out.placeholder_chunks.append(len(out.chunks))
        else:
            token_ids = tokens[start:end]
        num_pl = 0
        if request.wants_prompt_logprobs and not request.prompt_logprobs_sent:
            # Positions p whose next token p + 1 is a prompt token: p <= num_prompt_tokens - 2.
            num_pl = max(0, min(end, request.num_prompt_tokens - 1) - start)
        sample = end == known + request.num_inflight_samples and request.max_tokens > 0
        # positional: ScheduledChunk's field order (a keyword call costs twice as much, once per request per step)
        out.chunks.append(ScheduledChunk(request.request_id, token_ids, start,
                                         self.kv_cache_manager.get_block_ids(request.request_id), sample, num_pl))
        request.num_inflight_tokens += num_new
        request.num_inflight_samples += sample

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        if not request.prompt_logprobs_sent:
            request.prompt_logprobs = []  # recomputed from position 0
        self._stats.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # ---- update ------------------------------------------------------------------------------------

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[EngineOutput]:
        """Apply one step's results. For each chunk: advance num_computed_tokens, accumulate prompt
        logprobs, register newly full blocks, append the sampled token (sample=True), check stops, free
        finished requests' blocks. Returns one EngineOutput per request that got a token or finished.
        Chunks of requests finished since `schedule` (aborted in between) are ignored; a request preempted
        since (asynchronous scheduling: by the next step's `schedule`) only gets its sampled token."""
        outputs: list[EngineOutput] = []
        requests, sampled, logprobs = self.requests, runner_output.sampled_token_ids, runner_output.logprobs
        block_size, running = self.block_size, RequestStatus.RUNNING
        for chunk in scheduler_output.chunks:
            request = requests.get(chunk.request_id)
            if request is None:
                continue
            rid = request.request_id
            num_fed, sample = len(chunk.token_ids), chunk.sample
            request.num_inflight_tokens -= num_fed
            request.num_inflight_samples -= sample
            if request.status is running:
                computed = request.num_computed_tokens
                request.num_computed_tokens = computed + num_fed
                if chunk.prompt_logprob_positions:
                    request.prompt_logprobs.extend(runner_output.prompt_logprobs.get(rid, ()))
                # Only computed tokens are registered, and they are all known (placeholders lie beyond them). The
                # blocks full before this chunk were registered when they filled (or were prefix hits), so only a
                # chunk that fills a block has anything to register.
                if (computed + num_fed) // block_size > computed // block_size:
                    self.kv_cache_manager.cache_full_blocks(request)
            elif not sample:
                continue
            new_token_ids: list[int] = []
            new_logprobs = None
            finished = False
            if sample:
                token_id = sampled.get(rid)
                assert token_id is not None, f"runner returned no token for {rid}"
                request.append_output_token(token_id)
                new_token_ids = [token_id]
                if logprobs and rid in logprobs:
                    new_logprobs = [logprobs[rid]]
                finished = request.check_stop(self.max_model_len)
            elif request.max_tokens == 0 and request.num_computed_tokens >= request.num_prompt_tokens:
                request.finish_reason = FINISH_LENGTH
                finished = True
            else:
                continue
            output = self._make_output(request, new_token_ids, new_logprobs)
            if finished:
                self._finish(request)
            outputs.append(output)
        return outputs

    def _make_output(
        self, request: Request, new_token_ids: list[int], new_logprobs: Optional[list] = None
    ) -> EngineOutput:
        prompt_logprobs = None
        if (
            request.wants_prompt_logprobs
            and not request.prompt_logprobs_sent
            and len(request.prompt_logprobs) >= request.num_prompt_tokens - 1
        ):
            prompt_logprobs = [None] + list(request.prompt_logprobs)
            request.prompt_logprobs_sent = True
        first = request.first_scheduled_time
        # positional: EngineOutput's field order (a keyword call costs twice as much, once per request per step)
        return EngineOutput(request.request_id, new_token_ids, new_logprobs, prompt_logprobs, request.finish_reason,
                            request.stop_reason, None, request.num_prompt_tokens, request.num_cached_tokens,
                            None if first is None else first - request.arrival_time)

    # ---- finishing ---------------------------------------------------------------------------------

    def _finish(self, request: Request) -> None:
        """Free the blocks now; tell the runner next step if it holds state for the request."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._finished_ids.append(request.request_id)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        self._sync_candidates.pop(request.request_id, None)

    def finish_requests(
        self, request_ids: Iterable[str], finish_reason: str, stop_reason: object = None
    ) -> list[EngineOutput]:
        """Finish requests from outside a step (abort, stop string hit). Idempotent: unknown or already
        finished ids are ignored. Frees their blocks now; returns one final EngineOutput per request
        finished by this call."""
        return self._finish_external(request_ids, finish_reason, stop_reason, None)

    def fail_requests(self, request_ids: Iterable[str], error: str) -> list[EngineOutput]:
        """Finish requests with FINISH_ERROR and `error` (their step raised). Same rules as
        `finish_requests`."""
        return self._finish_external(request_ids, FINISH_ERROR, None, error)

    def _finish_external(
        self, request_ids: Iterable[str], finish_reason: str, stop_reason: object, error: Optional[str]
    ) -> list[EngineOutput]:
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            request.finish_reason, request.stop_reason = finish_reason, stop_reason
            output = self._make_output(request, [])
            output.error = error
            self._finish(request)
            outputs.append(output)
        return outputs

    # ---- queries -----------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_stats(self) -> SchedulerStats:
        """A copy of the counters plus current queue and pool gauges."""
        kv = self.kv_cache_manager
        s = self._stats
        # positional: SchedulerStats' field order (called every step by the step record and the core's stats)
        return SchedulerStats(len(self.running), len(self.waiting), kv.usage(), kv.num_free_blocks,
                              kv.num_usable_blocks, s.prompt_tokens_total, s.num_preemptions_total,
                              s.prefix_cache_queries_total, s.prefix_cache_hits_total, s.iteration_tokens_counts,
                              s.iteration_tokens_sum)
