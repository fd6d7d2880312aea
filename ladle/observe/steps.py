"""Per-step record: host time, GPU time (sampled CUDA events), the step's byte planes and FLOPs from the model's
plan, its local GEMM shapes, and the queues (waiting, running, KV usage, preemptions, admission delay).

Hooked in one place, `EngineCore.step` (ladle/engine/engine_core.py):
    token = steps.begin()                      # first line of the step
    ...schedule, execute, update...
    steps.end(self, scheduler_output, token)   # after scheduler.update, before returning the outputs
Steps that schedule nothing return before `end` and are not recorded. Served as JSON at GET /debug/steps and
/debug/shapes (ladle/server/debug.py). Cost: a few dict updates and one pass over the step's chunks (measured by
benchmarks/observe_cost.py and tests/observe/test_steps.py; about 20-40 us per step on the CPU test machine).

Host time: from the step's `begin` to its `end`. Under --async-scheduling (ladle/engine/engine_core.py) step N ends
only after step N+1 has been scheduled and launched, so consecutive steps' host times overlap and their sum exceeds
the wall time (about twice it when every step overlaps: issue 11's c = 128 line, benchmarks/results/round14/README.md,
summed 143 s of host time over about 72 s). The sampled GPU time below is the step's own.

GPU time: with `--observe-timing`, every `--observe-timing-interval`-th step brackets the step with two CUDA
events (the step ends in a device->host copy anyway, so reading the pair adds no sync of its own) and times each
op launch of that step (ladle/observe/op_timing.py: CUDA events per launch, eager steps only; a graph replay is
one row, "cuda_graph_replay"). On CPU there is no GPU time (null); host time is the step's wall time, and the
per-op timer uses the host clock (--observe-timing is honoured on CPU; it is refused with more than one rank).
Device rates (copy bandwidth, GEMM rate) come from `--observe-copy-bandwidth` / `--observe-gemm-rate` when given,
else are measured once on CUDA at the first recorded step (ladle/observe/rates.py), else are absent (null) and no
roofline is computed.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Optional

from ladle.observe import op_timing, shapes
from ladle.observe.plan import (ModelPlan, StepBatch, context_bytes, plan_from_model, plane_totals,
                                roofline_seconds, step_bytes, step_gemm_shapes)

HISTORY = 4096  # steps kept for /debug/steps
logger = logging.getLogger(__name__)


class StepObserver:
    """The process-wide record (one engine per process; a new EngineCore re-plans). Thread-safe snapshots."""

    def __init__(self, history: int = HISTORY) -> None:
        self._lock = threading.Lock()
        self._history: collections.deque = collections.deque(maxlen=history)
        self._core_id: Optional[int] = None
        self.plan: Optional[ModelPlan] = None
        self.rates: dict[str, Any] = {"copy_bytes_per_s": None, "gemm_flop_per_s": None, "source": "absent"}
        self.timing_interval = 0  # 0: no GPU timing
        self._cuda = False
        self._index = 0
        self._failed = False
        # (num_tokens, num_sampled) -> (step_bytes without the context part, GEMM shape rows): see _step_constants
        self._constants: dict[tuple[int, int], tuple[dict, list]] = {}
        self._constants_for: tuple = ()
        self.reset()

    def reset(self) -> None:
        """Clear the history and totals (the plan and rates stay)."""
        with self._lock:
            self._history.clear()
            self.totals: dict[str, float] = collections.defaultdict(float)
            self.by_batch: dict[int, list[float]] = {}  # batch bucket -> [steps, host_s, roofline_s, bytes, gpu_s, n_gpu]

    # ---- the hook --------------------------------------------------------------------------------------

    def begin(self) -> tuple[float, Any, bool]:
        """Start a step: (perf_counter, CUDA start event or None, sampled). A sampled step (every
        timing_interval-th) also times each op launch (ladle.observe.op_timing)."""
        self._index += 1
        event, sampled = None, bool(self.timing_interval) and self._index % self.timing_interval == 0
        if sampled:
            if self._cuda:
                import torch

                event = torch.cuda.Event(enable_timing=True)
                event.record()
            op_timing.TIMER.start_step(self._cuda)
        elif op_timing.TIMER.active:  # the last sampled step never reached end() (it scheduled nothing, or raised)
            op_timing.TIMER.abandon()
        return time.perf_counter(), event, sampled

    def launched(self, token: tuple) -> tuple:
        """The step of `token` is launched (--async-scheduling: the next step is scheduled and launched before this
        one's results are read). A sampled step closes its brackets here, so the next step's launches are not
        counted in it: a CUDA stop event after its last launch, its host time so far, and the op timer's frames.
        Returns the token `end` takes."""
        if not token[2]:
            return token
        stop = None
        if token[1] is not None:
            import torch

            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
        return token[:3] + (stop, (time.perf_counter() - token[0]) * 1e3, op_timing.TIMER.pause())

    def end(self, core: Any, scheduler_output: Any, token: tuple) -> None:
        """Record the step `core` just ran for `scheduler_output` (ladle.core.outputs.SchedulerOutput). A failure
        here is logged once and never reaches the engine loop (observing must not stop serving)."""
        try:
            self._end(core, scheduler_output, token)
        except Exception:  # noqa: BLE001
            if not self._failed:
                self._failed = True
                logger.exception("step recording failed; /debug/steps may be incomplete")

    def _end(self, core: Any, scheduler_output: Any, token: tuple) -> None:
        if not scheduler_output.chunks:  # only finished / preempted ids reached the runner: no model step to record
            if op_timing.TIMER.active:
                op_timing.TIMER.abandon()
            return
        gpu_ms = None
        launched = len(token) > 3  # `launched` closed the brackets (async scheduling): (.., stop, host ms, timer state)
        if token[1] is not None:
            import torch

            stop = token[3] if launched else torch.cuda.Event(enable_timing=True)
            if not launched:
                stop.record()
            stop.synchronize()
            gpu_ms = token[1].elapsed_time(stop)
        if token[2]:  # a graph replay's time: the step's GPU time (CUDA), else its host time so far
            host_ms = token[4] if launched else (time.perf_counter() - token[0]) * 1e3
            state = token[5] if launched else None
            if not launched or state is not None:
                op_timing.TIMER.finish_step(gpu_ms if token[1] is not None else host_ms, state)
        if self._core_id != id(core):
            self.attach(core)
        chunks = scheduler_output.chunks
        context, num_tokens, sampled, prefill = 0, 0, 0, 0
        for c in chunks:  # one pass: this loop is most of the recording cost at large batches
            n = len(c.token_ids)
            context += c.start_position + n  # the request's seq_len after the step
            num_tokens += n
            sampled += c.sample + c.prompt_logprob_positions
            if n > 1:
                prefill += n
        stats = core.scheduler.get_stats()
        delays = _admission_delays(core.scheduler, scheduler_output)
        rec: dict[str, Any] = {
            "t": time.time(), "host_ms": None, "gpu_ms": gpu_ms, "num_reqs": len(chunks), "num_tokens": num_tokens,
            "prefill_tokens": prefill, "num_sampled": sampled, "context_tokens": context,
            "waiting": stats.num_waiting, "running": stats.num_running, "kv_usage": stats.kv_cache_usage,
            "preempted": len(scheduler_output.preempted_request_ids), "admitted": len(delays),
            "admission_delay_ms": (1e3 * sum(delays) / len(delays)) if delays else None,
            "bytes": None, "flops": None, "roofline_ms": None,
        }
        roof = None
        if self.plan is not None:
            fixed, shape_rows = self._step_constants(num_tokens, sampled)
            planes = {plane: dict(items) for plane, items in fixed.items()}  # = step_bytes(plan, this step's batch)
            planes["persistent"].update(context_bytes(self.plan, context))
            roof = roofline_seconds(planes, self.rates["copy_bytes_per_s"], self.rates["gemm_flop_per_s"])
            rec["bytes"], rec["flops"], rec["roofline_ms"] = planes, planes["flops"]["gemm"], _ms(roof)
            for row in shape_rows:
                shapes.record(*row)
        rec["host_ms"] = (time.perf_counter() - token[0]) * 1e3
        self._add(rec, roof, delays)

    # ---- internals ---------------------------------------------------------------------------------------

    def attach(self, core: Any) -> None:
        """Plan from the core's runner (duck-typed: .model, .kv_cache_specs, .dtype, .runner_config, .device)."""
        runner = core.runner
        self._core_id = id(core)
        model, specs = getattr(runner, "model", None), getattr(runner, "kv_cache_specs", None)
        self.plan = None
        if model is not None and specs is not None and hasattr(model, "named_modules"):
            dtype = getattr(runner, "dtype", None)
            act = int(getattr(dtype, "itemsize", 0) or 4)
            caches = getattr(runner, "kv_caches", None)  # the KV element size as allocated (an fp8 cache: 1)
            kv = caches[0].key_cache.element_size() if caches and hasattr(caches[0], "key_cache") else None
            self.plan = plan_from_model(model, specs, act, kv)
        cfg = getattr(runner, "runner_config", None)
        device = str(getattr(runner, "device", "cpu"))
        self._cuda = device.startswith("cuda")
        self.timing_interval = (int(getattr(cfg, "observe_timing_interval", 16) or 1)
                                if getattr(cfg, "observe_timing", False) else 0)
        if self.timing_interval and hasattr(model, "named_modules"):
            op_timing.TIMER.name_modules(model)  # GEMM rows are labelled by layer name
        from ladle.observe.rates import resolve_rates

        self.rates = resolve_rates(device, getattr(cfg, "observe_copy_bandwidth", 0.0),
                                   getattr(cfg, "observe_gemm_rate", 0.0))

    def _step_constants(self, num_tokens: int, num_sampled: int) -> tuple[dict, list]:
        """(step_bytes with no context, [(op, m, n, k, launches, modeled seconds or None)] for shapes.record) of a
        step of `num_tokens` tokens and `num_sampled` logits rows: they depend on nothing else of the step (only
        kv_read / index_k_read follow its context, `context_bytes`), so they are computed once per pair for the
        current plan and rates; a decode batch repeats its pair every step."""
        bw, rate = self.rates["copy_bytes_per_s"], self.rates["gemm_flop_per_s"]
        if self._constants_for != (self.plan, bw, rate) or len(self._constants) >= 1024:
            self._constants, self._constants_for = {}, (self.plan, bw, rate)
        hit = self._constants.get((num_tokens, num_sampled))
        if hit is None:
            batch = StepBatch(num_tokens, num_sampled, [])
            a, rows = self.plan.act_bytes, []
            for op, m, n, k, launches in step_gemm_shapes(self.plan, batch):
                modeled = None
                if bw and rate:  # weight + input + output bytes vs 2MNK FLOPs, per launch
                    modeled = launches * max((n * k + m * k + m * n) * a / bw, 2.0 * m * n * k / rate)
                rows.append((op, m, n, k, launches, modeled))
            hit = self._constants[(num_tokens, num_sampled)] = (step_bytes(self.plan, batch), rows)
        return hit

    def _add(self, rec: dict, roof: Optional[float], delays: list[float]) -> None:
        with self._lock:
            self._history.append(rec)
            t = self.totals
            t["steps"] += 1
            t["tokens"] += rec["num_tokens"]
            t["prefill_tokens"] += rec["prefill_tokens"]
            t["sampled"] += rec["num_sampled"]
            t["host_s"] += rec["host_ms"] / 1e3
            t["preemptions"] += rec["preempted"]
            t["admitted"] += len(delays)
            t["admission_delay_s"] += sum(delays)
            if rec["gpu_ms"] is not None:
                t["gpu_s"] += rec["gpu_ms"] / 1e3
                t["gpu_steps"] += 1
            if rec["bytes"] is not None:
                for plane, items in rec["bytes"].items():
                    for item, v in items.items():
                        t[f"{plane}.{item}"] += v
                t["roofline_s"] += roof or 0.0
            row = self.by_batch.setdefault(shapes.m_bucket(rec["num_reqs"]), [0, 0.0, 0.0, 0.0, 0.0, 0])
            row[0] += 1
            row[1] += rec["host_ms"] / 1e3
            row[2] += roof or 0.0
            row[3] += sum(plane_totals(rec["bytes"]).values()) if rec["bytes"] else 0.0
            if rec["gpu_ms"] is not None:
                row[4] += rec["gpu_ms"] / 1e3
                row[5] += 1

    # ---- views -------------------------------------------------------------------------------------------

    def snapshot(self, last: Optional[int] = None) -> dict:
        """JSON-able: totals, per batch-size bucket, the last `last` step records (all kept when None)."""
        with self._lock:
            hist = list(self._history)
            totals = dict(self.totals)
            by_batch = {str(b): {"steps": int(r[0]), "host_s": r[1], "roofline_s": r[2], "bytes": r[3],
                                 "gpu_s": r[4] if r[5] else None, "gpu_steps": int(r[5])}
                        for b, r in sorted(self.by_batch.items())}
        if last is not None:
            hist = hist[-last:] if last > 0 else []
        return {"totals": totals, "by_batch": by_batch, "history": hist, "rates": dict(self.rates),
                "timing": {"gpu_timing": bool(self.timing_interval and self._cuda), "interval": self.timing_interval,
                           "device": "cuda" if self._cuda else "cpu",
                           "op_timing": op_timing.TIMER.source if self.timing_interval else None},
                "plan": self.plan.to_dict() if self.plan is not None else None,
                "open_files": open_files()}


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


def _admission_delays(scheduler: Any, scheduler_output: Any) -> list[float]:
    """Seconds from arrival to first scheduling of the requests admitted this step (re-admissions after a
    preemption are not counted again)."""
    requests = getattr(scheduler, "requests", {})
    out = []
    for new in scheduler_output.new_requests:
        req = requests.get(new.request_id)
        first = getattr(req, "first_scheduled_time", None)
        if first is not None and not getattr(req, "num_preemptions", 0):
            out.append(max(0.0, first - req.arrival_time))
    return out


def open_files() -> dict:
    """{"soft", "hard"}: RLIMIT_NOFILE, and "open": this process's open descriptors (Linux /proc, else None)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        soft = hard = None
    try:
        n_open = len(os.listdir("/proc/self/fd"))
    except OSError:
        n_open = None
    return {"soft": soft, "hard": hard, "open": n_open}


OBSERVER = StepObserver()
begin = OBSERVER.begin
launched = OBSERVER.launched
end = OBSERVER.end
