"""`ladle bench serve|sweep` argument parsing. Flag names and defaults are vLLM's `vllm bench serve` ones
(`vllm/benchmarks/serve.py`, `vllm/benchmarks/datasets/arg_utils.py`); ladle's additions are grouped separately.

Entry point: `main(argv)`, wired by `ladle bench ...` and `python -m ladle bench ...`; argv excludes "bench".
Exit codes: 0 success (server errors are counted in the result, not a failure), 2 bad flags, 1 the benchmark could
not start (server unreachable, no workload).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid

import aiohttp


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"],
                   help="openai and vllm: /v1/completions (vllm = with vLLM's extensions such as ignore_eos); "
                        "openai-chat: /v1/chat/completions")
    p.add_argument("--label", default=None, help="result label (prefix of the file name); default the backend")
    p.add_argument("--base-url", default=None, help="server base URL, instead of --host/--port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default /v1/completions (/v1/chat/completions for openai-chat)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--model", default=None, help="model id; default the first of the server's /v1/models")
    p.add_argument("--served-model-name", default=None, help="model name sent in requests; default --model")
    p.add_argument("--tokenizer", default=None, help="local tokenizer directory; default the server's /tokenize")
    p.add_argument("--tokenizer-mode", default="auto", help="accepted for compatibility; ignored")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted for compatibility; ignored")
    p.add_argument("--input-len", type=int, default=None, help="maps to --random-input-len")
    p.add_argument("--output-len", type=int, default=None, help="maps to --random/--sharegpt/--custom-output-len")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "custom", "agentic"])
    d.add_argument("--dataset-path", default=None)
    d.add_argument("--num-prompts", type=int, default=1000, help="requests (agentic: sessions)")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0)
    d.add_argument("--random-range-mode", default="vllm", choices=["vllm", "inferencex"],
                   help="vllm: lengths in [L(1-r), L(1+r)]; inferencex: [rL, L] (InferenceX/SGLang)")
    d.add_argument("--random-prefix-len", type=int, default=0)
    d.add_argument("--sharegpt-output-len", type=int, default=None)
    d.add_argument("--custom-output-len", type=int, default=256)
    d.add_argument("--skip-chat-template", action="store_true")
    d.add_argument("--disable-shuffle", action="store_true")
    d.add_argument("--no-oversample", action="store_true")
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=float("inf"))
    t.add_argument("--burstiness", type=float, default=1.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--num-warmups", type=int, default=0)
    t.add_argument("--ignore-eos", action="store_true")
    t.add_argument("--disable-tqdm", action="store_true")
    t.add_argument("--ready-check-timeout-sec", type=int, default=0)
    t.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-")
    t.add_argument("--header", metavar="KEY=VALUE", nargs="*", help="extra request headers")
    r = p.add_argument_group("results")
    r.add_argument("--percentile-metrics", default=None, help='default "ttft,tpot,itl"')
    r.add_argument("--metric-percentiles", default="99")
    r.add_argument("--goodput", nargs="+", default=None, metavar="KEY:VALUE")
    r.add_argument("--save-result", action="store_true")
    r.add_argument("--save-detailed", action="store_true", help="accepted; per-request arrays are always saved")
    r.add_argument("--metadata", metavar="KEY=VALUE", nargs="*")
    r.add_argument("--result-dir", default=None)
    r.add_argument("--result-filename", default=None)
    s = p.add_argument_group("sampling parameters")
    for name, typ in (("top-p", float), ("top-k", int), ("min-p", float), ("temperature", float),
                      ("frequency-penalty", float), ("presence-penalty", float), ("repetition-penalty", float)):
        s.add_argument(f"--{name}", type=typ, default=None)
    s.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    lad = p.add_argument_group("ladle")
    lad.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request (vLLM: 6 h)")
    lad.add_argument("--num-gpus", type=int, default=1, help="GPUs behind the server, for throughput per GPU")
    lad.add_argument("--max-model-len", type=int, default=None,
                     help="agentic: drop requests with input+output above it (default: the server's)")
    lad.add_argument("--agentic-length-scale", type=float, default=1.0, help="tokens per trace block = round(64 s)")
    lad.add_argument("--agentic-think-time-scale", type=float, default=1.0, help="0 = no think time")
    lad.add_argument("--agentic-block-size", type=int, default=None, help="server KV block size (default /version)")
    lad.add_argument("--agentic-vocab-size", type=int, default=None)
    lad.add_argument("--agentic-salt", type=int, default=None, help="fix the token salt (default random per run)")
    rep = p.add_argument_group("bottleneck report and correctness gate (ladle/bench/bottleneck.py, gate.py)")
    rep.add_argument("--report", default=None, metavar="DIR",
                     help="write DIR/report.md (five sections + Correctness), report.json and PNG plots from the "
                          "server's /debug/shapes, /debug/dispatch and /debug/steps before and after the load")
    rep.add_argument("--gate", nargs="+", default=None, metavar="SPEC",
                     help="correctness gate before and after the load: gsm8k[:N] (needs --gate-data) or reference FILE")
    rep.add_argument("--gate-data", default=None, metavar="PATH", help="GSM8K JSONL (first 5 records: the shots)")
    rep.add_argument("--gate-max-tokens", type=int, default=256, help="gsm8k: most tokens per answer (lm-eval: 256)")
    rep.add_argument("--save-gate", default=None, metavar="FILE",
                     help="write greedy continuations of the gate's fixed prompts (for a later --gate reference FILE)")


def finalize_args(args: argparse.Namespace) -> argparse.Namespace:
    """vLLM's post-processing: general length flags, random datasets force ignore_eos. Raises ValueError."""
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.custom_output_len = args.output_len
    if args.dataset_name in ("random", "agentic"):
        args.ignore_eos = True  # vLLM forces it for random; AgentX replays recorded output counts
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be greater than 0")
    if args.dataset_name == "agentic" and args.backend == "openai-chat":
        raise ValueError("agentic replay sends token-id prompts: use --backend openai or vllm (/v1/completions)")
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    if args.num_prompts <= 0:
        raise ValueError("--num-prompts must be positive")
    from ladle.bench.gate import parse_gate
    from ladle.bench.metrics import parse_goodput

    parse_gate(args.gate)

    parse_goodput(args.goodput)
    return args


def build_parser() -> argparse.ArgumentParser:
    from ladle.bench.sweep import add_sweep_args

    parser = argparse.ArgumentParser(prog="ladle bench", description="Serving benchmarks (vLLM-compatible).")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="benchmark a running OpenAI-compatible server")
    add_serve_args(serve)
    sweep = sub.add_parser("sweep", help="`serve` over a list of concurrencies, with a table and a plot")
    add_serve_args(sweep)
    add_sweep_args(sweep)
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        finalize_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        if args.command == "serve":
            from ladle.bench.serve import run_serve

            asyncio.run(run_serve(args, list(argv)))
        else:
            from ladle.bench.sweep import run_sweep

            run_sweep(args, list(argv))
    except (ValueError, RuntimeError, OSError, aiohttp.ClientError) as e:
        print(f"ladle bench: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
