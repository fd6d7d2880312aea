"""Agentic-coding traces: loading, scaling, token synthesis and the theoretical prefix-cache hit rate.

Trace format (WEKA / kv-cache-tester traces, one JSON object per trace file). A trace has `requests` in time order; a request
has `t`, `type` ("n"/"s", or "subagent" with its own nested `requests` and `t` counted from the subagent's start),
`in`, `out`, `hash_ids` (one id per full 64-token block of the input, scope local to the trace), `api_time`,
`think_time` (seconds from the previous ordinary request's end to this one's start).

Scaling (`length_scale` s): a trace block becomes b = max(1, round(64 s)) tokens, the tail (in mod 64 tokens, no
id) becomes round(tail s) tokens, and the output max(1, round(out s)) tokens. Prefix structure is kept because
blocks shrink rather than disappear.

Token synthesis: block id h of trace T gets b ids drawn from default_rng([seed, salt, crc32(T), h]) in
[vocab/8, 7 vocab/8) (away from the special ids most vocabularies keep at either end), so equal ids give equal
tokens and each turn's prompt literally extends the previous one where the ids say so. A request's tail gets ids
from a generator keyed by the request's serial number, which no one else shares. `salt` (random per run unless
fixed) keeps a second run against the same server from hitting the first run's cache.

Theoretical hit rate (unlimited cache): requests in replay order (a subagent's requests at its position in the
parent). A server block of B tokens hits when the whole prefix up to its end was an earlier request's prefix of
full trace blocks, so request r hits floor(L b / B) B tokens, L = its longest run of leading trace blocks that some
earlier request also began with; capped at floor((in - 1) / B) B because a server (vLLM) always recomputes the last
prompt token. Rate = sum hits / sum prompt tokens over the requests actually sent.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import zlib
from dataclasses import dataclass, field

import numpy as np

TRACE_BLOCK = 64


@dataclass
class AgenticRequest:
    """One leaf request after scaling. input_len = len(block_ids) * block_tokens + tail_len."""

    trace_id: str
    serial: int
    block_ids: list[int]
    block_tokens: int
    tail_len: int
    output_len: int
    delay_s: float  # trace seconds after the anchor (previous ordinary request's end) before sending
    dropped: bool = False

    @property
    def input_len(self) -> int:
        return len(self.block_ids) * self.block_tokens + self.tail_len


@dataclass
class AgenticSession:
    """A trace (or a subagent inside one): items in order; a subagent item runs concurrently with its parent."""

    trace_id: str
    items: list["AgenticRequest | AgenticSession"] = field(default_factory=list)
    delay_s: float = 0.0  # for a subagent: trace seconds after the parent's anchor before it starts

    def leaves(self) -> list[AgenticRequest]:
        out: list[AgenticRequest] = []
        for it in self.items:
            out.extend(it.leaves() if isinstance(it, AgenticSession) else [it])
        return out


def _build_session(trace_id: str, reqs: list[dict], s: float, counter: list[int], delay: float) -> AgenticSession:
    b = max(1, round(TRACE_BLOCK * s))
    sess = AgenticSession(trace_id, delay_s=delay)
    anchor_t = 0.0  # trace time of the previous ordinary request's end
    for r in reqs:
        if r.get("type") == "subagent":
            sub_delay = max(0.0, float(r.get("t", 0.0)) - anchor_t)
            sess.items.append(_build_session(trace_id, r.get("requests", []), s, counter, sub_delay))
            continue
        ids = [int(h) for h in r.get("hash_ids", [])]
        tail = max(0, int(r["in"]) - TRACE_BLOCK * len(ids))
        think = r.get("think_time")
        delay_s = float(think) if think is not None else max(0.0, float(r.get("t", 0.0)) - anchor_t)
        sess.items.append(AgenticRequest(trace_id, counter[0], ids, b, round(tail * s),
                                         max(1, round(int(r.get("out", 1)) * s)), delay_s))
        counter[0] += 1
        anchor_t = float(r.get("t", 0.0)) + float(r.get("api_time") or 0.0)
    return sess


def load_traces(path: str, num_sessions: int | None, length_scale: float = 1.0, seed: int = 0) -> list[AgenticSession]:
    """Sessions from a directory of `*.json`/`*.json.gz` traces (or one file). With num_sessions, a seeded random
    choice of that many (file order otherwise). Raises FileNotFoundError if there is no trace."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".json", ".json.gz")))
    else:
        files = [path]
    if not files:
        raise FileNotFoundError(f"no *.json or *.json.gz trace under {path}")
    if num_sessions is not None and num_sessions < len(files):
        files = sorted(random.Random(seed).sample(files, num_sessions))
    counter = [0]
    sessions = []
    for f in files:
        opener = gzip.open if f.endswith(".gz") else open
        with opener(f, "rt", encoding="utf-8") as fh:
            trace = json.load(fh)
        trace_id = str(trace.get("id", os.path.basename(f)))
        sessions.append(_build_session(trace_id, trace["requests"], length_scale, counter, 0.0))
    return sessions


def apply_max_model_len(sessions: list[AgenticSession], max_model_len: int | None) -> int:
    """Marks requests with input + output > max_model_len as dropped; returns how many."""
    if not max_model_len:
        return 0
    n = 0
    for sess in sessions:
        for r in sess.leaves():
            r.dropped = r.input_len + r.output_len > max_model_len
            n += r.dropped
    return n


class TokenSynth:
    """Token ids per (trace, block id) and per request tail; see the module docstring. Not thread-safe (a cache)."""

    def __init__(self, vocab_size: int, seed: int = 0, salt: int = 0) -> None:
        self.lo, self.hi = vocab_size // 8, max(vocab_size // 8 + 1, 7 * vocab_size // 8)
        self.seed, self.salt = seed, salt
        self._blocks: dict[tuple[str, int, int], np.ndarray] = {}

    def block(self, trace_id: str, block_id: int, n: int) -> np.ndarray:
        key = (trace_id, block_id, n)
        if key not in self._blocks:
            rng = np.random.default_rng([self.seed, self.salt, zlib.crc32(trace_id.encode()), block_id])
            self._blocks[key] = rng.integers(self.lo, self.hi, size=n)
        return self._blocks[key]

    def prompt(self, r: AgenticRequest) -> list[int]:
        parts = [self.block(r.trace_id, h, r.block_tokens) for h in r.block_ids]
        tail_rng = np.random.default_rng([self.seed, self.salt, 1 << 40, r.serial])
        parts.append(tail_rng.integers(self.lo, self.hi, size=r.tail_len))
        return np.concatenate(parts).astype(np.int64).tolist() if parts else []


def theoretical_hits(requests: list[AgenticRequest], block_size: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) with an unlimited cache of `block_size`-token blocks, over `requests` in order
    (dropped ones skipped). See the module docstring for the rule."""
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        if r.dropped:
            continue
        keys = []
        k = hash(r.trace_id)
        for h in r.block_ids:
            k = hash((k, h))
            keys.append(k)
        common = 0
        while common < len(keys) and keys[common] in seen:
            common += 1
        seen.update(keys)
        n_in = r.input_len
        hit = (common * r.block_tokens) // block_size * block_size
        hits += min(hit, max(0, (n_in - 1) // block_size * block_size))
        total += n_in
    return hits, total


def replay_order(sessions: list[AgenticSession]) -> list[AgenticRequest]:
    """All leaves, session by session, each subagent's requests at its position in the parent."""
    out: list[AgenticRequest] = []
    for s in sessions:
        out.extend(s.leaves())
    return out


def workload_stats(sessions: list[AgenticSession], server_block_size: int | None) -> dict:
    """Theoretical hit rates at the trace block (b tokens) and at the server's block size, plus counts."""
    reqs = replay_order(sessions)
    sent = [r for r in reqs if not r.dropped]
    b = reqs[0].block_tokens if reqs else TRACE_BLOCK
    h_b, tot = theoretical_hits(reqs, b)
    stats = {
        "num_sessions": len(sessions),
        "num_requests": len(reqs),
        "num_dropped_too_long": len(reqs) - len(sent),
        "trace_block_tokens": b,
        "total_prompt_tokens": tot,
        "total_output_tokens": sum(r.output_len for r in sent),
        "theoretical_hit_rate_trace_block": h_b / tot if tot else 0.0,
        "server_block_size": server_block_size,
        "theoretical_hit_rate_server_block": None,
    }
    if server_block_size:
        h_s, _ = theoretical_hits(reqs, server_block_size)
        stats["theoretical_hit_rate_server_block"] = h_s / tot if tot else 0.0
    return stats
