"""EngineCore: owns the scheduler and the model runner; one `step()` = schedule -> execute -> update.

Single-threaded: the AsyncEngine's engine thread or the LLM caller is its only user. Everything it takes
and returns is plain Python (Request in, EngineOutput out), so it can move to its own process later.

Failure rule (ARCHITECTURE.md "Threads, aborts, failures"): an exception inside `runner.execute` fails the
requests of that step (FINISH_ERROR with the message, blocks freed) and the engine carries on. An
exception anywhere else propagates, and so does a `fatal` one from the runner (a tensor-parallel rank process
that died): the caller treats the loop as dead.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from typing import Iterable, Optional

from ladle.core.outputs import FINISH_ABORT, FINISH_ERROR, FINISH_STOP, EngineOutput, RequestRejected
from ladle.core.request import Request
from ladle.core.sampling_params import SamplingParams
from ladle.core.scheduler import Scheduler, SchedulerStats
from ladle.observe import steps as observe_steps

logger = logging.getLogger(__name__)


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


class EngineCore:
    """Args: scheduler, runner (anything with `execute(SchedulerOutput) -> RunnerOutput`), max_model_len,
    eos_token_ids (attached to every Request)."""

    def __init__(self, scheduler: Scheduler, runner, *, max_model_len: int, eos_token_ids: Iterable[int] = ()) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        # host seconds per phase of `step` since start (the CPU-time-per-step record of /metrics): "schedule"
        # (Scheduler.schedule), "execute" (runner/executor: prepare inputs, forward, sample, the device->host copy of
        # the sampled ids; synchronous, so it includes device time), "update" (Scheduler.update: the EngineOutputs)
        self.step_host_s: dict[str, float] = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
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
        """One engine step. Returns the EngineOutputs of this step (tokens, finishes, failures)."""
        observed = observe_steps.begin()
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.step_host_s["schedule"] += t1 - t0
        if scheduler_output.is_empty and not (scheduler_output.finished_request_ids
                                              or scheduler_output.preempted_request_ids):
            return []
        self.num_steps += 1
        try:
            runner_output = self.runner.execute(scheduler_output)
        except Exception as exc:  # noqa: BLE001 — the step's requests fail, the engine lives on
            if getattr(exc, "fatal", False):  # a rank process died (runner/executor.py): the engine cannot go on
                raise
            ids = [c.request_id for c in scheduler_output.chunks]
            logger.error("engine step failed for %d requests: %s\n%s", len(ids), exc, traceback.format_exc())
            # the runner drops their state itself: fail_requests reports them in the next finished_request_ids
            return self.scheduler.fail_requests(ids, f"{type(exc).__name__}: {exc}")
        t2 = time.perf_counter()
        outputs = self.scheduler.update(scheduler_output, runner_output)
        self.step_host_s["execute"] += t2 - t1
        self.step_host_s["update"] += time.perf_counter() - t2
        observe_steps.end(self, scheduler_output, observed)
        return outputs

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
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()
