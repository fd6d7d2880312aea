"""End to end: `ladle bench serve` (as a subprocess, through `python -m ladle bench`) against `ladle serve` on the
default tiny model (SmolLM2-135M on CPU), with the AMD write-up's flags shortened to 8 prompts and 2 warm-ups.
Prompts are built through the server's /tokenize and /detokenize (no local tokenizer). Slow: the server's start-up
dominates (about 30-60 s on the shared 2-core machine)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from ladle_serve_process import LadleServeProcess  # tests/ladle_serve_process.py
from test_bench_cli import VLLM_FIELDS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ladle_server(tmp_path_factory):
    if importlib.util.find_spec("ladle.server.api") is None or importlib.util.find_spec(
            "ladle.engine.async_engine") is None:
        pytest.skip("`ladle serve` is not written yet")
    serve = LadleServeProcess(["--max-model-len", "1024", "--kv-cache-memory-bytes", "256M"],
                              tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield serve.url
    serve.stop()


def test_bench_serve_against_ladle_serve(ladle_server, tmp_path):
    cmd = [sys.executable, "-m", "ladle", "bench", "serve", "--backend", "vllm", "--base-url", ladle_server,
           "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
           "--random-range-ratio", "0.8", "--num-prompts", "8", "--max-concurrency", "8", "--request-rate", "inf",
           "--ignore-eos", "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
           "--result-dir", str(tmp_path), "--result-filename", "e2e.json", "--disable-tqdm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((tmp_path / "e2e.json").read_text())
    assert not [k for k in VLLM_FIELDS if k not in r]
    assert r["completed"] == 8 and r["failed"] == 0
    assert r["tokenizer_id"].startswith("server:")
    # ignore_eos: every request produced exactly the drawn output length, counted by the server's usage
    assert r["total_output_tokens"] == sum(r["output_lens"]) and all(1 <= n <= 15 for n in r["output_lens"])
    assert all(12 <= n <= 116 for n in r["input_lens"])  # [floor(64*0.2), ceil(64*1.8)] minus/plus re-tokenising
    assert 0 < r["median_ttft_ms"] and r["mean_e2el_ms"] >= r["mean_ttft_ms"]
    assert r["ladle"]["server"]["block_size"] == 16


def test_a_model_the_server_does_not_serve_is_named(ladle_server):
    """A wrong --model makes ladle's /tokenize answer 404: the bench names the model and the served ids, instead of
    saying that the server has no /tokenize."""
    cmd = [sys.executable, "-m", "ladle", "bench", "serve", "--base-url", ladle_server, "--model", "wrong-model",
           "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "2",
           "--disable-tqdm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--model wrong-model: the server does not serve it; it serves SmolLM2-135M-Instruct" in done.stderr
    assert "/tokenize is unavailable" not in done.stderr and "Traceback" not in done.stderr
