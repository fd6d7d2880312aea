"""The engine-core process (ARCHITECTURE.md "Processes"): EngineCore (scheduler + runner or TP executor) in its own
interpreter, fed by the API server over ZeroMQ (ladle/engine/core_messages.py), started by
ladle/engine/core_client.py with multiprocessing "spawn".

    loop: apply every queued message (add / abort / finish / observe call / stop) -> one StepOutputs for them
          if requests are unfinished: core.step() -> StepOutputs (EngineOutputs + stats)
          else wait up to 50 ms on the input socket

The core sees token ids only (no tokenizer work besides reading EOS ids at build). It dies with the API server
(parent-death signal SIGTERM + watchdog, as the TP workers do), ignores SIGINT (Ctrl-C reaches the whole process
group; the API server decides), and treats SIGTERM as a stop. A message that fails is answered with its error; only
an exception in the loop itself or a dead TP rank ends the process, after a CoreDead message. Every exit removes the
ipc dir (ladle/engine/core_spawn.py). It logs as the API process is configured (`logging_setup`), so both modes print
the same lines: nothing below WARNING when the API process configured no logging.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from typing import Any

_IDLE_WAIT_MS = 50
_STYLES = {logging.PercentStyle: "%", logging.StrFormatStyle: "{", logging.StringTemplateStyle: "$"}
logger = logging.getLogger(__name__)


def run_engine_core(engine_config: Any, input_addr: str, output_addr: str, parent_pid: int,
                    parent_logging: dict) -> None:
    """Process entry (spawn target): build the engine, say Ready, serve messages until Stop, SIGTERM or a fatal
    error. Exits 0 on a stop, 1 after a build failure or a fatal error (both reported as CoreDead first), or when
    the API process is gone; the ipc dir (the addresses' dir) is removed on each. `parent_logging`: `logging_setup()`
    of the API process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    apply_logging_setup(parent_logging)
    import zmq

    from ladle.engine import core_messages as msg
    from ladle.engine.core_spawn import remove_ipc_dir
    from ladle.runner.worker import die_with_parent

    ipc_dir = os.path.dirname(input_addr.removeprefix("ipc://"))
    die_with_parent(parent_pid, death_signal=signal.SIGTERM, before_exit=lambda: remove_ipc_dir(ipc_dir))
    _leave_a_core_to_the_server(engine_config)
    zctx = zmq.Context()
    inbox, outbox = zctx.socket(zmq.PULL), zctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.setsockopt(zmq.LINGER, 2000)
    inbox.connect(input_addr)
    outbox.connect(output_addr)
    send = lambda m: outbox.send(msg.encoder.encode(m))  # noqa: E731
    code = 0
    try:
        try:
            from ladle.engine.engine_factory import build_engine

            bundle = build_engine(engine_config)
        except BaseException as exc:  # noqa: BLE001 — the server prints the message and exits 1
            if os.environ.get("LADLE_DEBUG"):
                logger.error("engine build failed:\n%s", traceback.format_exc())
            send(msg.CoreDead(str(exc) or type(exc).__name__))
            code = 1
            return
        loop = CoreLoop(bundle.core, inbox, send, stopping, bundle.engine_config.runner.dispatch_report)
        freeze_startup_objects()
        send(msg.Ready(bundle.model_name, pickle.dumps(bundle.tokenizer), pickle.dumps(bundle.engine_config),
                       bundle.max_model_len, loop.stats()))
        code = loop.run()
    finally:
        inbox.close(linger=0)
        outbox.close()
        zctx.term()
        remove_ipc_dir(ipc_dir)
        if code:
            os._exit(code)


def logging_setup() -> dict:
    """This process's logging configuration as plain data, for `apply_logging_setup` in a spawned child: the root
    level, the levels set on `ladle` and its child loggers, and the root handlers a child can reproduce (those
    writing to sys.stderr, sys.stdout or a file: their level, format, date format and format style). Other handlers
    (in-memory, sockets, queues) and filters do not cross the process boundary."""
    root = logging.getLogger()
    handlers = []
    for h in root.handlers:
        stream = getattr(h, "stream", None)
        if isinstance(h, logging.FileHandler):
            target = ("file", h.baseFilename)
        elif isinstance(h, logging.StreamHandler) and stream in (sys.stderr, sys.__stderr__):
            target = ("stderr", None)
        elif isinstance(h, logging.StreamHandler) and stream in (sys.stdout, sys.__stdout__):
            target = ("stdout", None)
        else:
            continue
        fmt = h.formatter
        handlers.append({"to": target[0], "file": target[1], "level": h.level,
                         "format": fmt._fmt if fmt else None, "datefmt": fmt.datefmt if fmt else None,
                         "style": _STYLES.get(type(fmt._style), "%") if fmt else "%"})
    levels = {name: lg.level for name, lg in logging.root.manager.loggerDict.items()
              if (name == "ladle" or name.startswith("ladle.")) and isinstance(lg, logging.Logger) and lg.level}
    return {"root_level": root.level, "levels": levels, "handlers": handlers}


def apply_logging_setup(setup: dict) -> None:
    """Configure this (fresh) process's logging as `logging_setup()` described its parent's. With no handler the
    root stays without one, so Python's last-resort handler prints WARNING and above to stderr, as in the parent."""
    root = logging.getLogger()
    root.setLevel(setup["root_level"])
    for name, level in setup["levels"].items():
        logging.getLogger(name).setLevel(level)
    for h in setup["handlers"]:
        if h["to"] == "file":
            handler: logging.Handler = logging.FileHandler(h["file"], mode="a", delay=True)
        else:
            handler = logging.StreamHandler(sys.stdout if h["to"] == "stdout" else sys.stderr)
        handler.setLevel(h["level"])
        handler.setFormatter(logging.Formatter(h["format"], h["datefmt"], style=h["style"]))
        root.addHandler(handler)


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive after startup (model, tokenizer, configs) out of the garbage
    collector's generations, so later collections scan only what serving allocates. vLLM does the same after startup
    (`freeze_gc_heap`, vllm/utils). Measured on the API side by benchmarks/serve_output_path.py: with logprobs at
    B = 128 the collector was about half of the host time per streamed token."""
    gc.collect()
    gc.freeze()


def _leave_a_core_to_the_server(engine_config: Any) -> None:
    """On CPU the model's intra-op threads would take every core from the API server process (and an OpenMP team
    that loses a core to it stalls at each barrier: a 10x slower step measured on 2 cores): use all cores but one."""
    import torch

    device = str(getattr(engine_config.model, "device", "auto") or "auto")
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))


def core_stats(core: Any) -> dict:
    """The stats snapshot every core->client message carries: SchedulerStats fields, `step_host_seconds` (host
    seconds per phase of EngineCore.step since start) and `num_steps`."""
    out = dict(vars(core.get_stats()))  # a fresh object per call, immutable fields: no deep copy
    out["step_host_seconds"] = dict(core.step_host_s)
    out["num_steps"] = core.num_steps
    return out


class CoreLoop:
    """The message and step loop around one EngineCore. `send(message)` writes to the output socket; `inbox` is
    the input socket (anything with zmq's `poll` and `recv`)."""

    def __init__(self, core: Any, inbox: Any, send: Any, stopping: threading.Event,
                 dispatch_report: bool = False) -> None:
        from ladle.engine import core_messages as msg

        self.core, self.inbox, self.send, self.stopping, self.msg = core, inbox, send, stopping, msg
        self.dispatch_report = dispatch_report  # --dispatch-report: print the table at exit

    def run(self) -> int:
        """Returns the exit status: 0 after Stop / SIGTERM, 1 after a fatal error."""
        import zmq

        core = self.core
        try:
            while not self.stopping.is_set():
                if not core.is_healthy():
                    raise RuntimeError("a tensor-parallel rank process died")
                busy = core.has_unfinished_requests()
                if self.inbox.poll(0 if busy else _IDLE_WAIT_MS, zmq.POLLIN):
                    if not self._drain():
                        break
                if core.has_unfinished_requests():
                    outputs = core.step()
                    self.send(self.msg.StepOutputs(outputs, self.stats()))
            self._abort_everything()
            return 0
        except BaseException as exc:  # noqa: BLE001 — the core cannot go on: say so, then exit
            logger.error("engine core loop died: %s\n%s", exc, traceback.format_exc())
            self.send(self.msg.CoreDead(f"{type(exc).__name__}: {exc}"))
            return 1
        finally:
            if self.dispatch_report:  # --dispatch-report: the counters live in this process
                from ladle.observe import dispatch

                print(dispatch.format_table(), flush=True)
            core.shutdown()

    def stats(self) -> dict:
        return core_stats(self.core)

    def _drain(self) -> bool:
        """Apply every queued message; one StepOutputs carries the outputs of the aborts and the new stats.
        Returns False on Stop."""
        import zmq

        outputs: list = []
        keep_going = True
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            message = self.msg.to_core_decoder.decode(raw)
            if isinstance(message, self.msg.Stop):
                keep_going = False
                break
            outputs.extend(self._apply(message))
        self.send(self.msg.StepOutputs(outputs, self.stats()))
        return keep_going

    def _apply(self, message: Any) -> list:
        """One message; a failure goes back to its sender and never ends the loop."""
        from ladle.core.outputs import RequestRejected
        from ladle.engine.observe_snapshots import observe_snapshot

        msg, core = self.msg, self.core
        if isinstance(message, (msg.AddRequest, msg.AddRequests)):
            adds = message.requests if isinstance(message, msg.AddRequests) else [message]
            try:  # all or nothing (EngineCore.add_requests)
                core.add_requests([r for a in adds for r in core.make_child_requests(
                    a.child_ids, a.prompt_token_ids, a.params, a.arrival_time)])
            except Exception as exc:  # noqa: BLE001 — RequestRejected (400) or anything else (500)
                for a in adds:
                    self.send(msg.AddAck(a.parent_id, str(exc) or type(exc).__name__, isinstance(exc, RequestRejected)))
                return []
            for a in adds:
                self.send(msg.AddAck(a.parent_id))
            return []
        if isinstance(message, msg.AbortRequests):
            return core.abort_requests(message.child_ids)
        if isinstance(message, msg.FinishProcessed):
            core.finish_processed([tuple(hit) for hit in message.stop_hits], message.failed_ids)
            return []
        if isinstance(message, msg.Utility):
            try:
                self.send(msg.UtilityResult(message.call_id, observe_snapshot(message.name, **message.kwargs)))
            except Exception as exc:  # noqa: BLE001
                self.send(msg.UtilityResult(message.call_id, None, f"{type(exc).__name__}: {exc}"))
        return []

    def _abort_everything(self) -> None:
        ids = list(getattr(self.core.scheduler, "requests", {}))
        self.send(self.msg.StepOutputs(self.core.abort_requests(ids) if ids else [], self.stats()))
