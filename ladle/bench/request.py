"""One streamed HTTP request and what the client records about it (vLLM `bench serve` semantics).

Definitions follow vLLM's `vllm/benchmarks/lib/endpoint_request_func.py`:

- `start_time` is `time.perf_counter()` just before the POST.
- TTFT: from `start_time` to the first SSE `data:` message whose `choices` list is non-empty (its text may be empty).
- ITL: one sample per later message with non-empty `choices` -- one *chunk*, however many tokens it carries.
- latency (E2EL): from `start_time` to the last message with non-empty `choices`; the trailing usage-only chunk and
  `[DONE]` do not move it.
- output tokens: `usage.completion_tokens` from a chunk whose `choices` is empty or missing; 0 means "not sent"
  (the caller then counts tokens itself). `usage.prompt_tokens` replaces `prompt_len` when present.
- success: HTTP 200 and at least one `choices` chunk.

ladle additions (kept out of vLLM's fields): `status` (HTTP status or None), `error_kind` (the key under which a
failure is counted: the status code as a string, "timeout", "connection_error", "no_token", "stream_error",
"exception"), `cached_tokens` (usage.prompt_tokens_details.cached_tokens when sent) and `num_chunks`.
Deviation from vLLM, on purpose: a stream that carries an `{"error": ...}` object is a failure ("stream_error"),
whereas vLLM would count it a success if a token arrived before the error.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class RequestInput:
    """What to send.

    prompt: text, or a list of token ids (the completions API accepts `list[int]`; the chat backend needs text).
    prompt_len: the client's own count of prompt tokens (replaced by usage.prompt_tokens when the server sends it).
    output_len: sent as `max_tokens` (completions) or `max_completion_tokens` (chat).
    """

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    chat: bool = False
    ignore_eos: bool = False
    extra_body: dict[str, Any] | None = None
    request_id: str | None = None
    extra_headers: dict[str, str] | None = None


@dataclass
class RequestOutput:
    """What one request measured; times in seconds (perf_counter clock)."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0
    client_queue_time: float = 0.0
    status: int | None = None
    error_kind: str = ""
    cached_tokens: int | None = None
    num_chunks: int = 0


def build_payload(inp: RequestInput) -> dict[str, Any]:
    """The JSON body vLLM's client sends (completions: repetition_penalty 1.0, logprobs; chat: one user message)."""
    if inp.chat:
        payload: dict[str, Any] = {
            "model": inp.model,
            "messages": [{"role": "user", "content": inp.prompt}],
            "max_completion_tokens": inp.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    else:
        payload = {
            "model": inp.model,
            "prompt": inp.prompt,
            "repetition_penalty": 1.0,
            "max_tokens": inp.output_len,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    if inp.extra_body:
        payload.update(inp.extra_body)
    if payload.get("stream") is not True:  # an extra body that turns streaming off: stream_options would be a 400
        payload.pop("stream_options", None)
    return payload


def build_headers(inp: RequestInput) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    api_key = os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if inp.extra_headers:
        headers.update(inp.extra_headers)
    if inp.request_id:
        headers["x-request-id"] = inp.request_id
    return headers


class SSEBuffer:
    """Splits a byte stream into SSE messages (separated by a blank line); returns each message's data text.

    Comment lines (starting with ':') and non-data fields are dropped; multi-line data is joined with '\\n'.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf += data.replace(b"\r\n", b"\n")
        out: list[str] = []
        *messages, self._buf = self._buf.split(b"\n\n")  # one pass over the buffer, however many messages it holds
        for raw in messages:
            lines = [ln[5:].lstrip() if ln.startswith("data:") else None for ln in raw.decode("utf-8").split("\n")]
            data = [ln for ln in lines if ln is not None]
            if data:
                out.append("\n".join(data))
        return out


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _read_stream(resp: aiohttp.ClientResponse, inp: RequestInput, out: RequestOutput, st: float) -> None:
    sse = SSEBuffer()
    last = st
    text: list[str] = []
    async for data in resp.content.iter_any():
        for msg in sse.feed(data):
            if msg == "[DONE]":
                continue
            obj = json.loads(msg)
            if choices := obj.get("choices"):
                now = time.perf_counter()
                if out.num_chunks == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                last = now
                out.num_chunks += 1
                text.append(_chunk_text(choices[0], inp.chat))
            elif usage := obj.get("usage"):
                out.output_tokens = usage.get("completion_tokens") or 0
                if usage.get("prompt_tokens") is not None:
                    out.prompt_len = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    out.cached_tokens = int(details["cached_tokens"])
            elif "error" in obj:
                out.error_kind = "stream_error"
                out.error = json.dumps(obj["error"])[:500]
    out.generated_text = "".join(text)
    out.latency = last - st


async def send_request(inp: RequestInput, session: aiohttp.ClientSession, timeout_s: float | None = None) -> RequestOutput:
    """POST one streaming request and measure it. Never raises for server or network failures: they are recorded
    in `success=False`, `error`, `error_kind` (and `status` for HTTP errors). `timeout_s` bounds the whole request."""
    out = RequestOutput(prompt_len=inp.prompt_len)
    payload = build_payload(inp)
    headers = build_headers(inp)
    st = time.perf_counter()
    out.start_time = st
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(inp.api_url, json=payload, headers=headers) as resp:
                out.status = resp.status
                if resp.status != 200:
                    body = (await resp.text())[:500]
                    out.error_kind = str(resp.status)
                    out.error = f"HTTP {resp.status} {resp.reason or ''}: {body}"
                    return out
                await _read_stream(resp, inp, out, st)
        if out.error_kind == "stream_error":
            return out
        if out.num_chunks == 0:
            out.error_kind = "no_token"
            out.error = "Never received a valid chunk to calculate TTFT."
            return out
        out.success = True
    except TimeoutError:
        out.error_kind, out.error = "timeout", f"no complete response within {timeout_s} s"
    except aiohttp.ClientConnectorError as e:  # no TCP connection: say so in plain words
        what = "connection refused" if isinstance(e.os_error, ConnectionRefusedError) else "cannot connect"
        out.error_kind, out.error = "connection_error", f"{what} at {inp.api_url}: {e}"
    except aiohttp.ClientConnectionError as e:
        out.error_kind, out.error = "connection_error", f"{type(e).__name__}: {e}"
    except Exception as e:  # a malformed stream etc.: counted, never a crash of the benchmark
        out.error_kind, out.error = "exception", f"{type(e).__name__}: {e}"
    return out
