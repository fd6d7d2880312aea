"""Property-based fuzz of the HTTP surface (issue 17): every generated body for /v1/completions,
/v1/chat/completions (streaming and not), /tokenize and /detokenize gets a 2xx, or a 4xx with an OpenAI error
body, never a 5xx; afterwards /health is 200, no request runs and every KV block is free.

Two passes: a fast one over the fake engine (hundreds of examples, in-process uvicorn) and a short one against a
real `ladle serve` of the default model. Derandomized (a fixed seed, no example database), so CI is reproducible;
the cases the fuzzer found are pinned as `@example`s here and as named tests in test_edge_validation.py.
"""

from __future__ import annotations

import math
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fuzz_bodies as fb
from fake_engine import FakeEngineClient
from harness import Server, start_fake

FUZZ_LIMITS = dict(max_n=16, max_prompts_per_request=64, max_stop_strings=8, max_stop_string_chars=64,
                   max_request_body_bytes=64 * 1024)
FAST = settings(max_examples=250, derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=list(HealthCheck))
REAL = settings(FAST, max_examples=12)

# Found by the fuzzer (or by the soak that filed issue 17) and fixed; each once gave a 5xx, a 400 quoting an
# internal exception (and a closed connection), or a silent accept.
FOUND = [
    ("/v1/completions", {"prompt": "\ud800"}),  # TypeError in the HF tokenizer -> 500 (the soak's case)
    ("/v1/completions", {"prompt": "a", "stop": ["\udfff"]}),  # accepted unchecked
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}),
    ("/v1/completions", {"prompt": "a", "temperature": math.nan}),  # silently greedy
    ("/v1/completions", {"prompt": "a", "temperature": math.inf}),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": math.nan}),
    ("/v1/completions", {"prompt": "a", "model": "\ud800"}),  # the 404 body quoting it cannot be UTF-8 encoded
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"tokenize": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [[{"type": "text", "text": "x"}]]}]}),
    ("/tokenize", {"prompt": "\ud800"}),
    ("/detokenize", {"tokens": [2 ** 70]}),
    ("/v1/completions", {"prompt": "a", "n": 10 ** 6}),  # 1e6 sequences queued
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [2 ** 64]}),  # accepted unchecked (outside the vocabulary)
]


@pytest.fixture(scope="module")
def fuzz_server():
    engine = FakeEngineClient(max_model_len=512, step_delay=0.0)
    server, thread, url = start_fake(engine, **FUZZ_LIMITS)
    yield Server("fake", url, engine.model_name, engine.max_model_len, engine)
    server.should_exit = True
    thread.join(timeout=10)


def post(client: httpx.Client, path: str, body: bytes) -> tuple[int, str, bytes]:
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    return r.status_code, r.headers.get("content-type", ""), r.content


def assert_idle(server: Server, timeout: float = 30.0) -> None:
    """/health 200, no request running, every KV block free (the fake's accounting or the real block pool)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
                and m["ladle:num_free_blocks"] == m["ladle:num_total_blocks"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, m
    assert httpx.get(server.base_url + "/health").status_code == 200


def _fuzz(server: Server, scale: fb.Scale, path: str):
    body_strategy = fb.ENDPOINTS[path](scale, server.model).map(fb.encode)
    if scale is fb.REAL:
        body_strategy = fb.ENDPOINTS[path](scale, server.model).map(
            lambda b: fb.encode(fb.cap_for_real(b, scale.max_tokens)))
    client = server.client(timeout=120)
    return body_strategy, client


@pytest.mark.parametrize("path", sorted(fb.ENDPOINTS))
def test_fuzz_fake(fuzz_server, path):
    strategy, client = _fuzz(fuzz_server, fb.FAKE, path)
    found = [fb.encode(b) for p, b in FOUND if p == path]

    @FAST
    @given(st.one_of(strategy, fb.raw_bodies()))
    def run(body: bytes) -> None:
        status, ctype, payload = post(client, path, body)
        fb.check_response(status, ctype, payload, f"{path} {body[:300]!r}")

    for body in found:  # the pinned cases first (@example needs them at decoration time)
        run = example(body)(run)
    with client:
        run()
        # The same keep-alive client still works after everything above.
        status, _, payload = post(client, "/v1/completions", fb.encode({"prompt": "ok", "max_tokens": 2}))
        assert status == 200, payload
    assert_idle(fuzz_server)


@pytest.mark.parametrize("path", sorted(fb.ENDPOINTS))
def test_fuzz_real(real_server, path):
    strategy, client = _fuzz(real_server, fb.REAL, path)

    @REAL
    @given(strategy)
    def run(body: bytes) -> None:
        status, ctype, payload = post(client, path, body)
        fb.check_response(status, ctype, payload, f"{path} {body[:300]!r}")

    for p, body in FOUND:
        if p == path:
            run = example(fb.encode(fb.cap_for_real(body, fb.REAL.max_tokens)))(run)
    with client:
        run()
    assert_idle(real_server, timeout=60)
