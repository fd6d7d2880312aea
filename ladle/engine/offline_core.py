"""The offline LLM's engine core in its own process (`engine_core_process`, the default on CUDA): the same
engine-core process and messages as `ladle serve` (ladle/engine/core_process.py, core_messages.py), driven by a
blocking loop instead of an asyncio reader.

    LLM.generate (caller's process)                               engine-core process
    OutputProcessor.add_request -> AddRequests (the call) ------> add_requests (all or none) -> AddAck each
    loop: StepOutputs -> OutputProcessor (detokenize, stop     <---- per-step EngineOutputs + stats
          strings; final-only) -> FinishProcessed -----------> finish_processed
    until every prompt of the call has its final RequestOutput

Why: the core steps (schedule, launch, scheduler update) while this process detokenizes and checks stop strings,
so output processing leaves the step's critical path (vLLM's LLM runs its engine core in a separate process by
default for the same reason: VLLM_ENABLE_V1_MULTIPROCESSING). A stop string found here finishes its request one
or two steps later than in-process (the core may sample a few more tokens; they are dropped here, as in the server).

Failure rules: a rejected prompt refuses the whole call in the core (nothing of it runs) and raises RequestRejected
(a 400 reason) or EngineError once all acks are in; an interrupt or any other exception aborts the call's requests
and re-raises (the core lives on for the next call); a dead core (CoreDead, or the process gone) raises EngineError
now and for every later call.
"""

from __future__ import annotations

import atexit
import pickle
import time
from typing import Any, Optional

from ladle.core.outputs import RequestRejected
from ladle.core.sampling_params import SamplingParams
from ladle.engine import core_messages as msg
from ladle.engine.client import EngineError, RequestOutput
from ladle.engine.core_spawn import CoreProcess, spawn_core
from ladle.engine.output_processor import OutputProcessor

_POLL_MS = 250  # how often a blocked read checks that the core process is still alive
_STOP_WAIT_S = 30.0


class CoreProcessDriver:
    """Start with `CoreProcessDriver.start(engine_config)` (blocks until the core is built). `tokenizer`,
    `engine_config` (the resolved config in effect) and `model_name` come from the core's Ready; `stats` is the
    last stats snapshot the core sent (core_process.core_stats)."""

    def __init__(self, core: CoreProcess) -> None:
        self._core = core
        self.tokenizer = pickle.loads(core.ready.tokenizer)
        self.engine_config = pickle.loads(core.ready.engine_config)
        self.model_name = core.ready.model_name
        self.stats: dict = dict(core.ready.stats)
        self._dead: Optional[str] = None
        self._closed = False
        atexit.register(self.shutdown)  # before multiprocessing's exit hook, which would join the core forever

    @classmethod
    def start(cls, engine_config: Any) -> "CoreProcessDriver":
        return cls(spawn_core(engine_config))

    def is_healthy(self) -> bool:
        return self._dead is None and not self._closed and self._core.proc.is_alive()

    def run(self, processor: OutputProcessor, prompts: list[tuple[str, list[str], list[int], SamplingParams]]
            ) -> dict[str, RequestOutput]:
        """Send every (parent id, child ids, prompt token ids, params) of one call and process step outputs until
        each parent has its final RequestOutput (`processor` must be final-only). Returns parent id -> output."""
        if not self.is_healthy():
            raise EngineError(f"the engine is not running: {self._dead or 'the engine core process exited'}")
        now = time.monotonic()
        self._core.send(msg.AddRequests([msg.AddRequest(parent_id, child_ids, ids, params, now)
                                         for parent_id, child_ids, ids, params in prompts]))
        unacked = {p[0] for p in prompts}
        final: dict[str, RequestOutput] = {}
        error: Optional[BaseException] = None
        try:
            while unacked or len(final) < len(prompts):
                message = self._recv()
                if isinstance(message, msg.StepOutputs):
                    self.stats = message.stats
                    self._process(processor, message.outputs, final)
                elif isinstance(message, msg.AddAck) and message.parent_id in unacked:
                    unacked.discard(message.parent_id)
                    if message.error is not None and error is None:
                        error = RequestRejected(message.error) if message.rejected else EngineError(message.error)
                if error is not None and not unacked:
                    raise error
        except BaseException:
            if self.is_healthy():  # free the call's blocks now; outputs still on the way are ignored later
                self._core.send(msg.AbortRequests([c for p in prompts for c in p[1]]))
            for parent_id, *_ in prompts:
                processor.remove_request(parent_id)
            raise
        return final

    def _process(self, processor: OutputProcessor, outputs: list, final: dict[str, RequestOutput]) -> None:
        if not outputs:
            return
        processed = processor.process(outputs)  # children of earlier, aborted calls are unknown: ignored
        if processed.stop_hits or processed.failed_ids:
            self._core.send(msg.FinishProcessed([list(h) for h in processed.stop_hits], list(processed.failed_ids)))
        for ro in processed.request_outputs:  # final_only: one per request, when it finished
            final[ro.request_id] = ro

    def _recv(self) -> Any:
        sock = self._core.from_core
        while not sock.poll(_POLL_MS):
            if not self._core.proc.is_alive():
                self._dead = f"the engine core process exited (exit code {self._core.proc.exitcode})"
                raise EngineError(f"the engine loop died: {self._dead}")
        message = msg.from_core_decoder.decode(sock.recv())
        if isinstance(message, msg.CoreDead):
            self._dead = message.message
            raise EngineError(f"the engine loop died: {message.message}")
        return message

    def shutdown(self) -> None:
        """Stop the core (it aborts whatever is left), wait for it, clean up. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._core.join_or_kill(_STOP_WAIT_S if self._dead is None else 2.0)
        self._core.close()
