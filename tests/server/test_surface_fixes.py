"""Request fields ladle used to accept and drop, one test each: `add_special_tokens` on /tokenize with `messages`,
`parallel_tool_calls` on chat completions; and the 413 body's shape."""

from __future__ import annotations

import json

import pytest

from fake_engine import IM_START, FakeEngineClient, FakeTokenizer
from harness import Server, start_fake


class _BosTokenizer(FakeTokenizer):
    """FakeTokenizer that puts a BOS (<|im_start|>, id 256) in front when asked to add special tokens."""

    bos_token_id = IM_START

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([IM_START] if add_special_tokens else []) + super().encode(text, add_special_tokens)


def _serve(engine: FakeEngineClient, **server_config):
    server, thread, url = start_fake(engine, **server_config)
    return Server("fake", url, engine.model_name, engine.max_model_len, engine), server, thread


@pytest.fixture(scope="module")
def bos_server():
    engine = FakeEngineClient()
    engine.tokenizer = _BosTokenizer()
    handle, server, thread = _serve(engine)
    yield handle
    server.should_exit = True
    thread.join(timeout=10)


def test_tokenize_messages_honours_add_special_tokens(bos_server):
    messages = [{"role": "user", "content": "hi"}]
    template = [IM_START] + list(b"user\nhi") + [257] + list(b"\n") + [IM_START] + list(b"assistant\n")
    with bos_server.client() as c:
        # chat form: the template writes the special tokens, so none are added by default (as in vLLM)
        default = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
        off = c.post("/tokenize", json={"messages": messages, "add_special_tokens": False}).json()["tokens"]
        on = c.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()["tokens"]
        # completion form: added by default
        prompt = c.post("/tokenize", json={"prompt": "hi"}).json()["tokens"]
        prompt_off = c.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False}).json()["tokens"]
    assert default == off == template
    assert on == [IM_START] + template
    assert prompt == [IM_START] + list(b"hi") and prompt_off == list(b"hi")
