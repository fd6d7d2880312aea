"""What the server accepted or reported without honouring it, one test each:
- GET /version names the values in effect (KV cache dtype, the served model name, block size, tokenizer, load
  format), never "auto" or a null that stands for a default;
- a chat message whose role ladle does not handle is a 400 naming `messages[i].role` and the roles it handles,
  before the engine sees the request (chat and /tokenize);
- `stream_options` on a request that is not streamed is a 400 naming `stream_options` (both endpoints).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from fake_engine import FakeEngineClient
from harness import serving_fake
from ladle.engine.async_engine import AsyncEngine
from ladle.config import CacheConfig, EngineConfig, ModelConfig
from ladle.engine.config_resolve import config_in_effect, kv_cache_dtype_in_effect
from ladle.engine.engine_factory import build_engine, engine_config_from_kwargs
from ladle.server.api import build_app
from ladle.engine.tokenizer import CHAT_ROLES
from ladle.tools.checkpoint_m3 import make_checkpoint

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


# ---------------------------------------------------------------------------------------------- /version
def _leaves(value, path=""):
    """(dotted path, value) of every scalar of a nested dict / list."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, value


@pytest.mark.parametrize("flag,dtype,in_effect", [("auto", "float32", "float32"), ("auto", "bfloat16", "bfloat16"),
                                                  ("fp8", "bfloat16", "fp8_e4m3"), ("fp8_e5m2", "float16", "fp8_e5m2")])
def test_kv_cache_dtype_in_effect(flag, dtype, in_effect):
    assert kv_cache_dtype_in_effect(flag, dtype) == in_effect


def test_config_in_effect_fills_the_kv_budget_only_where_unset():
    source = SimpleNamespace(kind="hf_dir", path="/m", tokenizer_path="/m", hf_config={})
    unset = EngineConfig(model=ModelConfig(dtype="bfloat16", device="cuda"))
    given = EngineConfig(model=ModelConfig(dtype="bfloat16"), cache=CacheConfig(kv_cache_memory_bytes=5 << 20))
    assert config_in_effect(unset, source, "m", 123 << 20).cache.kv_cache_memory_bytes == 123 << 20
    assert config_in_effect(unset, source, "m").cache.kv_cache_memory_bytes is None  # not known (ranks)
    assert config_in_effect(given, source, "m", 123 << 20).cache.kv_cache_memory_bytes == 5 << 20
    effect = config_in_effect(unset, source, "m")
    assert (effect.model.load_format, effect.model.served_model_name, effect.cache.kv_cache_dtype) == (
        "safetensors", "m", "bfloat16")


def test_gpu_memory_utilization_is_null_where_it_sizes_nothing():
    source = SimpleNamespace(kind="hf_dir", path="/m", tokenizer_path="/m", hf_config={})
    cuda = EngineConfig(model=ModelConfig(dtype="bfloat16", device="cuda"), cache=CacheConfig(gpu_memory_utilization=0.7))
    assert config_in_effect(cuda, source, "m").cache.gpu_memory_utilization == 0.7
    given = EngineConfig(model=ModelConfig(dtype="bfloat16", device="cuda"),
                         cache=CacheConfig(gpu_memory_utilization=0.7, kv_cache_memory_bytes=5 << 20))
    cpu = EngineConfig(model=ModelConfig(dtype="float32", device="cpu"))
    assert config_in_effect(given, source, "m").cache.gpu_memory_utilization is None
    assert config_in_effect(cpu, source, "m").cache.gpu_memory_utilization is None


@pytest.fixture(scope="module")
def m3_checkpoint(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("m3") / "tiny"), "tiny", config_only=True)


def _version(path: str, **kwargs) -> tuple[dict, str, int]:
    """GET /version of an app over a real engine on CPU: (engine_config, the engine's model name, the scheduler's
    block size)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bundle = build_engine(engine_config_from_kwargs(path, device="cpu", max_model_len=512,
                                                        kv_cache_memory_bytes=8 << 20, **kwargs))
    finally:
        torch.set_num_threads(n)
    engine = AsyncEngine(bundle)
    with TestClient(build_app(engine)) as c:
        served = c.get("/version").json()["engine_config"]
        # the name /version reports is one the server answers to
        r = c.post("/tokenize", json={"model": served["model"]["served_model_name"], "prompt": "hi"})
        assert r.status_code == 200, r.text
    return served, engine.model_name, bundle.core.scheduler.block_size


def test_version_reports_the_values_in_effect(m3_checkpoint):
    served, name, block_size = _version(m3_checkpoint, load_format="dummy")
    assert served["cache"]["kv_cache_dtype"] == served["model"]["dtype"] == "float32"  # auto: the model dtype (CPU)
    assert served["model"]["served_model_name"] == name == m3_checkpoint
    assert served["cache"]["block_size"] == block_size > 0  # auto (0): M3's index block
    assert served["model"]["load_format"] == "dummy" and served["model"]["tokenizer"]
    auto = [p for p, v in _leaves(served) if v == "auto"]
    assert auto == []
    nulls = {p for p, v in _leaves(served) if v is None}
    # nothing given, nothing in effect (CPU: no GPU memory fraction sizes the cache)
    assert nulls <= {"model.hf_overrides", "model.quantization", "cache.gpu_memory_utilization"}, nulls


def test_version_reports_fp8_kv_the_given_name_and_the_format_read(tmp_path):
    path = make_checkpoint(str(tmp_path / "tiny"), "tiny")  # with safetensors weights
    served, name, _ = _version(path, kv_cache_dtype="fp8", served_model_name="m3-tiny")
    assert served["model"]["load_format"] == "safetensors"  # auto: what was read
    assert served["cache"]["kv_cache_dtype"] == "fp8_e4m3"  # vLLM's alias, resolved
    assert served["model"]["served_model_name"] == name == "m3-tiny"


# ---------------------------------------------------------------------------------------------- served fixtures
class _CountingEngine(FakeEngineClient):
    """FakeEngineClient that counts the requests it was given (a refusal must come before the engine)."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted = 0

    def generate(self, prompt_token_ids, sampling_params, request_id=None, stream_interval=1):
        self.submitted += 1
        return super().generate(prompt_token_ids, sampling_params, request_id, stream_interval)


@pytest.fixture(scope="module")
def counting_server():
    with serving_fake(_CountingEngine()) as server:
        yield server


def _refused(c, path: str, body: dict, param: str) -> str:
    r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param, err
    return err["message"]


# ---------------------------------------------------------------------------------------------- roles
@pytest.mark.parametrize("role", ["function", "bot", "User", "", "system "])
@pytest.mark.parametrize("stream", [False, True])
def test_unknown_role_is_refused_before_the_engine(counting_server, role, stream):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": role, "content": "x"}]
    engine = counting_server.engine
    before = engine.submitted
    with counting_server.client() as c:
        msg = _refused(c, CHAT, {"messages": messages, "max_tokens": 3, "stream": stream}, "messages[2].role")
        assert all(r in msg for r in CHAT_ROLES) and repr(role) in msg
        msg = _refused(c, "/tokenize", {"messages": messages}, "messages[2].role")
        assert all(r in msg for r in CHAT_ROLES)
    assert engine.submitted == before


@pytest.mark.parametrize("role", CHAT_ROLES)
def test_every_handled_role_is_served(counting_server, role):
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "more"}]
    with counting_server.client() as c:
        r = c.post(CHAT, json={"messages": messages, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------------------------------- stream_options
@pytest.mark.parametrize("path,body", [(CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
                                       (COMPLETIONS, {"prompt": "hi"})])
@pytest.mark.parametrize("stream", [False, None, "absent"])
@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": False}, {}])
def test_stream_options_without_stream_is_refused(counting_server, path, body, stream, options):
    body = {**body, "max_tokens": 3, "stream_options": options}
    if stream != "absent":
        body["stream"] = stream
    engine = counting_server.engine
    before = engine.submitted
    with counting_server.client() as c:
        msg = _refused(c, path, body, "stream_options")
        assert "stream: true" in msg
        # the same request streamed is served, and so is the plain one without stream_options
        with c.stream("POST", path, json={**body, "stream": True}) as r:
            raw = r.read()
        assert r.status_code == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
        plain = {k: v for k, v in body.items() if k != "stream_options"}
        assert c.post(path, json=plain).status_code == 200
    assert engine.submitted == before + 2


def test_stream_options_null_without_stream_is_accepted(counting_server):
    with counting_server.client() as c:
        r = c.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3, "stream_options": None})
    assert r.status_code == 200, r.text


def test_bench_client_sends_stream_options_only_when_streaming():
    from ladle.bench.request import RequestInput, build_payload

    for chat in (False, True):
        inp = RequestInput(prompt="hi", prompt_len=1, output_len=4, model="m", api_url="http://x", chat=chat)
        assert build_payload(inp)["stream"] is True and build_payload(inp)["stream_options"] == {"include_usage": True}
        inp.extra_body = {"stream": False}
        payload = build_payload(inp)
        assert payload["stream"] is False and "stream_options" not in payload


# ---------------------------------------------------------------------------------------------- param names
@pytest.mark.parametrize("body,param", [({"stop": [""]}, "stop"), ({"stop": ["ok", ""]}, "stop"),
                                        ({"stop_token_ids": [3, 2**64]}, "stop_token_ids"),
                                        ({"seed": 2**64}, "seed"), ({"top_k": 2**70}, "top_k")])
def test_sampling_refusals_name_their_field(counting_server, body, param):
    """A SamplingParams refusal names its field in `param`, also for the fields with a default factory (stop,
    stop_token_ids) that are no class attributes; integers beyond 64 bits are refused before the engine."""
    engine = counting_server.engine
    before = engine.submitted
    with counting_server.client() as c:
        msg = _refused(c, COMPLETIONS, {"prompt": "hi", "max_tokens": 3, **body}, param)
    assert param in msg and engine.submitted == before
