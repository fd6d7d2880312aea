"""The `ladle` command (also `python -m ladle`): argument wiring only.

    ladle serve [MODEL] [flags]                 OpenAI-compatible server (flags: `ladle serve --help`)
    ladle generate "PROMPT" [flags]             one-shot answer through the offline LLM API
    ladle bench ...                             load generator (ladle.bench.cli)
    ladle make-checkpoint llama --from-gguf GGUF --config-only OUT
    ladle make-checkpoint minimax-m3 ...        (ladle.tools.checkpoint_m3)

Subcommands owned by other modules are imported lazily, so a missing module fails with a clear message
instead of breaking the whole command.

`serve` and `generate` report every refusal of a command line in one message before anything loads (unsupported
vLLM flags, bad values, and the checks against the model's config.json), exit 2 for refused flags and 1 for
refused values. `serve` logs from its first second, raises the open-files limit, and ends with status 0 and no
traceback on Ctrl-C or SIGTERM, during startup as well as while serving.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import signal
import sys
import threading
from typing import Callable, Optional

from ladle.cli_args import add_config_args, collect_refusals, config_fields, configs_from_args, refuse_serving_flags
from ladle.config import EngineConfig, ServerConfig, env_flag, format_refusals

logger = logging.getLogger("ladle.cli")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

USAGE = __doc__.split("\n\n")[1]


def _lazy(module: str, attr: str, what: str) -> Callable:
    """Import `module.attr`, or exit with a message that names the missing piece."""
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            sys.exit(f"ladle: {what} is not available in this build ({module} is missing)")
        raise
    except AttributeError:
        sys.exit(f"ladle: {what} is not available in this build ({module}.{attr} is missing)")


def serve_parser(prog: str = "ladle serve") -> argparse.ArgumentParser:
    # allow_abbrev=False: a shortened flag would parse silently past the checks that match exact names (the
    # unsupported vLLM flags, the CUDA-only ones); vLLM's flags are spelled out in recipes anyway
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over an OpenAI-compatible HTTP API.",
                                     allow_abbrev=False)
    add_config_args(parser)
    parser.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL (vLLM's form)")
    return parser


def _resolve_model(args: argparse.Namespace) -> None:
    if args.model_flag is not None:
        if args.model__model not in (None, args.model_flag):
            sys.exit("ladle: give the model once (positional MODEL or --model), not two different ones")
        args.model__model = args.model_flag


def configs_or_refusal(parser: argparse.ArgumentParser, argv: list[str],
                       more_refusals: Optional[Callable[[argparse.Namespace], list[str]]] = None,
                       ) -> tuple[EngineConfig, ServerConfig, argparse.Namespace]:
    """The configs of a command line, or exit with every refusal in one message: status 2 when a flag is refused
    (unsupported, malformed), 1 when only values are. The model's config.json (or GGUF header) is read too, so its
    refusals (tensor-parallel size, block size, context length) join the same message; weights are never loaded
    here. `more_refusals(args)` adds a command's own value checks (`generate`'s sampling values)."""
    refusals, args = collect_refusals(parser, argv)
    flag_refused = bool(refusals)
    if args is not None:
        _resolve_model(args)
        engine_config, server_config = configs_from_args(args)
        preflight = _lazy("ladle.engine.engine_factory", "preflight_refusals", "the engine")
        # the checks against the model's config.json too (tenths of a second, also for a GGUF header): a refusal
        # that needs the model (tensor-parallel size against the heads, block size, context length) comes in the
        # same message as the others, before "configuration accepted"
        refusals += _server_refusals(server_config) + preflight(engine_config, with_model=True)
        refusals += _cuda_only_refusals(argv, engine_config)
        refusals += more_refusals(args) if more_refusals is not None else []
    if refusals:
        print(f"{parser.prog}: error: {format_refusals(refusals)}", file=sys.stderr)
        sys.exit(2 if flag_refused else 1)
    return engine_config, server_config, args


def _given_flags(argv: list[str]) -> set[str]:
    """The long flags named on a command line (`--flag=value` as `--flag`)."""
    return {token.partition("=")[0] for token in argv if token.startswith("--")}


def _cuda_only_refusals(argv: list[str], engine_config: EngineConfig) -> list[str]:
    """config_resolve.cuda_only_refusals for the flags given on the command line (the CUDA-only ones on a CPU run)."""
    given = _given_flags(argv)
    flag_of = {f.name: f.metadata["flag"] for _, f in config_fields()}
    refusals = _lazy("ladle.engine.config_resolve", "cuda_only_refusals", "the engine")
    return refusals([name for name, flag in flag_of.items() if flag in given], engine_config.model.device,
                    flag_of.__getitem__)


def _server_refusals(server_config: ServerConfig) -> list[str]:
    """The serving flags' refusals (unknown parser names, --stream-interval below 1, a port outside 0-65535), checked
    before anything loads."""
    refusals = _lazy("ladle.server.parsers", "parser_flag_refusals", "the chat output parsers")
    interval = _lazy("ladle.server.stream_chunks", "stream_interval_refusals", "the streaming path")
    port = [] if 0 <= server_config.port <= 65535 else [
        f"--port {server_config.port}: a TCP port is 0-65535 (0 lets the system pick a free one)"]
    return refusals(server_config.tool_call_parser, server_config.reasoning_parser,
                    server_config.enable_auto_tool_choice) + interval(server_config.stream_interval) + port


def raise_open_files_limit(wanted: int = 65536, warn_below: int = 8192) -> None:
    """Raise the soft RLIMIT_NOFILE to min(hard limit, `wanted`) (each client connection holds a descriptor, and a
    MiniMax-M3 prefill/decode run hit the default 1024); warn when it stays below `warn_below`."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard == resource.RLIM_INFINITY else min(hard, max(soft, wanted))
    if soft != resource.RLIM_INFINITY and target != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft, target, e)
    if soft != resource.RLIM_INFINITY and soft < warn_below:
        logger.warning("open-files limit is %d (hard limit %d): fewer than %d concurrent connections fit; raise the "
                       "hard limit (`ulimit -Hn`, or LimitNOFILE= for a service) before starting ladle", soft, hard,
                       soft)
    else:
        logger.info("open-files limit: %s", "unlimited" if soft == resource.RLIM_INFINITY else soft)


STARTUP_STOP_GRACE_S = 10.0  # after a SIGTERM during startup, the longest the startup code may take to stop


def _stop_quietly(signum: int, frame: object) -> None:
    """SIGTERM before uvicorn serves: arm the stop watchdog, then raise KeyboardInterrupt, which `cmd_serve` turns into
    an orderly stop (a core being started is killed by spawn_core's cleanup). The exception alone is not enough:
    Python drops an exception raised inside a finalizer (`__del__`, a weakref callback; it reports it as
    "Exception ignored"), and library code may swallow it in a bare `except:`; the startup then went on to serve
    and the process never stopped (seen once in CI: `ladle serve` alive 60 s after a SIGTERM at "configuration
    accepted"). `_unraisable_interrupt` catches the first case at once, the watchdog the others."""
    global _stop_watchdog
    if _stop_watchdog is None:  # armed once: a second signal finds it running
        _stop_watchdog = threading.Timer(STARTUP_STOP_GRACE_S, _exit_after_grace)
        _stop_watchdog.daemon = True
        _stop_watchdog.start()
    raise KeyboardInterrupt


_stop_watchdog: Optional[threading.Timer] = None


def _exit_after_grace() -> None:
    logger.info("ladle serve: stopped (the startup code had not stopped %.0f s after the signal)",
                STARTUP_STOP_GRACE_S)
    _exit_now(0)


def _unraisable_interrupt(unraisable: "sys.UnraisableHookArgs") -> None:
    """sys.unraisablehook while `ladle serve` runs: a KeyboardInterrupt that Python could not raise (the signal
    arrived inside a finalizer) stops the process as the raised one would; anything else is reported as usual."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        logger.info("ladle serve: stopped")
        _exit_now(0)
    sys.__unraisablehook__(unraisable)


def install_stop_handlers() -> None:
    """SIGTERM -> `_stop_quietly`, and `_unraisable_interrupt` as sys.unraisablehook. Called by `cmd_serve` before its
    first log line, so a signal sent on seeing that line finds them installed."""
    signal.signal(signal.SIGTERM, _stop_quietly)
    sys.unraisablehook = _unraisable_interrupt


def cmd_serve(argv: list[str]) -> int:
    """Never returns: the process ends through `_exit_now` with run_server's status (0 after a stop signal, 1 after
    an error), so the interpreter's exit path, which joins every live non-daemon child process (multiprocessing's
    atexit hook: the engine core is one), can never wait for a core that nobody stopped."""
    parser = serve_parser()
    engine_config, server_config, _ = configs_or_refusal(parser, argv)
    # Ctrl-C and SIGTERM end with status 0 and no traceback, also while the model loads (the server installs its
    # own SIGTERM handler once it serves; uvicorn re-raises Ctrl-C as KeyboardInterrupt when it has shut down).
    install_stop_handlers()
    try:
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        logger.info("ladle serve: configuration accepted (model %s); starting the engine",
                    engine_config.model.model or "the embedded default")
        raise_open_files_limit()
        from ladle.server.api import run_server

        status = run_server(engine_config, server_config)
    except KeyboardInterrupt:
        logger.info("ladle serve: stopped")
        status = 0
    except SystemExit as e:  # run_server's SIGTERM handler, before or after uvicorn served
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:  # noqa: BLE001 — an unexpected error: its traceback, then the same exit path
        logger.exception("ladle serve: failed")
        status = 1
    _exit_now(status)
    return status  # not reached


def _exit_now(status: int) -> None:
    """Flush the logs and stdio, then end the process with `status` without the interpreter's exit path. Why: CPython
    kills itself with SIGINT at exit when it recorded an unhandled KeyboardInterrupt (bpo-1054041), and a signal that
    lands inside nested interpreter code during an import can record one although `cmd_serve` caught it (seen once
    in CI: SIGTERM while `ladle.server.api` was importing gave "stopped" in the log, then exit status -2). By then the
    engine is shut down (serving) or was cleaned up while the exception passed (startup); a core process still
    starting dies with its parent (ladle/runner/worker.die_with_parent)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def cmd_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ladle generate", description="One-shot answer through the offline LLM API.",
                                     allow_abbrev=False)
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0 = greedy)")
    parser.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    add_config_args(parser, include_server=False)
    refuse_serving_flags(parser, "a `ladle serve` flag; `ladle generate` prints the answer here and serves no HTTP API",
                         {"--served-model-name": "`ladle generate` prints the answer here and reports no model name; "
                          "the name is the one `ladle serve`'s HTTP API answers to (`ladle serve MODEL "
                          "--served-model-name NAME`)"})
    parser.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    from ladle.core.sampling_params import SamplingParams

    def sampling_refusals(args: argparse.Namespace) -> list[str]:
        try:
            SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        except ValueError as e:
            return [str(e)]
        return []

    engine_config, _, args = configs_or_refusal(parser, argv, sampling_refusals)
    default_engine_core_process = _lazy("ladle.engine.llm", "default_engine_core_process", "the offline LLM API")
    if not _given_flags(argv) & {"--engine-core-process", "--no-engine-core-process"}:  # the offline API's default
        parallel = dataclasses.replace(engine_config.parallel,
                                       engine_core_process=default_engine_core_process(engine_config.model.device))
        engine_config = dataclasses.replace(engine_config, parallel=parallel)
    LLM = _lazy("ladle.engine.llm", "LLM", "the offline LLM API")
    try:
        with LLM.from_engine_config(engine_config) as llm:
            params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
            if args.raw:
                outputs = llm.generate([llm.tokenizer.encode(args.prompt)], params)
            else:
                outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    except Exception as e:  # load/config errors and refused prompts (RequestRejected) carry user-facing messages
        if env_flag("LADLE_DEBUG"):
            raise
        print(f"ladle generate: error: {e}\n(set LADLE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    print(outputs[0].outputs[0].text)
    return 0


MAKE_CHECKPOINT_HELP = """usage: ladle make-checkpoint {llama,minimax-m3} ...

Write a model directory to serve without downloading weights (tests, benchmarks, sizing runs):
  llama --from-gguf GGUF --config-only OUT
      config.json + tokenizer files read from a GGUF file's header, no weights (serve with --load-format dummy)
  minimax-m3 [--preset P] [--dtype bf16|mxfp8|mxfp4] [--config-only] [--num-layers N] OUT
      a synthetic MiniMax-M3 checkpoint in the release layout: random weights in sharded safetensors (bf16; mxfp8:
      every projection; mxfp4: the experts), config.json, generation_config.json and a tokenizer; --config-only
      writes no weights
`ladle make-checkpoint FAMILY --help` lists each family's flags."""


def _make_checkpoint_help() -> str:
    """MAKE_CHECKPOINT_HELP plus the minimax-m3 presets (from ladle.tools.checkpoint_m3, when it is there)."""
    try:
        presets = importlib.import_module("ladle.tools.checkpoint_m3").preset_summary()
    except ModuleNotFoundError:
        return MAKE_CHECKPOINT_HELP
    return MAKE_CHECKPOINT_HELP + "\n\nminimax-m3 presets:\n" + "\n".join(f"  {line}" for line in presets)


def cmd_make_checkpoint(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_make_checkpoint_help())
        return 0 if argv else 2
    family, rest = argv[0], argv[1:]
    if family == "minimax-m3":
        return _lazy("ladle.tools.checkpoint_m3", "main", "`make-checkpoint minimax-m3`")(rest) or 0
    if family != "llama":
        sys.exit(f"ladle make-checkpoint: unknown family {family!r} (choose llama or minimax-m3)")
    parser = argparse.ArgumentParser(prog="ladle make-checkpoint llama",
                                     description="write config.json + tokenizer files read from a GGUF header")
    parser.add_argument("--from-gguf", required=True, metavar="GGUF", help="the GGUF file to read")
    parser.add_argument("--config-only", required=True, metavar="OUT",
                        help="write config.json + tokenizer files (no weights) into this directory")
    args = parser.parse_args(rest)
    export = _lazy("ladle.models.loader", "export_config_only", "`make-checkpoint llama`")
    export(args.from_gguf, args.config_only)
    print(f"wrote config and tokenizer files to {args.config_only}")
    return 0


def cmd_bench(argv: list[str]) -> int:
    return _lazy("ladle.bench.cli", "main", "`ladle bench`")(argv) or 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench, "make-checkpoint": cmd_make_checkpoint}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ladle {serve,generate,bench,make-checkpoint} ...\n\n" + USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from ladle.server.protocol import ladle_version

        print(ladle_version())
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"ladle: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
