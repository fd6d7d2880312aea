"""`ladle bench serve`: warm-up, load generation, measurement, result JSON.

Load generation (bench_methodology.md §1.4): with `--request-rate inf` every request is issued at once and
`--max-concurrency C` (an asyncio semaphore, plus the connector limit) makes it a closed loop of C users; with a
finite rate, gaps follow Gamma(shape=burstiness, scale=1/(rate*burstiness)) from default_rng(seed), the cumulative
schedule rescaled so the last arrival lands at N/rate. Time spent waiting for the semaphore is `client_queue_time`,
outside TTFT and E2EL. Warm-up: `--num-warmups` copies of the first request under the same cap, discarded; the
timer for `duration` starts after them and stops when the last main request ends.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from ladle.bench import agentic, bottleneck, report, server_info
from ladle.bench.agentic_replay import replay
from ladle.bench.metrics import usage_prefix_hit_rate
from ladle.bench.request import RequestInput, RequestOutput, send_request
from ladle.bench.workload import Workload, build_workload


def resolve_urls(args: argparse.Namespace) -> tuple[str, str]:
    """(base_url, api_url); the endpoint defaults to /v1/chat/completions for openai-chat, else /v1/completions."""
    base = args.base_url.rstrip("/") if args.base_url else f"http://{args.host}:{args.port}"
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    return base, base + endpoint


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each of n requests is released (vLLM's get_request schedule)."""
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    cum = np.cumsum(gaps)
    if n and cum[-1] > 0:
        cum *= (n / rate) / cum[-1]
    return cum.tolist()


def extra_body(args: argparse.Namespace) -> dict[str, Any]:
    sampling = {k: getattr(args, k) for k in ("top_p", "top_k", "min_p", "temperature", "frequency_penalty",
                                             "presence_penalty", "repetition_penalty") if getattr(args, k) is not None}
    return {**sampling, **(args.extra_body or {})}


class Runner:
    """Holds the session and the request template for one run."""

    def __init__(self, args: argparse.Namespace, session: aiohttp.ClientSession, base_url: str, api_url: str,
                 model: str) -> None:
        self.args, self.session, self.base_url, self.api_url, self.model = args, session, base_url, api_url, model
        self.metrics_before: dict | None = None  # /metrics scraped after warm-up, just before the timed run
        self.body = extra_body(args) or None
        self.headers = dict(h.split("=", 1) for h in (args.header or []) if "=" in h) or None

    def make_input(self, prompt: str | list[int], prompt_len: int, output_len: int, request_id: str) -> RequestInput:
        return RequestInput(prompt=prompt, prompt_len=prompt_len, output_len=output_len, model=self.model,
                            api_url=self.api_url, chat=self.args.backend == "openai-chat",
                            ignore_eos=self.args.ignore_eos, extra_body=self.body,
                            request_id=self.args.request_id_prefix + request_id, extra_headers=self.headers)

    async def send(self, inp: RequestInput) -> RequestOutput:
        return await send_request(inp, self.session, self.args.request_timeout)

    async def ready_check(self, inp: RequestInput) -> None:
        """vLLM's --ready-check-timeout-sec: retry one request until it succeeds. Raises RuntimeError on timeout."""
        deadline = time.perf_counter() + self.args.ready_check_timeout_sec
        while True:
            out = await self.send(inp)
            if out.success:
                return
            if time.perf_counter() > deadline:
                raise RuntimeError(f"server not ready: {out.error}")
            await asyncio.sleep(1.0)

    async def warmup(self, inp: RequestInput) -> list[RequestOutput]:
        n = self.args.num_warmups
        if n <= 0:
            return []
        sem = asyncio.Semaphore(self.args.max_concurrency or n)
        bar = tqdm(total=n, desc="warmup", disable=self.args.disable_tqdm)

        async def one() -> RequestOutput:
            async with sem:
                out = await self.send(inp)
            bar.update(1)
            return out

        outs = await asyncio.gather(*(one() for _ in range(n)))
        bar.close()
        return list(outs)

    async def run_fixed(self, inputs: list[RequestInput]) -> tuple[list[RequestOutput], float]:
        """The main run for random/sharegpt/custom; returns (outputs in request order, duration s)."""
        a = self.args
        sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        bar = tqdm(total=len(inputs), desc="benchmark", disable=a.disable_tqdm)

        async def limited(inp: RequestInput, arrival: float) -> RequestOutput:
            if sem is None:
                out = await self.send(inp)
            else:
                async with sem:
                    out = await self.send(inp)
            out.client_queue_time = out.start_time - arrival
            bar.update(1)
            return out

        offsets = arrival_offsets(len(inputs), a.request_rate, a.burstiness, a.seed)
        self.metrics_before = await server_info.get_metrics(self.session, self.base_url)
        t0 = time.perf_counter()
        tasks = []
        for inp, off in zip(inputs, offsets):
            wait = t0 + off - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(limited(inp, time.perf_counter())))
        outs = await asyncio.gather(*tasks)
        dur = time.perf_counter() - t0
        bar.close()
        return list(outs), dur


async def _run_agentic(runner: Runner, wl: Workload) -> tuple[list[RequestOutput], float, dict[str, Any]]:
    a = runner.args
    synth = agentic.TokenSynth(wl.vocab_size or 32000, a.seed, wl.info["salt"])
    leaves = [r for r in agentic.replay_order(wl.sessions) if not r.dropped]
    if not leaves:
        raise ValueError("every agentic request is longer than --max-model-len; lower --agentic-length-scale")
    warm_synth = agentic.TokenSynth(wl.vocab_size or 32000, a.seed, wl.info["salt"] + 1)  # shares no prefix
    first = leaves[0]
    await runner.warmup(runner.make_input(warm_synth.prompt(first), first.input_len, first.output_len, "warmup"))
    bar = tqdm(total=len(leaves), desc="agentic", disable=a.disable_tqdm)

    async def send(r: agentic.AgenticRequest) -> RequestOutput:
        out = await runner.send(runner.make_input(synth.prompt(r), r.input_len, r.output_len, f"{r.serial}"))
        bar.update(1)
        return out

    runner.metrics_before = await server_info.get_metrics(runner.session, runner.base_url)
    t0 = time.perf_counter()
    pairs = await replay(wl.sessions, send, a.max_concurrency, a.agentic_think_time_scale)
    dur = time.perf_counter() - t0
    bar.close()
    stats = agentic.workload_stats(wl.sessions, a.agentic_block_size or wl.info.get("server_block_size"))
    stats.update(think_time_scale=a.agentic_think_time_scale, length_scale=a.agentic_length_scale,
                 max_model_len=wl.info.get("max_model_len"), salt=wl.info["salt"],
                 achieved_hit_rate_usage=usage_prefix_hit_rate([o for _, o in pairs]), trace_path=wl.info["trace_path"])
    return [o for _, o in pairs], dur, stats


async def run_serve(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    """One benchmark run; returns the result dict (vLLM fields + "ladle") and saves it if asked. Raises ValueError
    or RuntimeError for unusable flags or an unreachable server before the run starts."""
    base_url, api_url = resolve_urls(args)
    limit = 0 if args.dataset_name == "agentic" else (args.max_concurrency or 0)
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        refused = await server_info.connection_refused(session, base_url)
        if refused:  # said up front; the run still goes on (and counts every request as a connection error)
            print(f"ladle bench: warning: {refused}; every request will fail", file=sys.stderr)
        if args.model is None:
            model_name, model_id = await server_info.first_model(session, base_url)
        else:
            model_id, model_name = args.model, args.served_model_name or args.model
        version = await server_info.get_json(session, f"{base_url}/version")
        metrics_start = await server_info.get_metrics(session, base_url)
        try:
            wl = await asyncio.to_thread(build_workload, args, base_url, model_name, version)
        except ValueError as e:
            raise (RuntimeError(f"{refused}; and {e}") if refused else e) from None
        wl.info["server_block_size"] = server_info.block_size_from(version, metrics_start)
        runner = Runner(args, session, base_url, api_url, model_name)
        observed = await bottleneck.before_load(session, base_url, model_name, args)  # gate pass 1, record before
        agentic_stats = None
        if args.dataset_name == "agentic":
            outputs, dur, agentic_stats = await _run_agentic(runner, wl)
        else:
            inputs = [runner.make_input(r.prompt, r.prompt_len, r.expected_output_len, r.request_id)
                      for r in wl.requests]
            if args.ready_check_timeout_sec > 0:
                await runner.ready_check(inputs[0])
            warm = await runner.warmup(inputs[0])
            wl.info["warmup_failed"] = sum(not o.success for o in warm)
            outputs, dur = await runner.run_fixed(inputs)
        metrics_after = await server_info.get_metrics(session, base_url)
        await bottleneck.after_load(session, base_url, model_name, args, observed)  # record after, gate pass 2
    count = None
    if wl.tokenizer is not None and any(o.success and not o.output_tokens for o in outputs):
        count = lambda text: len(wl.tokenizer.encode(text))  # noqa: E731
    server = {"base_url": base_url, "version": version, "block_size": wl.info.get("server_block_size"),
              "metrics_delta": server_info.metrics_delta(runner.metrics_before, metrics_after)}
    if agentic_stats is not None:
        delta = server["metrics_delta"] or {}
        q, h = delta.get("vllm:prefix_cache_queries"), delta.get("vllm:prefix_cache_hits")
        agentic_stats["achieved_hit_rate_metrics"] = (h / q) if q else None
    result = report.build_result(args, model_id, wl.tokenizer_id, outputs, dur, count)
    result["ladle"] = report.ladle_section(args, argv, outputs, result, wl.info, server, agentic_stats)
    report.print_summary(args, result)
    bottleneck.finish(args, observed, result)
    if refused and not any(o.success for o in outputs):
        print(f"ladle bench: error: {refused}", file=sys.stderr)
    if args.save_result:
        path = report.save(args, result, model_id)
        print(f"saved {path}")
    return result
