"""EngineCore: owns the scheduler and the model runner; one `step()` = schedule -> execute -> update.

Single-threaded: the AsyncEngine's engine thread, the engine-core process loop or the LLM caller is its only user.
Everything it takes and returns is plain Python (Request in, EngineOutput out). Callers loop
`while core.has_unfinished_requests(): outputs = core.step()`, applying aborts and stop-string finishes between
calls; that shape is the same in both scheduling modes.

Asynchronous scheduling (`--async-scheduling`, SchedulerConfig.async_scheduling; ARCHITECTURE.md "Processes"):
one call schedules step N+1 and launches it on the device (`runner.launch`; its decode chunks of requests that
sample in step N feed placeholders the runner fills on the device from step N's sampled ids), then waits for step
N's tokens (`runner.wait`), applies `Scheduler.update` for N and returns N's outputs while N+1 runs. Eligibility
rule (`Scheduler.async_ineligible_reason`, recorded as dispatch op "async_scheduling"): step N+1 is scheduled
before N's update unless a running request samples with repetition/presence/frequency penalties (they read the
values of its previous tokens, which the host knows only after N) or still waits for its prompt logprobs; then the
pipeline drains (wait for N, update, return) and the next step is scheduled with everything known and run
synchronously. min_tokens needs only the count of outputs, which the runner keeps exact
(RequestState.num_pending_outputs); logprobs and seeded sampling need nothing of the previous step.
A request that finishes at step N may already be in step N+1: its N+1 token is discarded (update skips finished
requests). Its N+1 K/V write is harmless:
- it lands at the position after its last computed token, in a block the prefix cache never holds (only blocks
  whose tokens are all computed and known are registered, at update time);
- its blocks are freed at update N; a block reused by a later request is written by that request's own steps,
  which run after N+1 in stream order, before anything reads it (attention reads only positions a request wrote).
Aborts and stop-string finishes between calls free blocks at once; the same argument covers the in-flight write.
With tensor parallelism the runner is the multiprocess executor, whose ranks pipeline launch/wait the same way
(ladle/runner/executor.py).

Failure rule (ARCHITECTURE.md "Processes"): an exception inside `runner.execute` / `runner.launch` /
`runner.wait` fails the requests of that step (FINISH_ERROR with the message, blocks freed) and the engine carries
on; when waiting for step N fails, step N+1 (whose placeholders came from N) fails with it. An exception anywhere
else propagates, and so does a `fatal` one from the runner (a tensor-parallel rank process that died): the caller
treats the loop as dead.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from ladle.core.outputs import (FINISH_ABORT, FINISH_ERROR, FINISH_STOP, EngineOutput, RequestRejected,
                                ScheduledChunk, SchedulerOutput)
from ladle.core.request import Request
from ladle.core.sampling_params import SamplingParams
from ladle.core.scheduler import Scheduler, SchedulerStats
from ladle.observe import dispatch
from ladle.observe import steps as observe_steps

logger = logging.getLogger(__name__)

dispatch.register("async_scheduling", "overlap",
                  "--async-scheduling; no running request samples with repetition/presence/"
                  "frequency penalties or waits for prompt logprobs; executed = the step was scheduled and launched "
                  "while the previous one was in flight")


def fill_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """max_tokens None -> max_model_len - prompt length. Raises RequestRejected when no room is left."""
    if params.max_tokens is not None:
        return params
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for the completion. Please reduce the prompt.")
    return dataclasses.replace(params, max_tokens=room)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of `n`: n=1 and seed s+index (unseeded stays unseeded). Only choice 0 computes prompt
    logprobs (they are the same for every choice and are reported once per request)."""
    seed = None if params.seed is None else params.seed + index
    if params.n == 1 and seed == params.seed:
        return params
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


@dataclass
class _InFlight:
    """A launched step not yet applied: its SchedulerOutput, the runner's handle, the observe token."""

    scheduler_output: SchedulerOutput
    handle: Any
    observed: Any


class EngineCore:
    """Args: scheduler, runner (anything with `execute(SchedulerOutput) -> RunnerOutput`; with asynchronous
    scheduling, `scheduler.config.async_scheduling`, also `launch(SchedulerOutput) -> handle` and
    `wait(handle) -> RunnerOutput`), max_model_len, eos_token_ids (attached to every Request)."""

    def __init__(self, scheduler: Scheduler, runner, *, max_model_len: int, eos_token_ids: Iterable[int] = ()) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.async_scheduling = bool(getattr(getattr(scheduler, "config", None), "async_scheduling", False))
        if self.async_scheduling and not hasattr(runner, "launch"):
            raise ValueError("--async-scheduling needs a runner that launches steps (launch/wait)")
        self._in_flight: Optional[_InFlight] = None
        self._drain_reason: Optional[str] = None  # why the last drain happened: recorded with the next launch
        # host seconds per phase of `step` since start (the CPU-time-per-step record of /metrics): "schedule"
        # (Scheduler.schedule), "execute" (runner: prepare inputs, forward, sample; synchronous mode: also the
        # device->host copy of the sampled ids, so it includes device time; asynchronous mode: the launch only, which
        # on CUDA returns once the work is queued), "wait" (asynchronous mode: blocked on a launched step's results,
        # i.e. device time not hidden behind host work; 0 in synchronous mode), "update" (Scheduler.update: the
        # EngineOutputs), "device_idle" (asynchronous mode on CUDA: seconds the device had no step queued between two
        # consecutive steps while requests were unfinished, from the steps' CUDA events: the host time NOT hidden
        # behind device work; `_note_device_idle`; absent until a step measured it, so /metrics shows no 0 for a
        # mode that does not measure it)
        self.step_host_s: dict[str, float] = {"schedule": 0.0, "execute": 0.0, "wait": 0.0, "update": 0.0}
        self._last_done_event: Any = None  # the CUDA event after the last completed step's device work
        self.num_steps = 0

    # ---- requests ----------------------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     arrival_time: Optional[float] = None) -> Request:
        params = fill_max_tokens(params, len(prompt_token_ids), self.max_model_len)
        return Request(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time)

    def make_child_requests(self, child_ids: list[str], prompt_token_ids: list[int], params: SamplingParams,
                            arrival_time: Optional[float] = None) -> list[Request]:
        """The n child Requests of one prompt (ids from OutputProcessor.add_request; choice i: `child_params`)."""
        return [self.make_request(c, prompt_token_ids, child_params(params, i), arrival_time)
                for i, c in enumerate(child_ids)]

    def finish_processed(self, stop_hits: list[tuple[str, str]], failed_ids: list[str]) -> None:
        """Finish what output processing ended: children whose stop string matched (reason "stop", the string
        as stop_reason; the echoed outputs are ignored by the processor) and children that failed ("error")."""
        for child, stop in stop_hits:
            self.finish_requests([child], FINISH_STOP, stop)
        self.finish_requests(failed_ids, FINISH_ERROR)

    def add_request(self, request: Request) -> None:
        """Queue one (child) request. Raises RequestRejected when it can never run."""
        self.scheduler.add_request(request)

    def add_requests(self, requests: list[Request]) -> None:
        """All or nothing: when one is rejected, the ones already queued are aborted and the error raised."""
        added: list[str] = []
        try:
            for request in requests:
                self.add_request(request)
                added.append(request.request_id)
        except BaseException:
            self.abort_requests(added)
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineOutput]:
        """Finish with reason "abort" and free blocks now; idempotent."""
        return self.scheduler.finish_requests(list(request_ids), FINISH_ABORT)

    def finish_requests(self, request_ids: Iterable[str], finish_reason: str,
                        stop_reason: object = None) -> list[EngineOutput]:
        """Finish from outside a step (a stop string hit); idempotent."""
        return self.scheduler.finish_requests(list(request_ids), finish_reason, stop_reason)

    # ---- the step ----------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """One engine step. Returns the EngineOutputs of the step that completed (tokens, finishes, failures):
        this step's in synchronous mode; with asynchronous scheduling the previous step's ([] when the pipeline
        just started)."""
        if self.async_scheduling:
            return self._step_async()
        scheduler_output, observed, t1 = self._schedule()
        if scheduler_output is None:
            return []
        try:
            runner_output = self.runner.execute(scheduler_output)
        except Exception as exc:  # noqa: BLE001 — the step's requests fail, the engine lives on
            return self._fail(scheduler_output.chunks, exc)
        t2 = time.perf_counter()
        outputs = self.scheduler.update(scheduler_output, runner_output)
        self.step_host_s["execute"] += t2 - t1
        self.step_host_s["update"] += time.perf_counter() - t2
        observe_steps.end(self, scheduler_output, observed)
        return outputs

    def _step_async(self) -> list[EngineOutput]:
        """Schedule and launch step N+1, then complete step N (module docstring). When the eligibility rule fails
        with N in flight, only N completes (drain); a step launched with nothing in flight completes in the same
        call unless the next one may overlap it."""
        prev = self._in_flight
        reason = self.scheduler.async_ineligible_reason()
        if prev is not None and reason is not None:
            self._in_flight, self._drain_reason = None, reason
            return self._complete(prev)
        launched, outputs = self._launch(prev is not None, reason or self._drain_reason)
        self._drain_reason = None
        if prev is not None:
            self._in_flight = launched  # failed with prev if waiting for prev fails (its placeholders came from it)
            return outputs + self._complete(prev)
        if launched is not None and reason is not None:
            return outputs + self._complete(launched)
        self._in_flight = launched
        return outputs

    def _schedule(self) -> tuple[Optional[SchedulerOutput], Any, float]:
        """Schedule one step: (its SchedulerOutput, the step record's token, perf_counter after scheduling). The
        SchedulerOutput is None when there is nothing to run and nothing to tell the runner (no step is counted)."""
        observed = observe_steps.begin()
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.step_host_s["schedule"] += t1 - t0
        if scheduler_output.is_empty and not (scheduler_output.finished_request_ids
                                              or scheduler_output.preempted_request_ids):
            return None, observed, t1
        self.num_steps += 1
        return scheduler_output, observed, t1

    def _launch(self, overlapped: bool, reason: Optional[str]) -> tuple[Optional[_InFlight], list[EngineOutput]]:
        """Schedule a step and launch it: (the step in flight or None, outputs of a launch that failed). The dispatch
        record counts one decision per step that has chunks: executed when launched while the previous step was in
        flight; else `reason` (why the rule failed, now or at the drain before) or "nothing in flight"."""
        scheduler_output, observed, t1 = self._schedule()
        if scheduler_output is None:
            return None, []
        chunks = scheduler_output.chunks
        if chunks:
            dispatch.record("async_scheduling", dispatch.tokens_bucket(len(chunks)), configured=True,
                            eligible=reason is None, executed=overlapped and reason is None,
                            reason=reason or "nothing in flight (first step after idle or a drain)")
        try:
            handle = self.runner.launch(scheduler_output)
        except Exception as exc:  # noqa: BLE001 — the step's requests fail, the engine lives on
            return None, self._fail(chunks, exc)
        self.step_host_s["execute"] += time.perf_counter() - t1
        observed = observe_steps.launched(observed)  # close its timing brackets before the next step launches
        if not chunks:  # only finished / preempted ids: nothing to wait for, no model step to record
            return None, []
        return _InFlight(scheduler_output, handle, observed), []

    def _complete(self, step: _InFlight) -> list[EngineOutput]:
        """Wait for a launched step's results and apply them. When waiting fails, the step in flight after it
        (if any) fails too."""
        t0 = time.perf_counter()
        try:
            runner_output = self.runner.wait(step.handle)
        except Exception as exc:  # noqa: BLE001 — the step's requests fail, the engine lives on
            later, self._in_flight = self._in_flight, None
            chunks = step.scheduler_output.chunks
            if later is not None and later is not step:
                chunks = chunks + later.scheduler_output.chunks
            return self._fail(chunks, exc)
        t1 = time.perf_counter()
        outputs = self.scheduler.update(step.scheduler_output, runner_output)
        self._note_device_idle(step.handle)
        self.step_host_s["wait"] += t1 - t0
        self.step_host_s["update"] += time.perf_counter() - t1
        observe_steps.end(self, step.scheduler_output, step.observed)
        return outputs

    def _note_device_idle(self, handle: Any) -> None:
        """Add the device's idle gap between the previous completed step and this one (`handle`'s begin_event, both
        complete once this step's results are on the host) to step_host_s["device_idle"]. The gap after a step that
        left no unfinished request is idle time of the service, not of the engine: the chain restarts there."""
        begin, done = getattr(handle, "begin_event", None), getattr(handle, "done_event", None)
        if begin is None:
            return
        if self._last_done_event is not None:
            gap_s = max(0.0, self._last_done_event.elapsed_time(begin)) / 1e3
            self.step_host_s["device_idle"] = self.step_host_s.get("device_idle", 0.0) + gap_s
        self._last_done_event = done if self.scheduler.has_unfinished_requests() else None

    def _fail(self, chunks: list[ScheduledChunk], exc: Exception) -> list[EngineOutput]:
        """Fail the requests of `chunks` after a runner exception (re-raised when `fatal`: a rank process died)."""
        if getattr(exc, "fatal", False):  # a rank process died (runner/executor.py): the engine cannot go on
            raise exc
        ids = list(dict.fromkeys(c.request_id for c in chunks))
        logger.error("engine step failed for %d requests: %s\n%s", len(ids), exc, traceback.format_exc())
        # the runner drops their state itself: fail_requests reports them in the next finished_request_ids
        return self.scheduler.fail_requests(ids, f"{type(exc).__name__}: {exc}")

    def is_healthy(self) -> bool:
        """False once the runner reports itself dead (a tensor-parallel rank process exited)."""
        check = getattr(self.runner, "is_healthy", None)
        return True if check is None else bool(check())

    def shutdown(self) -> None:
        """Stop the runner's worker processes, if it has any (idempotent)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a launched step whose results were not applied yet."""
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
