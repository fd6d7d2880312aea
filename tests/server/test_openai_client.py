"""The official `openai` package against the server: chat and completions, streaming and not (greedy), and the
concatenated stream deltas equal the non-streamed text."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

PROMPT = "Write one sentence about soup:"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_completions_stream_equals_plain(server):
    client = server.openai()
    plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert plain.object == "text_completion" and len(plain.choices) == 1
    assert plain.usage.completion_tokens == 12 or plain.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)


def test_chat_stream_equals_plain(server):
    client = server.openai()
    plain = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=12, temperature=0)
    msg = plain.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert plain.usage.prompt_tokens > 0 and plain.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason


def test_max_completion_tokens_and_logprobs(server):
    client = server.openai()
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_completion_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    assert r.usage.completion_tokens <= 4
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[-1].logprob
    c = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                  echo=True)
    lp = c.choices[0].logprobs
    assert c.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and len(lp.tokens) == c.usage.prompt_tokens + c.usage.completion_tokens
    assert "".join(lp.tokens[:c.usage.prompt_tokens]) == PROMPT
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_models_and_errors(server):
    client = server.openai()
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-a-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=server.max_model_len + 1)
    assert str(server.max_model_len) in str(e.value)


def test_real_prefix_cache_hits_in_usage_and_metrics(real_server):
    """The same long prompt twice: the second request reports cached prompt tokens (whole 16-token blocks), the
    output does not change, and /metrics counts the hits."""
    client = real_server.openai()
    prompt = "Soup is a primarily liquid food, generally served warm or hot. " * 6
    before = real_server.metrics()
    first = client.completions.create(model=real_server.model, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=real_server.model, prompt=prompt, max_tokens=4, temperature=0)
    after = real_server.metrics()
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0
    assert second.choices[0].text == first.choices[0].text
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= cached
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]


def test_real_generation_tokens_metric_is_the_completion_tokens(real_server):
    """Requests ending on stop strings, several at once: vllm:generation_tokens_total grows by the sum of the
    responses' completion_tokens, as in vLLM (tokens the engine core sampled for a request after the API process
    found its stop string reach no client and are not counted). Whether the core gets ahead of the API process here
    is timing; tests/engine/test_generation_tokens_metric.py makes it happen every run."""
    client = real_server.openai()
    prompts = [f"Write two sentences about {topic}:" for topic in ("soup", "rain", "trains", "cats")]

    def complete(prompt: str, stop=None):
        return client.completions.create(model=real_server.model, prompt=prompt, max_tokens=20, temperature=0,
                                          stop=stop)

    texts = [complete(p).choices[0].text for p in prompts]
    stops = [[t.split()[len(t.split()) // 2]] if t.split() else None for t in texts]  # a word from the middle
    before = real_server.metrics()["vllm:generation_tokens_total"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(complete, prompts, stops))
    after = real_server.metrics()["vllm:generation_tokens_total"]
    assert any(r.choices[0].finish_reason == "stop" for r in responses)
    assert after - before == sum(r.usage.completion_tokens for r in responses)
