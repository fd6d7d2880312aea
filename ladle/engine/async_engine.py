"""AsyncEngine: the EngineClient the server uses. The EngineCore runs on its own thread.

    asyncio loop                                  engine thread
    generate() --("add", requests, ack)--> queue --> add_requests, ack via call_soon_threadsafe
    abort()/cancel --("abort", ids)------> queue --> finish_requests("abort") at the step boundary
                                                      step() -> OutputProcessor (detokenize, stop strings)
    per-request RequestOutputStream <-- call_soon_threadsafe -- RequestOutputs

If the engine thread dies, `is_healthy()` turns False and every open stream ends with EngineError; new
requests are refused with EngineError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
import uuid
from typing import Any, AsyncIterator, Optional

from ladle.config import EngineConfig
from ladle.core.outputs import FINISH_ABORT, RequestRejected
from ladle.core.sampling_params import SamplingParams
from ladle.engine.client import EngineClient, EngineError, EngineStats, RequestOutput
from ladle.engine.engine_factory import EngineBundle, build_engine
from ladle.engine.output_processor import OutputProcessor
from ladle.engine.output_stream import RequestOutputStream

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.05


class _Stream:
    """The loop-side end of one request: outputs (or an exception) are put on `queue` (a RequestOutputStream) from
    the engine thread through `loop.call_soon_threadsafe` (`_put_all`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream_interval: int) -> None:
        self.loop = loop
        self.queue = RequestOutputStream(stream_interval)  # a lagging consumer reads what piled up as one output


def _deliver(pairs: list[tuple[_Stream, Any]]) -> None:
    for stream, item in pairs:
        stream.queue.put(item)


def _put_all(pairs: list[tuple[_Stream, Any]]) -> None:
    """From the engine thread: hand each (stream, item) to its loop with one wake-up per loop, not one per request
    (each `call_soon_threadsafe` writes the loop's self-pipe: ~6 us of engine-thread time per call)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in pairs:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class AsyncEngine(EngineClient):
    """Args: bundle (a built engine). Use `AsyncEngine.from_config(engine_config)` to load one."""

    def __init__(self, bundle: EngineBundle) -> None:
        self.bundle = bundle
        self.core = bundle.core
        self.tokenizer = bundle.tokenizer
        self.engine_config = bundle.engine_config
        self.max_model_len = bundle.max_model_len
        self.model_name = bundle.model_name
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # parent id -> stream (loop side registers, thread reads)
        self._processor = OutputProcessor(self.tokenizer)
        self._success: dict[str, int] = {}
        self._process_s = 0.0  # host seconds in OutputProcessor.process
        self._stats = EngineStats()
        self._dead: Optional[str] = None
        self._stopping = threading.Event()
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="ladle-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, engine_config: EngineConfig) -> EngineClient:
        """The server's engine: with `parallel.engine_core_process` (`--engine-core-process`, the default) the core
        runs in its own process (ladle/engine/core_client.py); otherwise on a thread of this process (this class;
        kept for A/B until GPU numbers decide)."""
        if engine_config.parallel.engine_core_process:
            from ladle.engine.core_client import CoreProcessEngine

            return CoreProcessEngine.start(engine_config)
        return cls(build_engine(engine_config))

    # ---- EngineClient ------------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: Optional[str] = None, stream_interval: int = 1) -> AsyncIterator[RequestOutput]:
        """See EngineClient.generate. `request_id`, when given and not in use, becomes the internal id;
        otherwise `cmpl-<uuid>` is generated. A duplicate in-flight id is refused (RequestRejected)."""
        self._check_alive()
        parent_id = request_id or f"cmpl-{uuid.uuid4().hex}"
        if parent_id in self._streams:
            raise RequestRejected(f"request id {parent_id!r} is already in use")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, stream_interval)
        self._streams[parent_id] = stream
        ack: asyncio.Future = loop.create_future()
        self._inbox.put(("add", parent_id, list(prompt_token_ids), sampling_params, ack, loop, time.monotonic()))
        finished = False
        try:
            await ack  # RequestRejected / EngineError surface here, before the first yield
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(parent_id, None)
            if not finished and self._dead is None:
                self._inbox.put(("abort", parent_id))  # client went away: free the blocks next boundary

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive() and self.core.is_healthy()

    def get_stats(self) -> EngineStats:
        return self._stats

    async def shutdown(self) -> None:
        if self._thread.is_alive():
            self._stopping.set()
            self._inbox.put(("stop",))
            await asyncio.to_thread(self._thread.join, 30.0)
        await asyncio.to_thread(self.core.shutdown)

    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineError(f"the engine is not running: {self._dead or 'stopped'}")

    # ---- engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                block = not self.core.has_unfinished_requests()
                if not self._drain_inbox(block):
                    break
                if self.core.has_unfinished_requests():
                    self._dispatch(self.core.step())  # publishes the stats itself
                else:
                    self._publish_stats()
            self._abort_everything("the engine is shutting down", FINISH_ABORT)
        except BaseException as exc:  # noqa: BLE001 — the loop died: fail every stream, report unhealthy
            self._dead = f"{type(exc).__name__}: {exc}"
            logger.error("engine loop died: %s\n%s", exc, traceback.format_exc())
            self._fail_streams(EngineError(f"the engine loop died: {self._dead}"))
        finally:
            self._publish_stats()

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts. Returns False on "stop"."""
        while True:
            try:
                item = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            kind = item[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*item[1:])
            elif kind == "abort":
                self._abort(item[1])

    def _add(self, parent_id: str, prompt_ids: list[int], params: SamplingParams, ack: asyncio.Future,
             loop: asyncio.AbstractEventLoop, arrival_time: float) -> None:
        def resolve(exc: Optional[BaseException]) -> None:
            if ack.done():
                return
            if exc is None:
                ack.set_result(None)
            else:
                ack.set_exception(exc)

        def answer(exc: Optional[BaseException]) -> None:
            try:
                loop.call_soon_threadsafe(resolve, exc)
            except RuntimeError:  # the caller's loop is closed
                pass

        try:
            requests = self.core.make_child_requests(self._processor.add_request(parent_id, prompt_ids, params),
                                                     prompt_ids, params, arrival_time)
            self.core.add_requests(requests)
        except Exception as exc:  # noqa: BLE001 — RequestRejected and friends go back to the caller
            self._processor.remove_request(parent_id)
            answer(exc)
            return
        if parent_id not in self._streams:  # cancelled before the add was applied
            self._abort(parent_id)
        answer(None)

    def _abort(self, parent_id: str) -> None:
        child_ids = self._processor.child_ids(parent_id)
        if not child_ids:
            return
        self._dispatch(self.core.abort_requests(child_ids))

    def _dispatch(self, engine_outputs: list) -> None:
        t0 = time.perf_counter()
        processed = self._processor.process(engine_outputs)
        self._process_s += time.perf_counter() - t0
        self.core.finish_processed(processed.stop_hits, processed.failed_ids)
        for ro in processed.request_outputs:
            for co in ro.outputs:
                if co.finish_reason:
                    self._success[co.finish_reason] = self._success.get(co.finish_reason, 0) + 1
        self._publish_stats()  # before clients see the outputs
        self._put_outputs(processed.request_outputs)

    def _put_outputs(self, request_outputs: list) -> None:
        _put_all([(self._streams[ro.request_id], ro) for ro in request_outputs if ro.request_id in self._streams])

    def _abort_everything(self, message: str, reason: str) -> None:
        for parent_id in self._processor.parent_ids:
            self._dispatch(self.core.abort_requests(self._processor.child_ids(parent_id)))
        self._dispatch_fail(message, reason)  # anything the scheduler no longer knew

    def _dispatch_fail(self, message: str, reason: str) -> None:
        self._put_outputs(self._processor.fail_all(message, reason).request_outputs)

    def _fail_streams(self, exc: BaseException) -> None:
        _put_all([(stream, exc) for stream in list(self._streams.values())])

    def _publish_stats(self) -> None:
        s = self.core.get_stats()
        host = {**getattr(self.core, "step_host_s", {}), "process_outputs": self._process_s}
        self._stats = EngineStats(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)},
                                  request_success_total=dict(self._success),
                                  generation_tokens_total=self._processor.num_generation_tokens,
                                  num_steps=getattr(self.core, "num_steps", 0), step_host_seconds=host)

