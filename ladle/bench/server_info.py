"""What the benchmark records about the machine and the server: /version, /v1/models, Prometheus /metrics.

Metric names are vLLM's (bench_methodology.md §6): counters are read with or without the `_total` suffix and summed
over label sets. Every probe is best-effort: a server without the endpoint gives None, never an exception.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import sys
from typing import Any

import aiohttp

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] for every sample line; comments and unparsable lines skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def counter(metrics: dict[str, list[tuple[dict[str, str], float]]] | None, name: str) -> float | None:
    """Sum of a counter over its label sets, looking up `name` and `name_total`; None if absent."""
    if not metrics:
        return None
    for key in (name + "_total", name):
        if key in metrics:
            return sum(v for _, v in metrics[key])
    return None


def block_size_from(version: Any, metrics: dict | None) -> int | None:
    """The server's KV block size: /version's engine config (any `block_size` key) or vllm:cache_config_info."""
    found = find_key(version, "block_size")
    if isinstance(found, int) and found > 0:
        return found
    for labels, _ in (metrics or {}).get("vllm:cache_config_info", []):
        if labels.get("block_size", "").isdigit():
            return int(labels["block_size"])
    return None


def find_key(obj: Any, key: str) -> Any:
    """Depth-first search of nested dicts/lists (JSON) for `key`; its first non-None value, else None."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            found = find_key(v, key)
            if found is not None:
                return found
    return None


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            return await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def get_metrics(session: aiohttp.ClientSession, base_url: str) -> dict | None:
    try:
        async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            return parse_prometheus(await r.text())
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


def refused_message(base_url: str) -> str:
    """What to say when nothing listens at `base_url`."""
    return (f"connection refused at {base_url}: no server answers there (start one, e.g. `ladle serve MODEL`, or "
            "point --base-url / --host / --port at it)")


async def connection_refused(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """`refused_message(base_url)` when a TCP connection to the server cannot be made, else None (whatever the
    server answers, even an error status)."""
    try:
        async with session.get(f"{base_url}/health", timeout=aiohttp.ClientTimeout(total=10)):
            return None
    except aiohttp.ClientConnectorError as e:
        if isinstance(e.os_error, ConnectionRefusedError):
            return refused_message(base_url)
        return f"cannot connect to {base_url}: {e.os_error}"
    except (aiohttp.ClientError, TimeoutError):
        return None


async def first_model(session: aiohttp.ClientSession, base_url: str) -> tuple[str, str]:
    """(id, root) of the first model in /v1/models. Raises RuntimeError if the server lists none or is not there."""
    data = await get_json(session, f"{base_url}/v1/models")
    if not data:
        refused = await connection_refused(session, base_url)
        if refused:
            raise RuntimeError(refused)
    if not data or not data.get("data"):
        hint = (" (--base-url is the server root, without /v1: the endpoint adds it)"
                if base_url.rstrip("/").endswith("/v1") else "; pass --model")
        raise RuntimeError(f"no model listed at {base_url}/v1/models{hint}")
    m = data["data"][0]
    return m["id"], m.get("root") or m["id"]


def machine_info() -> dict[str, Any]:
    """The client machine (the server may be elsewhere)."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
    }
    try:
        info["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    return info


SCRAPED = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def metrics_delta(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """after - before for the counters in SCRAPED that both snapshots carry; None without /metrics."""
    if before is None or after is None:
        return None
    out = {}
    for name in SCRAPED:
        a, b = counter(after, name), counter(before, name)
        if a is not None and b is not None:
            out[name] = a - b
    return out
