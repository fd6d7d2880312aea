"""API-server output path, no model: host time per streamed token from the core's step message to SSE bytes.

Drives the code `ladle serve` runs on its event loop for every engine step, with nothing stubbed between:
    msgspec decode of the core's StepOutputs -> CoreProcessEngine._handle (OutputProcessor: detokenization, stop
    strings; per-request delivery) -> the request's `generate` iterator -> merge_runs -> the endpoint's streaming
    generator (chunk building, JSON, SSE framing) -> the bytes Starlette's StreamingResponse would send.
The CoreProcessEngine is built around a stand-in process (always alive) and a sink socket (counts what would go to
the core); the core's messages are made up: B concurrent streams (`n` = 1, greedy, ignore_eos), each fed one token
per step for --output-len steps (SmolLM2's tokenizer; the tokens are a real text's, so detokenization sees real
merges), the last step finishing every stream with "length". After each step the loop runs until every stream has
consumed its output (consumers keep up, as in a healthy server), so every step is one chunk per stream.

Columns (µs): per_token = CPU time of the loop's thread over all steps / (B * output_len) (thread CPU time, so other
processes on a shared machine do not count; the JSON has wall time too); per_chunk = the same / SSE events written;
engine = decode + _handle (OutputProcessor + delivery), serve = the rest (wake-ups, merge_runs, chunks, JSON, SSE).
Not included: uvicorn/h11 writing the bytes, the HTTP client, the core process.

`--compare-tree DIR` measures each point in fresh interpreters alternating PYTHONPATH=DIR (e.g. main's ladle from
`git archive main ladle | tar -x -C DIR`) and this checkout, `--repeats` times each, and prints both tables (the best
of the repeats) and the before/after ratio.

    .venv/bin/python benchmarks/serve_output_path.py --model .bench_assets/smollm2-135m --out /tmp/out_path.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

DEFAULT_MODEL_DIR = ".bench_assets/smollm2-135m"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("The engine core runs in its own process; the API server detokenizes, checks stop strings and writes one "
        "server-sent event per chunk. Ladle serves Llama-family models and MiniMax-M3 with paged attention, prefix "
        "caching, chunked prefill and CUDA graphs. Numbers: 3.14159, 2718, 1e-9; symbols: <>, {}, [], (), \"quotes\". ")
COLUMNS = ["per_token", "per_chunk", "engine", "serve"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="dir with SmolLM2's tokenizer (+ chat template)")
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--endpoints", default="completions,chat")
    p.add_argument("--logprobs", type=int, default=None, help="also ask for this many top logprobs per token")
    p.add_argument("--stream-interval", type=int, default=1, help="--stream-interval of the server (this tree)")
    p.add_argument("--repeats", type=int, default=3, help="runs per point; the best is reported")
    p.add_argument("--compare-tree", default=None, help="also measure the ladle package under this dir (before)")
    p.add_argument("--label", default="current")
    p.add_argument("--out", default="serve_output_path.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.endpoints = [e for e in args.endpoints.split(",") if e]
    return args


# ---------------------------------------------------------------------------------------------- one measurement
class _AliveProc:
    """The core process stand-in: always alive (CoreProcessEngine checks `is_alive()` for health)."""

    exitcode = None
    pid = None

    def is_alive(self) -> bool:
        return True


class _Sink:
    """The to-core socket stand-in: counts the messages the API side sends (FinishProcessed, aborts)."""

    def __init__(self) -> None:
        self.sent = 0

    def send(self, data: bytes, flags: int = 0) -> None:
        self.sent += 1


def _server_config(stream_interval: int):
    import dataclasses

    from ladle.config import ServerConfig

    names = {f.name for f in dataclasses.fields(ServerConfig)}
    return ServerConfig(stream_interval=stream_interval) if "stream_interval" in names else ServerConfig()


def _build(tokenizer, model_dir: str, stream_interval: int):
    import pickle

    from ladle.config import EngineConfig, ModelConfig
    from ladle.engine import core_messages as msg
    from ladle.engine.core_client import CoreProcessEngine
    from ladle.server.metrics import ServerMetrics
    from ladle.server.serving_chat import ChatHandler
    from ladle.server.serving_common import ServingContext
    from ladle.server.serving_completions import CompletionHandler

    ready = msg.Ready(model_name="bench", tokenizer=pickle.dumps(tokenizer), max_model_len=8192,
                      engine_config=pickle.dumps(EngineConfig(model=ModelConfig(model=model_dir, max_model_len=8192))))
    engine = CoreProcessEngine(_AliveProc(), None, _Sink(), None, "", ready)
    metrics = ServerMetrics(engine.get_stats, engine.model_name, 8192)
    ctx = ServingContext(engine, metrics, limits=_server_config(stream_interval))
    return engine, ctx, CompletionHandler(ctx), ChatHandler(ctx)


def _request(endpoint: str, prompt_ids: list[int], output_len: int, logprobs):
    from ladle.server.protocol import ChatCompletionRequest, CompletionRequest

    common = dict(max_tokens=output_len, stream=True, ignore_eos=True, temperature=0.0)
    if endpoint == "completions":
        return CompletionRequest(prompt=prompt_ids, logprobs=logprobs, **common)
    return ChatCompletionRequest(messages=[{"role": "user", "content": TEXT[:200]}], logprobs=logprobs is not None,
                                 top_logprobs=logprobs, **common)


def _step_messages(engine, parent_ids: list[str], token_ids: list[int], output_len: int, logprobs) -> list[bytes]:
    """The core's StepOutputs for every step, msgpack-encoded as the core sends them (one per step, all streams)."""
    from ladle.core.outputs import EngineOutput
    from ladle.engine import core_messages as msg

    stats = {"num_running": len(parent_ids), "num_waiting": 0, "kv_cache_usage": 0.25, "num_free_blocks": 100,
             "num_total_blocks": 1000}
    children = [c for pid in parent_ids for c in engine._processor.child_ids(pid)]
    steps = []
    for step in range(output_len):
        outs = []
        for k, child in enumerate(children):
            tid = token_ids[(step + 7 * k) % len(token_ids)]
            lps = None
            if logprobs is not None:
                lps = [[(tid, -0.25, 1)] + [((tid + j) % 49152, -1.0 - j, j + 1) for j in range(1, logprobs + 1)]]
            outs.append(EngineOutput(request_id=child, new_token_ids=[tid], new_logprobs=lps,
                                     finish_reason="length" if step == output_len - 1 else None,
                                     num_prompt_tokens=64))
        steps.append(msg.encoder.encode(msg.StepOutputs(outputs=outs, stats=stats)))
    return steps


def _pending(engine) -> bool:
    return any(not q.empty() for q in engine._streams.values())


async def _run_point(tokenizer, model_dir: str, endpoint: str, batch: int, output_len: int, logprobs,
                     stream_interval: int) -> dict:
    import asyncio
    import gc

    from ladle.engine import core_messages as msg

    engine, ctx, completions, chat = _build(tokenizer, model_dir, stream_interval)
    loop = asyncio.get_running_loop()
    engine._reader = loop.create_future()  # never done: the benchmark feeds `_handle` itself, no socket reader
    handler = completions if endpoint == "completions" else chat
    token_ids = tokenizer.encode(TEXT * 4, add_special_tokens=False)
    counts = {"events": 0, "bytes": 0}

    async def consume(i: int) -> None:
        req = _request(endpoint, token_ids[i % 50:i % 50 + 64], output_len, logprobs)
        response = await handler.handle(req, None)
        async for piece in response.body_iterator:  # what StreamingResponse sends: str is encoded to UTF-8
            data = piece if isinstance(piece, (bytes, bytearray, memoryview)) else piece.encode("utf-8")
            counts["events"] += bytes(data).count(b"data: ")
            counts["bytes"] += len(data)

    tasks = [asyncio.ensure_future(consume(i)) for i in range(batch)]
    while len(engine._acks) < batch:  # prepared (tokenized off the loop) and sent to the "core"
        await asyncio.sleep(0.001)
    parent_ids = list(engine._acks)
    for pid in parent_ids:
        engine._handle(msg.AddAck(pid))
    await asyncio.sleep(0)
    steps = _step_messages(engine, parent_ids, token_ids, output_len, logprobs)
    decode, handle = msg.from_core_decoder.decode, engine._handle
    gc.collect()
    engine_s = 0.0
    clock = time.thread_time  # CPU time of this thread: the loop's work, not other processes' on a shared machine
    t0, w0 = clock(), time.perf_counter()
    for raw in steps:
        e0 = clock()
        handle(decode(raw))
        engine_s += clock() - e0
        while _pending(engine):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    cpu, wall = clock() - t0, time.perf_counter() - w0
    ctx.executor.shutdown(wait=False)
    tokens = batch * output_len
    return {"endpoint": endpoint, "batch": batch, "output_len": output_len, "logprobs": logprobs,
            "stream_interval": stream_interval, "tokens": tokens, "events": counts["events"], "bytes": counts["bytes"],
            "cpu_s": cpu, "wall_s": wall, "per_token": 1e6 * cpu / tokens,
            "per_chunk": 1e6 * cpu / max(counts["events"], 1), "engine": 1e6 * engine_s / tokens,
            "serve": 1e6 * (cpu - engine_s) / tokens, "wall_per_token": 1e6 * wall / tokens}


def measure(args: argparse.Namespace) -> list[dict]:
    import asyncio

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = []
    for endpoint in args.endpoints:  # warm-up: first-call imports and caches stay out of the first point
        asyncio.run(_run_point(tokenizer, args.model, endpoint, 2, 8, args.logprobs, args.stream_interval))
    for endpoint in args.endpoints:
        for batch in args.batch_sizes:
            best = None
            for _ in range(args.repeats):
                row = asyncio.run(_run_point(tokenizer, args.model, endpoint, batch, args.output_len, args.logprobs,
                                             args.stream_interval))
                if best is None or row["per_token"] < best["per_token"]:
                    best = row
            rows.append(best)
    return rows


# ---------------------------------------------------------------------------------------------- driver
def _worker_rows(args: argparse.Namespace, tree: str, stream_interval: int) -> list[dict]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--model", os.path.abspath(args.model),
            "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--output-len", str(args.output_len),
            "--endpoints", ",".join(args.endpoints), "--repeats", "1", "--stream-interval", str(stream_interval)]
    if args.logprobs is not None:
        argv += ["--logprobs", str(args.logprobs)]
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _best(runs: list[list[dict]]) -> list[dict]:
    best: dict = {}
    for rows in runs:
        for r in rows:
            key = (r["endpoint"], r["batch"])
            if key not in best or r["per_token"] < best[key]["per_token"]:
                best[key] = r
    return list(best.values())


def table(title: str, rows: list[dict]) -> str:
    lines = [title, f"{'endpoint':<12}{'B':>5}{'events':>8}" + "".join(f"{c + ' us':>14}" for c in COLUMNS)]
    for r in rows:
        lines.append(f"{r['endpoint']:<12}{r['batch']:>5}{r['events']:>8}"
                     + "".join(f"{r[c]:>14.2f}" for c in COLUMNS))
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not os.environ.get("PYTHONPATH"):
        sys.path.insert(0, ROOT)  # this checkout's ladle, not an installed one
    if args.worker:
        print(json.dumps(measure(args)))
        return
    result = {"host": platform.node(), "python": platform.python_version(), "args": {
        k: v for k, v in vars(args).items() if k != "worker"}, "tables": {}}
    if args.compare_tree:
        before, after = [], []
        for _ in range(args.repeats):  # alternate, so drift of a shared machine hits both alike
            before.append(_worker_rows(args, os.path.abspath(args.compare_tree), 1))
            after.append(_worker_rows(args, ROOT, args.stream_interval))
        result["tables"]["before"], result["tables"][args.label] = _best(before), _best(after)
        print(table(f"before ({args.compare_tree})", result["tables"]["before"]))
        print(table(f"{args.label} (this checkout, --stream-interval {args.stream_interval})",
                    result["tables"][args.label]))
        print("after / before, per token: " + ", ".join(
            f"{a['endpoint']} B={a['batch']}: {a['per_token'] / b['per_token']:.2f}"
            for a, b in zip(result["tables"][args.label], result["tables"]["before"])))
    else:
        result["tables"][args.label] = measure(args)
        print(table(f"{args.label} (--stream-interval {args.stream_interval})", result["tables"][args.label]))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
