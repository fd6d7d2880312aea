"""sharegpt-style and custom JSONL datasets: vLLM's filters, shuffling under --seed, output lengths."""

from __future__ import annotations

import json

from ladle.bench.datasets import sample_custom, sample_sharegpt
from test_random_dataset import WordTokenizer


def _conv(p_words, c_words):
    return {"conversations": [{"from": "human", "value": " ".join(["w5"] * p_words)},
                              {"from": "gpt", "value": " ".join(["w6"] * c_words)}]}


def test_sharegpt_filters_and_lengths(tmp_path):
    data = [_conv(10, 20), _conv(3, 20), _conv(10, 2), _conv(1100, 10), _conv(1000, 1100), _conv(50, 60),
            {"conversations": [{"from": "human", "value": "w1"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sample_sharegpt(WordTokenizer(), str(path), 10, None, seed=0, oversample=False)
    # kept: prompt >= 4, output >= 4, prompt <= 1024, prompt + output <= 2048
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(10, 20), (50, 60)]
    fixed = sample_sharegpt(WordTokenizer(), str(path), 4, 7, seed=0, oversample=False)
    assert len(fixed) == 4 and all(r.expected_output_len == 7 for r in fixed)
    over = sample_sharegpt(WordTokenizer(), str(path), 5, None, seed=0)
    assert len(over) == 5 and {r.prompt_len for r in over} == {10, 50}  # oversampled to --num-prompts


def test_custom_jsonl_shuffle_and_output_override(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"w{i} w{i}", **({"output_tokens": 3} if i == 2 else {})}) + "\n"
                            for i in range(10)))
    ordered = sample_custom(WordTokenizer(), str(path), 10, 64, seed=0, shuffle=False)
    assert [r.prompt for r in ordered] == [f"w{i} w{i}" for i in range(10)]
    assert [r.expected_output_len for r in ordered] == [64, 64, 3] + [64] * 7
    a = sample_custom(WordTokenizer(), str(path), 10, 64, seed=1)
    b = sample_custom(WordTokenizer(), str(path), 10, 64, seed=1)
    assert [r.prompt for r in a] == [r.prompt for r in b] != [r.prompt for r in ordered]
    assert all(r.prompt_len == 2 for r in a)
