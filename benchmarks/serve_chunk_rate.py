"""API-server streaming capacity over real HTTP: SSE chunks per second and API-server CPU per chunk, no model.

What runs (the path `ladle serve` takes, with only the engine core replaced):
    client process (lean aiohttp, N concurrent streams, /v1/completions, token-id prompts, ignore_eos)
      <-- HTTP on 127.0.0.1 --> API-server process: uvicorn (ladle.server.api.uvicorn_config: the same loop and HTTP
          protocol `ladle serve` gets) + build_app (EdgeMiddleware, FastAPI, the completions handler, SSE) +
          CoreProcessEngine (ladle/engine/core_client.py: ZMQ reader, msgspec decode, OutputProcessor with SmolLM2's
          tokenizer, per-request RequestOutputStream), access log and stats log on (ladle serve's defaults)
      <-- ZMQ ipc, msgpack --> "core" process: the real CoreLoop (ladle/engine/core_process.py) around `FakeCore`,
          which emits one token per running request per step, steps paced at --step-ms (0 = as fast as it can).
This is the most faithful cheap option: everything on the API-server side is the production code (the fake
EngineClient of tests/server/fake_engine.py would skip the ZMQ reader, msgspec and the OutputProcessor); only the
scheduler + model are replaced, and the core process's message loop is the real one.

Each stream's tokens are a slice of a real text's SmolLM2 token ids (starting at the prompt's first id, so the
streams differ); the client checks that every stream's concatenated text equals the tokenizer's decode of those ids
and that it ended with finish_reason "length" (`ok` column; a failed check makes the exit status 1).

Columns: chunks/s = content SSE events (all streams) / wall time of the load; tok/chunk = tokens / content events;
ITL = median gap between a stream's consecutive content events (ms); srv us/chunk = API-server process CPU time
(all its threads, user + system, from /proc) during the load / content events; loop us/chunk = the same for the
event-loop thread alone; gc us/chunk = CPU time of the collector's passes (gc.callbacks) / content events. On a shared
2-core machine run it a few times: the client and the core share the cores.

    /work/main/.venv/bin/python benchmarks/serve_chunk_rate.py --model /work/main/.bench_assets/smollm2-135m \
        --concurrency 1,32,128 --step-ms 10,2.3 --output-len 256 --out /tmp/chunk_rate.json

Reading it: at a step interval the server keeps up with (tok/chunk ~1), srv us/chunk is the API server's cost of one
streamed token end to end (its capacity is about 1e6 / that per core). When it cannot keep up (2.3 ms steps at
N = 128, SmolLM2 on an H200: 55k tokens/s), each stream's backlog is merged into its next chunk: tok/chunk and ITL
grow, chunks/s falls. `--step-ms 0` lets the core run every stream to the end before the server reads much: a drain
test, not a rate.

`--profile DIR` writes a cProfile of the event-loop thread during each load (DIR/prof_<step>_<N>.pstats).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_DIR = os.path.join(ROOT, ".bench_assets/smollm2-135m")
TEXT = ("The engine core runs in its own process; the API server detokenizes, checks stop strings and writes one "
        "server-sent event per chunk. Ladle serves Llama-family models and MiniMax-M3 with paged attention, prefix "
        "caching, chunked prefill and CUDA graphs. Numbers: 3.14159, 2718, 1e-9; symbols: <>, {}, [], (), \"quotes\". ")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="dir with SmolLM2's tokenizer")
    p.add_argument("--concurrency", default="1,32,128")
    p.add_argument("--step-ms", default="10,2.3", help="the fake core's step interval(s), ms (0 = as fast as it can)")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=1, help="requests per stream slot (N * rounds requests per point)")
    p.add_argument("--profile", default=None, help="dir: cProfile the server's loop thread during each load")
    p.add_argument("--out", default="serve_chunk_rate.json")
    p.add_argument("--role", default="main", choices=["main", "server", "client"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    args.rest = rest
    return args


def text_token_ids(tokenizer) -> list[int]:
    return list(tokenizer.encode(TEXT * 6, add_special_tokens=False))


def stream_token_ids(token_ids: list[int], start: int, count: int) -> list[int]:
    """The tokens FakeCore emits for a request whose prompt starts with `start`."""
    return [token_ids[(start + i) % len(token_ids)] for i in range(count)]


# ---------------------------------------------------------------------------------------------- core process
class FakeCore:
    """The EngineCore surface CoreLoop uses; one token per running request per step, paced at `step_s`."""

    def __init__(self, token_ids: list[int], step_s: float) -> None:
        from ladle.core.scheduler import SchedulerStats

        self.token_ids, self.step_s = token_ids, step_s
        self.requests: dict[str, list] = {}  # id -> [start, emitted, max_tokens, num_prompt_tokens]
        self.scheduler = self  # CoreLoop reads core.scheduler.requests
        # no device, so no "device_idle" (absent until measured, as EngineCore has it)
        self.step_host_s = {"schedule": 0.0, "execute": 0.0, "wait": 0.0, "update": 0.0}
        self.num_steps = 0
        self._stats = SchedulerStats()
        self._next = 0.0

    def is_healthy(self) -> bool:
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_child_requests(self, child_ids, prompt_token_ids, params, arrival_time=None) -> list:
        return [(c, [prompt_token_ids[0], 0, params.max_tokens, len(prompt_token_ids)]) for c in child_ids]

    def add_requests(self, requests: list) -> None:
        self.requests.update(requests)

    def step(self) -> list:
        from ladle.core.outputs import EngineOutput

        now = time.perf_counter()
        if now < self._next:
            time.sleep(self._next - now)
        self._next = max(now, self._next) + self.step_s
        outs, ids = [], self.token_ids
        for rid, state in list(self.requests.items()):
            start, emitted, max_tokens, num_prompt = state
            state[1] = emitted + 1
            done = state[1] >= max_tokens
            outs.append(EngineOutput(request_id=rid, new_token_ids=[ids[(start + emitted) % len(ids)]],
                                     finish_reason="length" if done else None, num_prompt_tokens=num_prompt,
                                     queue_time=0.0))
            if done:
                del self.requests[rid]
        self.num_steps += 1
        self._stats.num_running = len(self.requests)
        return outs

    def abort_requests(self, request_ids) -> list:
        from ladle.core.outputs import EngineOutput

        return [EngineOutput(request_id=r, finish_reason="abort") for r in request_ids
                if self.requests.pop(r, None) is not None]

    def finish_processed(self, stop_hits, failed_ids) -> None:
        for rid in [h[0] for h in stop_hits] + list(failed_ids):
            self.requests.pop(rid, None)

    def get_stats(self):
        import copy

        return copy.copy(self._stats)

    def shutdown(self) -> None:
        pass


def run_fake_core(fake: tuple[str, float], input_addr: str, output_addr: str, parent_pid: int,
                  parent_logging: dict) -> None:
    """Spawn target in run_engine_core's place (`fake` = (model_dir, step_s) where it takes the engine config): the
    parent's logging, its sockets and Ready, then the real CoreLoop around FakeCore."""
    import pickle
    import threading

    import zmq
    from transformers import AutoTokenizer

    from ladle.config import EngineConfig, ModelConfig
    from ladle.engine import core_messages as msg
    from ladle.engine.core_process import CoreLoop, apply_logging_setup

    apply_logging_setup(parent_logging)
    model_dir, step_s = fake
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    zctx = zmq.Context()
    inbox, outbox = zctx.socket(zmq.PULL), zctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    inbox.connect(input_addr)
    outbox.connect(output_addr)
    send = lambda m: outbox.send(msg.encoder.encode(m))  # noqa: E731
    core = FakeCore(text_token_ids(tokenizer), step_s)
    loop = CoreLoop(core, inbox, send, threading.Event())
    config = EngineConfig(model=ModelConfig(model=model_dir, max_model_len=8192))
    send(msg.Ready("bench", pickle.dumps(tokenizer), pickle.dumps(config), 8192, loop.stats()))
    loop.run()
    inbox.close(linger=0)
    outbox.close(linger=1000)
    zctx.term()


# ---------------------------------------------------------------------------------------------- server process
def start_engine(model_dir: str, step_s: float):
    """CoreProcessEngine.start (its sockets, spawn and handshake) with `run_fake_core` as the core process."""
    from ladle.engine.core_client import CoreProcessEngine

    return CoreProcessEngine.start((model_dir, step_s), 300, core_target=run_fake_core)


def _thread_cpu_s(tid: int) -> float:
    """User + system CPU seconds of one thread of this process, from /proc (clock ticks)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _GCTimer:
    """Collector passes per generation and their CPU seconds (thread time of the collecting thread), from
    gc.callbacks."""

    def __init__(self) -> None:
        import gc

        self.passes, self.cpu_s, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.thread_time()
        else:
            self.passes[info["generation"]] += 1
            self.cpu_s[info["generation"]] += time.thread_time() - self._t0


def serve(args: argparse.Namespace) -> None:
    """The API-server process: `ladle serve`'s app and uvicorn settings around CoreProcessEngine + the fake core, plus
    one route for the harness (this process's CPU times, the collector's passes, cProfile on / off)."""
    import cProfile
    import threading

    from ladle.config import ServerConfig
    from ladle.server.api import EngineStoppingServer, bind_socket, build_app, uvicorn_config

    engine = start_engine(args.model, float(args.rest[0]) / 1000.0)
    server_config = ServerConfig(port=args.port)
    app = build_app(engine, server_config)
    state: dict = {"prof": None, "gc": _GCTimer()}

    @app.get("/_chunk_rate/cpu")
    async def cpu(profile: str = "") -> dict:
        state.setdefault("loop_tid", threading.get_native_id())
        if profile == "start":
            state["prof"] = cProfile.Profile()
            state["prof"].enable()
        elif profile and state["prof"] is not None:
            state["prof"].disable()
            state["prof"].dump_stats(profile)
            state["prof"] = None
        t = os.times()
        return {"process_s": t.user + t.system, "loop_s": _thread_cpu_s(state["loop_tid"]),
                "gc_passes": list(state["gc"].passes), "gc_cpu_s": sum(state["gc"].cpu_s)}

    sock = bind_socket("127.0.0.1", args.port)
    EngineStoppingServer(uvicorn_config(app, server_config), engine).run(sockets=[sock])


# ---------------------------------------------------------------------------------------------- client process
async def _one_stream(session, url: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    stamps, texts, finish = [], [], None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {await resp.text()}"}
        buf = b""
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            buf += data
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: {"):
                    continue
                choice = json.loads(ev[6:])["choices"][0]
                stamps.append(now)
                texts.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return {"stamps": stamps, "text": "".join(texts), "finish": finish}


async def _load(url: str, concurrency: int, rounds: int, prompt_len: int, output_len: int, token_ids: list[int],
                profile: str) -> dict:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def slot(i: int) -> list[dict]:
            out = []
            for r in range(rounds):
                start = (i * 37 + r * 11) % len(token_ids)
                prompt = [start] + [(start + j) % 1000 + 1 for j in range(prompt_len - 1)]
                res = await _one_stream(session, url, prompt, output_len)
                res["start"] = start
                out.append(res)
            return out

        async def cpu(profile_arg: str = "") -> dict:
            async with session.get(url + "/_chunk_rate/cpu", params={"profile": profile_arg}) as r:
                return await r.json()

        import asyncio

        await asyncio.gather(*(_one_stream(session, url, [1, 2, 3], 8) for _ in range(4)))  # warm connections
        c0 = await cpu("start" if profile else "")
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(slot(i) for i in range(concurrency))) for r in rs]
        wall = time.perf_counter() - t0
        c1 = await cpu(profile or "")
    return {"results": results, "wall_s": wall, "server_cpu_s": c1["process_s"] - c0["process_s"],
            "loop_cpu_s": c1["loop_s"] - c0["loop_s"], "gc_cpu_s": c1["gc_cpu_s"] - c0["gc_cpu_s"],
            "gc_passes": [b - a for a, b in zip(c0["gc_passes"], c1["gc_passes"])]}


def client(args: argparse.Namespace) -> None:
    import asyncio
    import statistics

    from transformers import AutoTokenizer

    url, concurrency, profile = args.rest[0], int(args.rest[1]), args.rest[2] if len(args.rest) > 2 else ""
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    token_ids = text_token_ids(tokenizer)
    run = asyncio.run(_load(url, concurrency, args.rounds, args.prompt_len, args.output_len, token_ids, profile))
    bad, gaps, chunks = [], [], 0
    for res in run["results"]:
        if "error" in res:
            bad.append(res["error"])
            continue
        want = tokenizer.decode(stream_token_ids(token_ids, res["start"], args.output_len))
        if res["text"] != want or res["finish"] != "length":
            bad.append(f"stream from {res['start']}: text ok {res['text'] == want}, finish {res['finish']}")
        chunks += len(res["stamps"])
        gaps += [b - a for a, b in zip(res["stamps"], res["stamps"][1:])]
    tokens = len(run["results"]) * args.output_len
    print(json.dumps({
        "concurrency": concurrency, "requests": len(run["results"]), "tokens": tokens, "chunks": chunks,
        "wall_s": run["wall_s"], "chunks_per_s": chunks / run["wall_s"], "tokens_per_chunk": tokens / max(chunks, 1),
        "median_itl_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "server_cpu_s": run["server_cpu_s"], "server_us_per_chunk": 1e6 * run["server_cpu_s"] / max(chunks, 1),
        "loop_us_per_chunk": 1e6 * run["loop_cpu_s"] / max(chunks, 1),
        "gc_us_per_chunk": 1e6 * run["gc_cpu_s"] / max(chunks, 1), "gc_passes": run["gc_passes"], "ok": not bad,
        "errors": bad[:5]}))


# ---------------------------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not come up")


def run_points(args: argparse.Namespace, step_ms: str, concurrency: list[int]) -> list[dict]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    me = os.path.abspath(__file__)
    common = ["--model", args.model, "--output-len", str(args.output_len), "--prompt-len", str(args.prompt_len),
              "--rounds", str(args.rounds)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    log = open(os.path.join(os.path.dirname(os.path.abspath(args.out)) or ".", f"chunk_rate_server_{step_ms}.log"),
               "w")
    server = subprocess.Popen([sys.executable, me, "--role", "server", "--port", str(port), *common, step_ms],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        _wait_healthy(url, server)
        for n in concurrency:
            prof = os.path.join(os.path.abspath(args.profile), f"prof_{step_ms}_{n}.pstats") if args.profile else ""
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
            out = subprocess.run([sys.executable, me, "--role", "client", *common, url, str(n), prof], env=env,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"client failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["step_ms"] = float(step_ms)
            rows.append(row)
            print(_fmt(row), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return rows


HEADER = (f"{'step ms':>8}{'N':>5}{'chunks':>8}{'chunks/s':>10}{'tok/chunk':>10}{'ITL ms':>8}{'srv us/chunk':>13}"
          f"{'loop us/chunk':>14}{'gc us/chunk':>12}{'ok':>4}")


def _fmt(r: dict) -> str:
    itl = f"{r['median_itl_ms']:>8.2f}" if r["median_itl_ms"] is not None else f"{'-':>8}"
    return (f"{r['step_ms']:>8.1f}{r['concurrency']:>5}{r['chunks']:>8}{r['chunks_per_s']:>10.0f}"
            f"{r['tokens_per_chunk']:>10.2f}{itl}{r['server_us_per_chunk']:>13.1f}{r['loop_us_per_chunk']:>14.1f}"
            f"{r['gc_us_per_chunk']:>12.1f}{'yes' if r['ok'] else 'NO':>4}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role == "server":
        serve(args)
        return 0
    if args.role == "client":
        client(args)
        return 0
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    print(HEADER, flush=True)
    rows = []
    for step_ms in [s for s in args.step_ms.split(",") if s]:
        rows += run_points(args, step_ms, concurrency)
    with open(args.out, "w") as f:
        json.dump({"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
                   "args": {k: v for k, v in vars(args).items() if k not in ("role", "rest", "port")},
                   "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
