"""CoreProcessEngine: the EngineClient of `ladle serve` with the engine core in its own process
(ARCHITECTURE.md "Processes"; the process side is ladle/engine/core_process.py).

    asyncio loop (API server)                                   engine-core process
    generate(): OutputProcessor.add_request -> AddRequest ----> add_requests -> AddAck
    abort / disconnect: AbortRequests ------------------------> abort_requests (blocks freed at once)
    reader task: StepOutputs -> OutputProcessor (detokenize,   <---- per-step EngineOutputs + stats
                 stop strings) -> FinishProcessed -----------> finish_processed (stop-string hits)
                 -> per-request RequestOutputStream (output_stream.py)

The event loop only awaits sockets: sends are non-blocking (unbounded send queue), the reader awaits the output
socket. The process dying (or saying CoreDead) turns `is_healthy()` False at once and ends every open stream
with EngineError; the reader notices a silent death within `_DEATH_POLL_S`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import shutil
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

import zmq
import zmq.asyncio

from ladle.core.outputs import FINISH_ABORT, RequestRejected
from ladle.core.sampling_params import SamplingParams
from ladle.engine import core_messages as msg
from ladle.engine.client import EngineClient, EngineError, EngineStats, RequestOutput
from ladle.engine.core_spawn import spawn_core
from ladle.engine.output_processor import OutputProcessor
from ladle.engine.output_stream import RequestOutputStream

logger = logging.getLogger(__name__)
_DEATH_POLL_S = 0.25
_STOP_WAIT_S = 30.0


class CoreProcessEngine(EngineClient):
    """Start with `CoreProcessEngine.start(engine_config)` (blocks until the core is built; raises EngineError with
    the core's message when the build fails)."""

    prints_dispatch_report = True  # the core process prints --dispatch-report's table: its counters live there

    def __init__(self, proc: Any, zctx: Any, to_core: Any, from_core: Any, ipc_dir: str, ready: msg.Ready) -> None:
        self._proc, self._zctx, self._to_core, self._from_core, self._ipc_dir = proc, zctx, to_core, from_core, ipc_dir
        self.tokenizer = pickle.loads(ready.tokenizer)
        self.engine_config = pickle.loads(ready.engine_config)
        self.max_model_len = int(ready.max_model_len)
        self.model_name = ready.model_name
        self._processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestOutputStream] = {}
        self._acks: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._success: dict[str, int] = {}
        self._stats = EngineStats()
        self._process_s = 0.0  # host seconds in OutputProcessor.process (this process's share of a step)
        self._dead: Optional[str] = None
        self._reader: Optional[asyncio.Task] = None
        self._stopped: Optional[asyncio.Future] = None
        self._publish_stats(ready.stats)

    @classmethod
    def start(cls, engine_config: Any, startup_timeout_s: float = 3600.0,
              core_target: Optional[Callable[..., Any]] = None) -> "CoreProcessEngine":
        """Spawn the engine-core process and wait for its Ready (ladle/engine/core_spawn.py; `core_target` replaces
        `run_engine_core`: benchmarks put a fake core there)."""
        core = spawn_core(engine_config, startup_timeout_s, core_target)
        return cls(core.proc, core.zctx, core.to_core, core.from_core, core.ipc_dir, core.ready)

    # ---- EngineClient ------------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: Optional[str] = None, stream_interval: int = 1) -> AsyncIterator[RequestOutput]:
        """See EngineClient.generate (same id rule as AsyncEngine: a given unused id is the key, else cmpl-<uuid>)."""
        self._check_alive()
        self._ensure_reader()
        parent_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        if parent_id in self._streams:
            raise RequestRejected(f"request id {parent_id!r} is already in use")
        prompt = list(prompt_token_ids)
        child_ids = self._processor.add_request(parent_id, prompt, sampling_params)
        stream = RequestOutputStream(stream_interval)
        self._streams[parent_id] = stream
        ack = self._acks[parent_id] = asyncio.get_running_loop().create_future()
        finished = False
        try:
            self._send(msg.AddRequest(parent_id, child_ids, prompt, sampling_params, time.monotonic()))
            try:
                await ack
            except BaseException:
                self._processor.remove_request(parent_id)
                finished = True
                raise
            while True:
                item = await stream.get()  # all (due) outputs since the last read, merged into one
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(parent_id, None)
            self._acks.pop(parent_id, None)
            if not finished and self._dead is None:  # client went away: free the blocks now
                self._send(msg.AbortRequests(self._processor.child_ids(parent_id)))

    async def abort(self, request_id: str) -> None:
        ids = self._processor.child_ids(request_id)
        if ids and self._dead is None:
            self._send(msg.AbortRequests(ids))

    def is_healthy(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def get_stats(self) -> EngineStats:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # called off the loop (a test): the last snapshot read
            return self._stats
        self._ensure_reader()
        return self._stats

    async def observe_snapshot(self, name: str, **kwargs: Any) -> dict:
        """An observe record (ladle/engine/observe_snapshots.py) from the core process; {} when it is not running."""
        if not self.is_healthy():
            return {}
        self._ensure_reader()
        call_id = next(self._call_ids)
        fut = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(msg.Utility(call_id, name, kwargs))
        try:
            return await asyncio.wait_for(fut, 30.0)
        finally:
            self._calls.pop(call_id, None)

    async def shutdown(self) -> None:
        """Stop the core (it aborts every request; open streams get finish_reason "abort"), wait for it, clean up.
        Idempotent: a second call waits for the first."""
        if self._stopped is None:
            self._stopped = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._stopped)

    async def _shutdown(self) -> None:
        self._ensure_reader()
        wait_s = _STOP_WAIT_S if self._dead is None else 2.0  # a dead client's core may not listen any more
        if self._proc.is_alive():
            self._send(msg.Stop())
        await asyncio.to_thread(self._proc.join, wait_s)
        if self._proc.is_alive():
            logger.warning("the engine core did not stop within %.0f s: killing it", wait_s)
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5.0)
        await asyncio.sleep(0)  # let the reader hand out what the core sent last
        if self._reader is not None:
            self._reader.cancel()
        self._deliver(self._processor.fail_all("the engine is shutting down", FINISH_ABORT).request_outputs)
        self._fail_waiters(EngineError("the engine is shutting down"))
        self._dead = self._dead or "stopped"
        self._to_core.close(0)
        self._from_core.close(0)
        self._zctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineError(f"the engine is not running: {self._dead or 'the engine core process exited'}")

    # ---- the loop side -----------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        self._to_core.send(msg.encoder.encode(message), zmq.NOBLOCK)  # SNDHWM 0: never blocks the loop

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done() and self._dead is None:
            self._reader = asyncio.ensure_future(self._read_loop())

    async def _read_loop(self) -> None:
        sock = zmq.asyncio.Socket.shadow(self._from_core.underlying)
        try:
            while self._dead is None:
                if await sock.poll(int(_DEATH_POLL_S * 1000), zmq.POLLIN):
                    while True:
                        try:
                            raw = self._from_core.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(msg.from_core_decoder.decode(raw))
                elif not self._proc.is_alive() and self._stopped is None:
                    self._die(f"the engine core process exited (exit code {self._proc.exitcode})")
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 — the reader cannot go on: the server must say so
            logger.exception("reading the engine core's outputs failed")
            self._die(f"reading the engine core's outputs failed: {exc}")

    def _handle(self, message: Any) -> None:
        if isinstance(message, msg.StepOutputs):
            self._publish_stats(message.stats)
            self._process(message.outputs)
        elif isinstance(message, msg.AddAck):
            fut = self._acks.pop(message.parent_id, None)
            if fut is not None and not fut.done():
                if message.error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(RequestRejected(message.error) if message.rejected
                                      else EngineError(message.error))
        elif isinstance(message, msg.UtilityResult):
            fut = self._calls.pop(message.call_id, None)
            if fut is not None and not fut.done():
                if message.error is None:
                    fut.set_result(message.result)
                else:
                    fut.set_exception(EngineError(message.error))
        elif isinstance(message, msg.CoreDead):
            self._die(message.message)

    def _process(self, outputs: list) -> None:
        if not outputs:
            return
        t0 = time.perf_counter()
        processed = self._processor.process(outputs)
        self._process_s += time.perf_counter() - t0
        if processed.stop_hits or processed.failed_ids:
            self._send(msg.FinishProcessed([list(h) for h in processed.stop_hits], list(processed.failed_ids)))
        for ro in processed.request_outputs:
            for co in ro.outputs:
                if co.finish_reason:
                    self._success[co.finish_reason] = self._success.get(co.finish_reason, 0) + 1
        self._stats = EngineStats(**{**self._stats.__dict__, **self._own_stats(self._stats.step_host_seconds)})
        self._deliver(processed.request_outputs)

    def _publish_stats(self, stats: dict) -> None:
        stats = dict(stats)
        stats["iteration_tokens_counts"] = tuple(stats.get("iteration_tokens_counts", ()))
        self._stats = EngineStats(**{**stats, **self._own_stats(stats.get("step_host_seconds", {}))})

    def _own_stats(self, core_phases: dict) -> dict:
        """The EngineStats fields this process counts: finishes and generation tokens of the choices delivered,
        and the core's host seconds per phase (`core_phases`) plus this process's output processing."""
        return {"request_success_total": dict(self._success),
                "generation_tokens_total": self._processor.num_generation_tokens,
                "step_host_seconds": {**core_phases, "process_outputs": self._process_s}}

    def _deliver(self, request_outputs: list) -> None:
        """One put per request of this step's batch (no task switch here; each consumer wakes once per step)."""
        streams = self._streams
        for ro in request_outputs:
            stream = streams.get(ro.request_id)
            if stream is not None:
                stream.put(ro)

    def _die(self, message: str) -> None:
        if self._dead is not None:
            return
        self._dead = message
        logger.error("the engine core is gone: %s", message)
        if self._proc.is_alive():  # this side gave up on it (the reader failed): let it stop too
            self._send(msg.Stop())
        error = EngineError(f"the engine loop died: {message}")
        for stream in self._streams.values():
            stream.put(error)
        self._fail_waiters(error)

    def _fail_waiters(self, error: BaseException) -> None:
        for fut in list(self._acks.values()) + list(self._calls.values()):
            if not fut.done():
                fut.set_exception(error)
