"""End to end: `ladle bench serve --report DIR --gate gsm8k:5` against a real `ladle serve` of the default tiny
model (SmolLM2-135M on CPU), then `--gate reference FILE` with the file the first run saved. The report's numbers
must come from the run: the shape histogram's tokens equal the tokens the run scheduled (prompt tokens + every
output token but the last, with prefix caching off), and the fast-path table's calls equal the kernel launches of
section 1. Slow: server start-up and the 2 x 5 GSM8K-format questions (answers capped at 48 tokens to keep it near a minute)."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from gsm8k_format import write_gsm8k_format  # tests/bench/gsm8k_format.py
from ladle_serve_process import LadleServeProcess  # tests/ladle_serve_process.py

pytestmark = pytest.mark.slow
SECTIONS = ["1. Local shapes", "2. Repeated work", "3. Bytes moved", "4. Fast paths", "5. Queues", "Correctness"]


@pytest.fixture(scope="module")
def ladle_server(tmp_path_factory):
    if importlib.util.find_spec("ladle.engine.async_engine") is None:
        pytest.skip("`ladle serve` is not written yet")
    serve = LadleServeProcess(["--max-model-len", "2048", "--kv-cache-memory-bytes", "256M",
                               "--no-enable-prefix-caching"], tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield serve.url
    serve.stop()


def _bench(url: str, tmp_path: pathlib.Path, name: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "ladle", "bench", "serve", "--backend", "vllm", "--base-url", url,
           "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "6",
           "--num-prompts", "6", "--max-concurrency", "3", "--disable-tqdm", "--save-result",
           "--result-dir", str(tmp_path), "--result-filename", name, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp_path / name).read_text())


def test_report_and_gates_against_ladle_serve(ladle_server, tmp_path):
    out, ref = tmp_path / "report", tmp_path / "gate_ref.json"
    data = write_gsm8k_format(tmp_path / "gsm8k_format.jsonl")
    r = _bench(ladle_server, tmp_path, "a.json", ["--report", str(out), "--gate", "gsm8k:5", "--gate-data",
                                                  str(data), "--gate-max-tokens", "48", "--save-gate", str(ref)])
    md = (out / "report.md").read_text()
    assert re.findall(r"^## (.+)$", md, re.M) == SECTIONS
    for body in re.split(r"^## .+$", md, flags=re.M)[1:]:  # each section ends with its one-sentence headline
        assert body.strip().splitlines()[-1].rstrip().endswith(".")
    for png in ("shapes.png", "roofline.png", "queues.png"):
        assert (out / png).stat().st_size > 1000
    rep = json.loads((out / "report.json").read_text())
    rec = rep["record"]
    scheduled = sum(r["input_lens"]) + sum(n - 1 for n in r["output_lens"])
    assert rec["totals"]["tokens"] == scheduled
    assert sum(row["tokens"] for row in rec["shapes"] if row["op"] == "qkv_proj") == scheduled
    assert f"tokens the run scheduled: {scheduled}." in md
    assert sum(row["launches"] for row in rec["shapes"] if row["op"] == "lm_head") == rec["totals"]["steps"]
    for op, buckets in rec["kernels"].items():
        assert rec["dispatch"][op]["calls"] == sum(buckets.values()), op
    assert rec["totals"]["compute.weights_read"] > 0 and rec["totals"]["persistent.kv_written"] > 0
    assert set(rep["headlines"]) == set(SECTIONS)
    gate = r["ladle"]["gate"]
    assert gate["kind"] == "gsm8k" and gate["passed"] and gate["accuracy_before"] == gate["accuracy_after"]
    assert "Correctness gate PASSED" in md
    saved = json.loads(ref.read_text())["continuations"]
    assert len(saved) == 5 and all(c["tokens"] for c in saved)
    r2 = _bench(ladle_server, tmp_path, "b.json", ["--gate", "reference", str(ref), "--num-prompts", "2"])
    assert r2["ladle"]["gate"]["passed"], r2["ladle"]["gate"]
    assert not os.path.exists(tmp_path / "report2")
