"""Smoke test of benchmarks/offline_throughput.py on a tiny random Llama (CPU, float32, a few seconds).

Checks the script end to end (ladle dummy weights, transformers dynamic + static cache, the exact-count checks,
the table's ratios, the JSON) and that --check-parity compares real greedy tokens: it passes when ladle loads the
transformers weights and fails when ladle is made to use other (dummy) weights instead.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers import TINY_LLAMA

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import offline_throughput as ot  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A config-only model dir: TINY_LLAMA's config.json plus a word-level tokenizer over the same 512 ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_cfg")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_LLAMA["vocab_size"])}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>") \
        .save_pretrained(str(path))
    with open(path / "config.json", "w") as f:
        json.dump({**TINY_LLAMA, "bos_token_id": 1, "eos_token_id": 2}, f)
    return str(path)


def _argv(model_dir, out, *extra):
    return ["--model", model_dir, "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "4", "--repeats", "1",
            "--out", str(out), *extra]


def test_smoke_run_table_and_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "ot.json"
    assert ot.main(_argv(tiny_dir, out, "--check-parity", "--variants", "ladle={}")) == 0
    res = json.loads(out.read_text())
    assert res["failures"] == [] and res["parity"]["ok"] and res["parity"]["matched_tokens"] == 2 * 16
    systems = {(r["system"], r["batch"]) for r in res["rows"]}
    assert systems == {(s, b) for s in ("ladle", "hf-dynamic", "hf-static") for b in (1, 2)}
    for r in res["rows"]:
        assert r["out_tok_s"] > 0 and len(r["runs_tok_s"]) == 1
        if r["system"] == "ladle":
            hf = {x["system"]: x["out_tok_s"] for x in res["rows"] if x["batch"] == r["batch"]}
            assert r["x_hf_dynamic"] == pytest.approx(r["out_tok_s"] / hf["hf-dynamic"])
            assert r["x_hf_static"] == pytest.approx(r["out_tok_s"] / hf["hf-static"])
            assert r["decode_steps"] == 3 and r["step_ms"] > 0  # 4 tokens: 1 from the prefill step, 3 decode steps
    assert "RANDOM" in res["env"]["weights"] and "ladle/hf-static" in capsys.readouterr().out


def test_parity_check_detects_other_weights(tiny_dir, monkeypatch):
    import ladle.engine.llm

    real = ladle.engine.llm.LLM
    monkeypatch.setattr(ladle.engine.llm, "LLM", lambda model, **kw: real(model, **{**kw, "load_format": "dummy"}))
    args = ot.parse_args(_argv(tiny_dir, "/dev/null", "--check-parity"))
    res = ot.check_parity(args, dict(TINY_LLAMA), ot.torch.device("cpu"))
    assert not res["ok"] and res["first_divergence"] is not None and res["matched_tokens"] < res["total_tokens"]
