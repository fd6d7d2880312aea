"""The issue's behaviour cases, one test each, against the fake engine and the real SmolLM2 server."""

from __future__ import annotations

import json
import socket
import threading
import time

from sse import chat_text, completion_text, deltas, stream_events

PROMPT = "The capital of France is Paris. The capital of Italy is"


def _greedy(client, server, prompt: str, max_tokens: int = 24, **extra) -> dict:
    r = client.post("/v1/completions", json={"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _spanning_stop(choice: dict) -> str:
    """A 4-character substring of the generated text that straddles a token boundary (2 characters on each
    side, so it spans at least two tokens) and first occurs there, so the expected cut is unambiguous."""
    lp, text = choice["logprobs"], choice["text"]
    offsets = lp["text_offset"]
    for j in sorted(range(1, len(offsets)), key=lambda j: abs(j - len(offsets) // 2)):  # middle first
        b = offsets[j]
        stop = text[b - 2:b + 2]
        if "".join(lp["tokens"][:j]) != text[:b]:  # a boundary inside a multi-byte character
            continue
        if b >= 2 and len(stop) == 4 and stop.strip() == stop and "\ufffd" not in stop and text.find(stop) == b - 2:
            return stop
    raise AssertionError(f"no token boundary to test in {text!r}")


def test_1_stop_string_across_tokens(server):
    with server.client() as c:
        full = _greedy(c, server, PROMPT, max_tokens=16, logprobs=0)["choices"][0]
        stop = _spanning_stop(full)
        expected = full["text"][:full["text"].index(stop)]
        body = {"model": server.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": [stop]}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200
        ch = r.json()["choices"][0]
        assert ch["text"] == expected and ch["finish_reason"] == "stop"
        status, events = stream_events(c, "/v1/completions", {**body, "stream": True})
        assert status == 200
        pieces = deltas(events)
        # Deltas only append, so equality with the cut text means no part of the stop string ever went out.
        assert "".join(pieces) == expected and not any(stop in p for p in pieces)
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_2_include_usage(server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with server.client() as c:
        _, with_usage = stream_events(c, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        _, without = stream_events(c, "/v1/completions", body)
        chat = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        _, chat_events = stream_events(c, "/v1/chat/completions", chat)
    for events in (with_usage, chat_events):
        usage_chunks = [e for e in events if e.get("usage")]
        assert len(usage_chunks) == 1 and usage_chunks[0] is events[-1]
        u = usage_chunks[0]
        assert u["choices"] == []
        assert u["usage"]["prompt_tokens"] > 0 and 1 <= u["usage"]["completion_tokens"] <= 5
        assert u["usage"]["total_tokens"] == u["usage"]["prompt_tokens"] + u["usage"]["completion_tokens"]
        assert "cached_tokens" in u["usage"]["prompt_tokens_details"]
        assert all(e["choices"] for e in events[:-1])
    assert all("usage" not in e and e["choices"] for e in without)


def test_3_empty_prompt(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": server.model, "prompt": "", "max_tokens": 4})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert "empty" in r.json()["error"]["message"]
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        r = c.post("/v1/completions", json={"model": server.model, "prompt": [], "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
        assert _greedy(c, server, PROMPT, max_tokens=3)["choices"][0]["text"]


def test_4_max_tokens_zero(server):
    with server.client() as c:
        for extra in ({}, {"echo": True, "logprobs": 1}):
            for stream in (False, True):
                body = {"model": server.model, "prompt": PROMPT, "max_tokens": 0, "stream": stream, **extra}
                if stream:
                    status, events = stream_events(c, "/v1/completions", body)
                    assert status in (200, 400), events
                    if status == 200:
                        assert completion_text(events) == (PROMPT if extra else "")
                    continue
                r = c.post("/v1/completions", json=body)
                assert r.status_code in (200, 400), r.text
                if r.status_code == 200:
                    ch = r.json()["choices"][0]
                    assert ch["text"] == (PROMPT if extra else "")
                    assert r.json()["usage"]["completion_tokens"] == 0
                    if extra:
                        lp = ch["logprobs"]
                        assert "".join(lp["tokens"]) == PROMPT and lp["token_logprobs"][0] is None
                        assert all(x is not None and x <= 0 for x in lp["token_logprobs"][1:])
        r = c.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 0,
                                                 "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code in (200, 400), r.text


def test_5_too_long_is_400_before_any_sse_byte(server):
    limit = server.max_model_len
    with server.client() as c:
        n_prompt = c.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
        for stream in (False, True):
            for path, body in (
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": limit}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": limit}),
            ):
                with c.stream("POST", path, json={"model": server.model, "stream": stream, **body}) as r:
                    raw = r.read().decode()
                    assert r.status_code == 400, raw
                    assert r.headers["content-type"].startswith("application/json")
                assert not raw.startswith("data:")
                msg = json.loads(raw)["error"]["message"]
                assert str(limit) in msg and str(limit) + " in the completion" in msg
                if path == "/v1/completions":
                    assert f"{n_prompt + limit} tokens ({n_prompt} in the prompt" in msg
        long_prompt = "hello " * (limit + 10)
        r = c.post("/v1/completions", json={"model": server.model, "prompt": long_prompt, "stream": True})
        assert r.status_code == 400 and str(limit) in r.json()["error"]["message"]


def test_6_multibyte_stream_matches(server):
    prompt = "Repeat exactly: 你好世界 😀🎉 こんにちは 🍜 你好世界 😀🎉 こんにちは 🍜 你好世界"
    with server.client() as c:
        body = {"model": server.model, "prompt": prompt, "max_tokens": 10, "temperature": 0}
        text = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        _, events = stream_events(c, "/v1/completions", {**body, "stream": True})
        chat_body = {"model": server.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 10,
                     "temperature": 0}
        chat = c.post("/v1/chat/completions", json=chat_body).json()["choices"][0]["message"]["content"]
        _, chat_events = stream_events(c, "/v1/chat/completions", {**chat_body, "stream": True})
    assert completion_text(events) == text and chat_text(chat_events) == chat
    assert "\ufffd" not in text + chat and all("\ufffd" not in d for d in deltas(events) + deltas(chat_events))
    assert any(ord(ch) > 0x2FFF for ch in text + chat), "the model produced no multi-byte text to test"


def test_7_n_and_seed(server):
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "n": 4,
            "seed": 1234}
    with server.client() as c:
        a = c.post("/v1/completions", json=body).json()["choices"]
        b = c.post("/v1/completions", json=body).json()["choices"]
    texts = [ch["text"] for ch in a]
    assert [ch["index"] for ch in a] == [0, 1, 2, 3]
    assert len(set(texts)) == 4, texts  # choice i samples with seed + i: four different streams
    assert texts == [ch["text"] for ch in b]  # the same seed repeats exactly


def test_8_same_client_request_id_concurrently(server):
    results = []

    def one():
        with server.client() as c:
            r = c.post("/v1/completions", headers={"X-Request-Id": "same-id"},
                       json={"model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
            results.append((r.status_code, r.headers.get("x-request-id"), r.text))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s == 200 or 400 <= s < 500 for s, _, _ in results), results
    assert any(s == 200 for s, _, _ in results)
    assert all(h == "same-id" for s, h, _ in results if s == 200)
    with server.client() as c:
        assert c.get("/health").status_code == 200
        assert _greedy(c, server, PROMPT, max_tokens=2)["choices"]


def _idle_state(server, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _raw_post(server, path: str, body: dict) -> socket.socket:
    host, port = server.base_url.rsplit("//", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_9_disconnect_frees_blocks(server):
    baseline = _idle_state(server, 30)
    free0 = baseline["ladle:num_free_blocks"]
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": server.max_model_len - 100,
            "ignore_eos": True, "temperature": 0}
    for stream in (True, False):
        sock = _raw_post(server, "/v1/completions", {**body, "stream": stream})
        deadline = time.monotonic() + 60
        if stream:
            got = b""
            while got.count(b"data: ") < 3:  # mid-stream
                chunk = sock.recv(4096)
                assert chunk and b"HTTP/1.1 200" in got + chunk, got + chunk
                got += chunk
        while server.metrics()["vllm:num_requests_running"] < 1:  # running (non-streaming: no bytes yet)
            assert time.monotonic() < deadline
            time.sleep(0.02)
        m = server.metrics()
        assert m["ladle:num_free_blocks"] < free0
        sock.close()
        t0 = time.monotonic()
        while True:
            m = server.metrics()
            if m["vllm:num_requests_running"] == 0 and m["ladle:num_free_blocks"] == free0:
                break
            assert time.monotonic() - t0 < 1.0, f"not released within 1 s (stream={stream}): {m}"
            time.sleep(0.02)
    with server.client() as c:
        assert _greedy(c, server, PROMPT, max_tokens=3)["choices"][0]["finish_reason"] in ("length", "stop")


def test_10_bad_requests(server):
    with server.client() as c:
        cases = [
            c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
            c.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "max_tokens": "many"}),
            c.post("/v1/chat/completions", json={"model": server.model, "messages": "hello"}),
            c.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "temperature": "hot"}),
            c.post("/v1/completions", json={"model": server.model}),
            c.post("/v1/completions", json=[1, 2, 3]),
            c.post("/v1/completions", json={"model": "no-such-model", "prompt": PROMPT}),
            c.post("/v1/chat/completions", json={"model": "no-such-model",
                                                 "messages": [{"role": "user", "content": "x"}]}),
            c.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "temperature": -1}),
            c.post("/v1/completions", json={"model": server.model, "prompt": PROMPT, "n": 0}),
        ]
        for r in cases:
            assert 400 <= r.status_code < 500, (r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert cases[0].status_code == 400 and "JSON" in cases[0].json()["error"]["message"]
        assert cases[6].status_code == 404 and "no-such-model" in cases[6].json()["error"]["message"]
        assert c.get("/health").status_code == 200
