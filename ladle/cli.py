"""The `ladle` command (also `python -m ladle`): argument wiring only.

    ladle serve [MODEL] [flags]                 OpenAI-compatible server (flags: `ladle serve --help`)
    ladle generate "PROMPT" [flags]             one-shot answer through the offline LLM API
    ladle bench ...                             load generator (ladle.bench.cli)
    ladle make-checkpoint llama --from-gguf GGUF --config-only OUT
    ladle make-checkpoint minimax-m3 ...        (ladle.tools.checkpoint_m3)

Subcommands owned by other modules are imported lazily, so a missing module fails with a clear message
instead of breaking the whole command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, Optional

from ladle.cli_args import add_config_args, configs_from_args, parse_serve_args
from ladle.config import env_flag

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
    parser = argparse.ArgumentParser(prog=prog, description="Serve a model over an OpenAI-compatible HTTP API.")
    add_config_args(parser)
    parser.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL (vLLM's form)")
    return parser


def _resolve_model(args: argparse.Namespace) -> None:
    if args.model_flag is not None:
        if args.model__model not in (None, args.model_flag):
            sys.exit("ladle: give the model once (positional MODEL or --model), not two different ones")
        args.model__model = args.model_flag


def cmd_serve(argv: list[str]) -> int:
    parser = serve_parser()
    args = parse_serve_args(parser, argv)
    _resolve_model(args)
    engine_config, server_config = configs_from_args(args)
    from ladle.server.api import run_server

    return run_server(engine_config, server_config)


def cmd_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ladle generate", description="One-shot answer through the offline LLM API.")
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    parser.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0 = greedy)")
    parser.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    add_config_args(parser, include_server=False)
    parser.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    args = parse_serve_args(parser, argv)
    _resolve_model(args)
    engine_config, _ = configs_from_args(args)
    from ladle.core.sampling_params import SamplingParams

    LLM = _lazy("ladle.engine.llm", "LLM", "the offline LLM API")
    build_engine = _lazy("ladle.engine.engine_factory", "build_engine", "the engine")
    try:
        llm = LLM(bundle=build_engine(engine_config))
    except Exception as e:  # load/config errors carry user-facing messages
        if env_flag("LADLE_DEBUG"):
            raise
        print(f"ladle generate: error: {e}\n(set LADLE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    tokenizer = llm.tokenizer
    if args.raw:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        from ladle.engine.tokenizer import apply_chat_template

        prompt_ids = apply_chat_template(tokenizer, [{"role": "user", "content": args.prompt}])
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    outputs = llm.generate([prompt_ids], params)
    print(outputs[0].outputs[0].text)
    return 0


def cmd_make_checkpoint(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ladle make-checkpoint {llama,minimax-m3} ...")
        return 0 if argv else 2
    family, rest = argv[0], argv[1:]
    if family == "minimax-m3":
        return _lazy("ladle.tools.checkpoint_m3", "main", "`make-checkpoint minimax-m3`")(rest) or 0
    if family != "llama":
        sys.exit(f"ladle make-checkpoint: unknown family {family!r} (choose llama or minimax-m3)")
    parser = argparse.ArgumentParser(prog="ladle make-checkpoint llama")
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
