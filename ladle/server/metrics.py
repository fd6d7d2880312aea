"""/metrics in Prometheus text format, with vLLM's metric names for what ladle shares with vLLM.

Gauges and counters are read from `EngineClient.get_stats()` at scrape time (a custom collector, so the
engine keeps plain integers and nothing double-counts). Latency histograms are observed by the server per
request (`RequestTimer`). Names and meanings: vllm/v1/metrics/loggers.py (PrometheusStatLogger):
  vllm:num_requests_running / _waiting (gauges), vllm:kv_cache_usage_perc (gauge, 0..1),
  vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:num_preemptions_total,
  vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (counters, tokens), vllm:request_success_total,
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:request_time_per_output_token_seconds,
  vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds (histograms, seconds),
  vllm:request_prompt_tokens, vllm:request_generation_tokens (histograms per finished choice, tokens; vLLM
  observes each of a request's n choices, which are separate engine requests there too),
  vllm:iteration_tokens_total (histogram: tokens scheduled per engine step).
`vllm:generation_tokens_total` counts the tokens delivered in choices, so it equals the sum of the responses'
completion_tokens, as in vLLM (both count where outputs are processed: a token the engine core sampled for a request
already finished there by a stop string or an abort is not counted).
`vllm:request_success_total` has a series for every engine finish reason (stop, length, abort, error) from the
first scrape, zero until it happens, as vLLM pre-creates one per FinishReason. ("tool_calls" is a chat-level
reinterpretation of "stop", not an engine finish reason, so it has no series, as in vLLM.)
ladle's own series use the `ladle:` prefix (ladle:num_free_blocks, ladle:num_total_blocks).
Each registry is per app (tests build several apps in one process). No `*_created` series (the creation timestamps
prometheus_client adds to counters and histograms): vLLM exposes none either; prometheus_client's switch for that,
`disable_created_metrics()`, is process-wide and is thrown when a ServerMetrics is built.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ladle.core.outputs import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from ladle.core.scheduler import ITERATION_TOKEN_BUCKETS
from ladle.engine.client import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket edges (seconds) as vLLM's PrometheusStatLogger uses them.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR)


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's build_1_2_5_buckets for the per-request token
    histograms)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(float(m * scale))
        scale *= 10


REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


class _EngineCollector:
    """Yields gauge/counter families from one EngineStats snapshot per scrape."""

    def __init__(self, get_stats: Callable[[], EngineStats], model_name: str):
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        s = self.get_stats()
        labels, values = ["model_name", "engine"], [self.model_name, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)  # exposed as <name>_total
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens_total)
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", s.num_preemptions_total)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      s.prefix_cache_queries_total)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      s.prefix_cache_hits_total)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=labels + ["finished_reason"])
        counts = dict.fromkeys(FINISH_REASONS, 0)
        counts.update(s.request_success_total or {})
        for reason, count in sorted(counts.items()):
            success.add_metric(values + [str(reason)], count)
        yield success
        yield self._iteration_tokens(s, labels, values)
        yield gauge("ladle:num_free_blocks", "KV blocks free for allocation (includes evictable cached blocks).",
                    s.num_free_blocks)
        yield gauge("ladle:num_total_blocks", "KV blocks in the pool (excluding the null block).", s.num_total_blocks)
        yield counter("ladle:engine_steps", "Engine steps that ran the model.", s.num_steps)
        host = CounterMetricFamily("ladle:step_host_seconds", "Host seconds spent per engine-step phase: schedule, "
                                   "execute (prepare inputs + launch forward and sample; with synchronous steps it also waits for the device), "
                                   "wait (blocked on a launched step's sampled ids; --async-scheduling), update, "
                                   "process_outputs (detokenize + stop strings); device_idle is not host time but "
                                   "its effect: seconds the GPU had no step queued between two steps while requests "
                                   "were unfinished (--async-scheduling on CUDA), the host time not hidden.", labels=labels + ["phase"])
        for phase, seconds in sorted((s.step_host_seconds or {}).items()):
            host.add_metric(values + [str(phase)], float(seconds))
        yield host


    @staticmethod
    def _iteration_tokens(s: EngineStats, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        counts = list(s.iteration_tokens_counts) or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for edge, count in zip(list(ITERATION_TOKEN_BUCKETS) + ["+Inf"], counts):
            cumulative += count
            buckets.append((str(float(edge)) if edge != "+Inf" else edge, cumulative))
        h = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  labels=labels)
        h.add_metric(values, buckets, sum_value=s.iteration_tokens_sum)
        return h


class ServerMetrics:
    """The per-app registry: the engine collector plus request-latency and request-size histograms."""

    def __init__(self, get_stats: Callable[[], EngineStats], model_name: str, max_model_len: int = 1 << 20):
        disable_created_metrics()  # process-wide in prometheus_client; read at each scrape
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(get_stats, model_name))  # type: ignore[arg-type]
        labels = ["model_name", "engine"]
        self._label_values = {"model_name": model_name, "engine": "0"}

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(**self._label_values)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          REQUEST_BUCKETS)
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                  token_buckets(max_model_len))
        self.generation_tokens = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                      token_buckets(max_model_len))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def observe_repeated(hist: Any, value: float, count: int) -> None:
    """`hist.observe(value)` `count` times, for a prometheus_client Histogram child in one bucket search and two
    locked updates instead of `count` of each: the sum gets the same `count` additions in the same order and the
    bucket's count grows by `count` (exact: counts are integers), so /metrics reads the same. Anything else with an
    `observe` (another histogram implementation, a test's recorder) gets the plain loop. Loop thread only (the sum
    is read and written back; scrapes only read)."""
    total, bounds, buckets = (getattr(hist, "_sum", None), getattr(hist, "_upper_bounds", None),
                              getattr(hist, "_buckets", None))
    if count == 1 or not (hasattr(total, "get") and hasattr(total, "set") and bounds and buckets):
        for _ in range(count):
            hist.observe(value)
        return
    acc = total.get()
    for _ in range(count):
        acc += value
    total.set(acc)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(count)
            break


class RequestTimer:
    """Latency bookkeeping for one request (all choices together). Times are time.monotonic() seconds."""

    def __init__(self, metrics: Optional[ServerMetrics]):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token: Optional[float] = None
        self.last_token: Optional[float] = None
        self.num_tokens = 0
        self.queue_time: Optional[float] = None

    def on_tokens(self, num_new: int, queue_time: Optional[float] = None) -> None:
        """Record that `num_new` tokens arrived now (ITL is spread evenly over a multi-token output)."""
        if num_new <= 0:
            return
        now = time.monotonic()
        if queue_time is not None and self.queue_time is None:
            self.queue_time = queue_time
        if self.metrics is not None:
            if self.first_token is None:
                self.metrics.ttft.observe(now - self.arrival)
            elif self.last_token is not None:
                observe_repeated(self.metrics.itl, (now - self.last_token) / num_new, num_new)
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.num_tokens += num_new

    def finish(self, num_prompt_tokens: int = 0, num_generation_tokens: Iterable[int] = ()) -> None:
        """The request ended: latencies, and the token histograms (`num_generation_tokens`: one count per
        choice)."""
        if self.metrics is None:
            return
        for num in num_generation_tokens:
            self.metrics.prompt_tokens.observe(num_prompt_tokens)
            self.metrics.generation_tokens.observe(num)
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.arrival)
        if self.queue_time is not None:
            self.metrics.queue.observe(self.queue_time)
        if self.first_token is not None and self.num_tokens > 1:
            self.metrics.tpot.observe((now - self.first_token) / (self.num_tokens - 1))
