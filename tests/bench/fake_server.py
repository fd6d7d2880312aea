"""A scripted, paced fake OpenAI-compatible server for the benchmark's tests (and the AIPerf cross-check).

Runs an aiohttp app on 127.0.0.1 (a free port) in a background thread. Behaviour per completion request:
- If the prompt text contains `SCRIPT{...}`, that JSON decides: `status` (non-200 -> an error body), `hang` (never
  answer), `ttft` (s), `chunks` (tokens per SSE chunk; 0 = a chunk with empty text, as for a special token), `gap` (s between
  chunks), `usage` (send the usage chunk), `ping` (an SSE comment and a choices-less chunk before the first token).
  Chunk j is written at arrival + ttft + j * gap (an absolute schedule: no drift).
- Otherwise the default pacing: `max_tokens` tokens in chunks of `default_chunk` tokens, first after
  `default_ttft`, then every `default_gap` seconds.
Tokenizer: word level, vocabulary `vocab_size`; id i <-> word "w{i}"; any other word maps to crc32(word) mod vocab;
BOS id 0 is the only special token (added by /tokenize with add_special_tokens). /detokenize rejects ids out of
range with 400. A list-of-ints prompt is taken as token ids. Prefix cache: full `block_size` blocks, chained like
vLLM's (a hit needs the whole prefix), unlimited, the last prompt token always recomputed; reported as
usage.prompt_tokens_details.cached_tokens and vllm:prefix_cache_{queries,hits} in /metrics.
Every request body is appended to `self.requests` with its arrival and finish times (perf_counter).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import zlib
from typing import Any

from aiohttp import web

_SCRIPT = re.compile(r"SCRIPT(\{.*?\})")


class FakeServer:
    def __init__(self, vocab_size: int = 1000, block_size: int = 16, max_model_len: int = 100_000,
                 default_ttft: float = 0.005, default_gap: float = 0.001, default_chunk: int = 16) -> None:
        self.vocab_size, self.block_size, self.max_model_len = vocab_size, block_size, max_model_len
        self.default_ttft, self.default_gap, self.default_chunk = default_ttft, default_gap, default_chunk
        self.requests: list[dict[str, Any]] = []
        self.cache: set[int] = set()
        self.queries = self.hits = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ---- tokenizer -------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w.startswith("w") and w[1:].isdigit() and int(w[1:]) < self.vocab_size:
                ids.append(int(w[1:]))
            else:
                ids.append(zlib.crc32(w.encode()) % self.vocab_size)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    # ---- handlers --------------------------------------------------------------------------------------------
    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "root": "fake-root"}]})

    async def _version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": "fake-0", "config": {"cache": {"block_size": self.block_size},
                                                                   "model": {"vocab_size": self.vocab_size,
                                                                             "max_model_len": self.max_model_len}}})

    async def _metrics(self, _: web.Request) -> web.Response:
        text = (f"# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{{model_name=\"f\"}} "
                f"{float(self.queries)}\nvllm:prefix_cache_hits_total{{model_name=\"f\"}} {float(self.hits)}\n")
        return web.Response(text=text)

    async def _tokenize(self, req: web.Request) -> web.Response:
        body = await req.json()
        ids = self.encode(body.get("prompt", ""))
        if body.get("add_special_tokens", True):
            ids = [0] + ids
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def _detokenize(self, req: web.Request) -> web.Response:
        ids = (await req.json())["tokens"]
        if any(i < 0 or i >= self.vocab_size for i in ids):
            return web.json_response({"error": {"message": "token id out of range"}}, status=400)
        return web.json_response({"prompt": self.decode(ids)})

    def _cached_tokens(self, ids: list[int]) -> int:
        b = self.block_size
        keys, k = [], 0
        for j in range(len(ids) // b):
            k = hash((k, tuple(ids[j * b:(j + 1) * b])))
            keys.append(k)
        common = 0
        while common < len(keys) and keys[common] in self.cache:
            common += 1
        self.cache.update(keys)
        hit = min(common * b, (len(ids) - 1) // b * b)
        self.queries += len(ids)
        self.hits += hit
        return hit

    async def _completions(self, req: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        body = await req.json()
        record = {"body": body, "arrival": arrival, "finish": None}
        self.requests.append(record)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        ids = prompt if isinstance(prompt, list) else self.encode(prompt)
        m = _SCRIPT.search(prompt) if isinstance(prompt, str) else None
        script = json.loads(m.group(1)) if m else {}
        if script.get("hang"):
            await asyncio.sleep(3600)
        status = script.get("status", 200)
        if status != 200:
            return web.json_response({"error": {"message": "scripted failure", "code": status}}, status=status)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        chunks = script.get("chunks")
        if chunks is None:
            n, c = max_tokens, self.default_chunk
            chunks = [min(c, n - i) for i in range(0, n, c)]
        ttft, gap = script.get("ttft", self.default_ttft), script.get("gap", self.default_gap)
        cached = self._cached_tokens(ids)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        obj = "chat.completion.chunk" if chat else "text_completion"
        if script.get("ping"):  # an SSE comment and a role-only chat-style chunk without choices: not a token
            await resp.write(b": ping\n\n")
            await resp.write(f"data: {json.dumps({'id': 'x', 'object': obj, 'choices': []})}\n\n".encode())
        for j, k in enumerate(chunks):
            wait = arrival + ttft + j * gap - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            text = "".join(f" w{(7 * j + t) % self.vocab_size}" for t in range(k))
            last = j == len(chunks) - 1
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            choice["finish_reason"] = "length" if last else None
            chunk = {"id": "x", "object": obj, "created": 0, "model": body.get("model"), "choices": [choice]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if script.get("usage", True):
            usage = {"prompt_tokens": len(ids), "completion_tokens": sum(chunks),
                     "total_tokens": len(ids) + sum(chunks), "prompt_tokens_details": {"cached_tokens": cached}}
            chunk = {"id": "x", "object": obj, "created": 0, "model": body.get("model"), "choices": [], "usage": usage}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        record["finish"] = time.perf_counter()
        await resp.write_eof()
        return resp

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def _app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        return app

    def start(self, port: int = 0) -> "FakeServer":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=0.5)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", port)
            self._loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        async def shutdown() -> None:
            await self._runner.cleanup()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        fut = asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        try:
            fut.result(5)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


if __name__ == "__main__":  # standalone, for the AIPerf cross-check: prints its base URL, runs until killed
    import argparse

    ap = argparse.ArgumentParser(description="paced fake OpenAI server")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ttft", type=float, default=0.005, help="seconds to the first chunk")
    ap.add_argument("--gap", type=float, default=0.001, help="seconds between chunks")
    ap.add_argument("--chunk", type=int, default=16, help="tokens per chunk")
    ap.add_argument("--vocab-size", type=int, default=1000)
    a = ap.parse_args()
    srv = FakeServer(vocab_size=a.vocab_size, default_ttft=a.ttft, default_gap=a.gap, default_chunk=a.chunk)
    srv.start(a.port)
    print(srv.base_url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        srv.stop()
