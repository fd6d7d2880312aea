"""The periodic stats line (vLLM's fields, `--disable-log-stats`) and the /metrics series added for issue 14:
per-request prompt/generation token histograms, `vllm:iteration_tokens_total`, and `vllm:request_success_total`
for every finish reason from the first scrape."""

from __future__ import annotations

import logging
import random
import time

import httpx

from fake_engine import FakeEngineClient
from harness import start_fake
from ladle.config import SchedulerConfig
from ladle.core.scheduler import ITERATION_TOKEN_BUCKETS, SchedulerStats
from ladle.engine.client import EngineStats
from ladle.server.metrics import ServerMetrics, token_buckets
from ladle.server.stats_log import StatsLogger


def _series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_stats_line_throughput_and_rates():
    rng = random.Random()
    stats = EngineStats()
    logger = StatsLogger(lambda: stats, interval=10.0)
    prompt, gen, queries, hits = (rng.randint(100, 10_000) for _ in range(4))
    hits = min(hits, queries)
    stats.prompt_tokens_total, stats.generation_tokens_total = prompt, gen
    stats.prefix_cache_queries_total, stats.prefix_cache_hits_total = queries, hits
    stats.num_running, stats.num_waiting, stats.kv_cache_usage = 3, 2, 0.25
    text, busy = logger.line(now=logger._last_time + 4.0)
    assert busy
    assert f"Avg prompt throughput: {prompt / 4.0:.1f} tokens/s" in text
    assert f"Avg generation throughput: {gen / 4.0:.1f} tokens/s" in text
    assert "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%" in text
    assert f"Prefix cache hit rate: {100.0 * hits / queries:.1f}%" in text
    stats.num_running = stats.num_waiting = 0
    text, busy = logger.line(now=logger._last_time + 10.0)  # nothing new: idle
    assert not busy and "Avg prompt throughput: 0.0 tokens/s" in text and "Prefix cache hit rate: 0.0%" in text


def test_stats_line_is_logged_while_serving(caplog):
    engine = FakeEngineClient()
    server, thread, url = start_fake(engine, log_stats_interval=0.05)
    try:
        with caplog.at_level(logging.INFO, logger="ladle.server.stats"):
            engine.stats.prompt_tokens_total += 1  # activity: the next line is at INFO
            deadline = time.monotonic() + 10
            while not any("Avg prompt throughput" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no stats line within 10 s"
                time.sleep(0.05)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_disable_log_stats_logs_nothing(caplog):
    engine = FakeEngineClient()
    server, thread, url = start_fake(engine, log_stats_interval=0.02, disable_log_stats=True)
    try:
        with caplog.at_level(logging.DEBUG, logger="ladle.server.stats"):
            engine.stats.prompt_tokens_total += 1
            time.sleep(0.3)
        # this server is busy (a prompt token counted), so a line of its own would be INFO; other servers alive in
        # the test process (session and module fixtures, 10 s interval) may log their idle DEBUG line meanwhile
        assert not [r for r in caplog.records if r.name == "ladle.server.stats" and r.levelno >= logging.INFO]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_success_series_for_every_finish_reason_from_the_start():
    engine = FakeEngineClient()
    text = ServerMetrics(engine.get_stats, "m", 4096).render().decode()
    for reason in ("stop", "length", "abort", "error"):
        assert f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="m"}} 0.0' in text
    engine.stats.request_success_total = {"length": 3}
    series = _series(ServerMetrics(engine.get_stats, "m", 4096).render().decode())
    assert series['vllm:request_success_total{engine="0",finished_reason="length",model_name="m"}'] == 3.0
    assert series['vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"}'] == 0.0


def test_iteration_tokens_histogram_from_the_scheduler_counts():
    rng = random.Random()
    steps = [rng.randint(1, 20_000) for _ in range(200)]
    from ladle.core.scheduler import Scheduler

    stats = SchedulerStats()
    fake = Scheduler.__new__(Scheduler)
    fake._stats = stats
    for n in steps:
        Scheduler._count_iteration(fake, n)
    engine_stats = EngineStats(iteration_tokens_counts=stats.iteration_tokens_counts,
                               iteration_tokens_sum=stats.iteration_tokens_sum)
    series = _series(ServerMetrics(lambda: engine_stats, "m", 4096).render().decode())
    for edge in ITERATION_TOKEN_BUCKETS:
        key = f'vllm:iteration_tokens_total_bucket{{engine="0",le="{float(edge)}",model_name="m"}}'
        assert series[key] == sum(n <= edge for n in steps), edge
    assert series['vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"}'] == len(steps)
    assert series['vllm:iteration_tokens_total_sum{engine="0",model_name="m"}'] == sum(steps)
    assert series['vllm:iteration_tokens_total_count{engine="0",model_name="m"}'] == len(steps)


def test_token_buckets_are_1_2_5_up_to_the_context():
    assert token_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert token_buckets(1) == [1]


def test_request_token_histograms_per_choice():
    engine = FakeEngineClient()
    server, thread, url = start_fake(engine)
    try:
        max_tokens = random.randint(3, 9)
        prompt = "x" * random.randint(20, 40)
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "n": 2,
                                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200
        series = _series(httpx.get(url + "/metrics").text)
        labels = '{engine="0",model_name="fake-model"}'
        assert series[f"vllm:request_prompt_tokens_count{labels}"] == 2
        assert series[f"vllm:request_prompt_tokens_sum{labels}"] == 2 * len(prompt)
        assert series[f"vllm:request_generation_tokens_sum{labels}"] == 2 * max_tokens
    finally:
        server.should_exit = True
        thread.join(timeout=10)
