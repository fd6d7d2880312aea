"""Raw SSE helpers for server tests (no client library between us and the bytes)."""

from __future__ import annotations

import json

import httpx


def stream_events(client: httpx.Client, path: str, body: dict, headers: dict | None = None):
    """POST with stream; returns (status, events) where events are parsed JSON dicts and the string "[DONE]".

    A non-200 response returns (status, [json body]). Asserts the SSE framing (`data: ...` + blank line).
    """
    with client.stream("POST", path, json=body, headers=headers or {}) as r:
        raw = r.read().decode()
        if r.status_code != 200:
            return r.status_code, [json.loads(raw)]
    assert raw.endswith("\n\n"), raw[-200:]
    events: list = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return 200, events[:-1]


def completion_text(events: list, index: int = 0) -> str:
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices") and e["choices"][0]["index"] == index)


def chat_text(events: list, index: int = 0) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e.get("choices") and e["choices"][0]["index"] == index)


def deltas(events: list) -> list[str]:
    out = []
    for e in events:
        for ch in e.get("choices", []):
            out.append(ch.get("text", ch.get("delta", {}).get("content") or ""))
    return out
