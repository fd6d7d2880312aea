"""The correctness gate's pieces (ladle/bench/gate.py): flag parsing, GSM8K strict match, prompts, verdicts."""

from __future__ import annotations

import json

import pytest

from ladle.bench import gate


def test_parse_gate():
    assert gate.parse_gate(None) is None
    assert gate.parse_gate(["gsm8k"]) == {"kind": "gsm8k", "n": 100}
    assert gate.parse_gate(["gsm8k:5"]) == {"kind": "gsm8k", "n": 5}
    assert gate.parse_gate(["reference", "ref.json"]) == {"kind": "reference", "file": "ref.json"}
    for bad in (["gsm8k:0"], ["reference"], ["mmlu"], ["gsm8k", "x"]):
        with pytest.raises(ValueError):
            gate.parse_gate(bad)


def test_strict_match_follows_lm_eval():
    assert gate.strict_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert gate.strict_answer("#### 1,234.") == "1234"
    assert gate.strict_answer("#### -5 then #### 6") == "-5"
    assert gate.strict_answer("The answer is 7") is None


def test_gsm8k_prompts_use_the_first_five_records_as_shots(tmp_path):
    rows = [{"question": f"q{i}?", "answer": f"step {i}\n#### {i * 1000}"} for i in range(8)]
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    prompts, gold = gate.gsm8k_prompts(str(path), 2)
    assert gold == ["5000", "6000"]
    assert prompts[0].startswith("Question: q0?\nAnswer: step 0\n#### 0\n\n")
    assert prompts[0].endswith("Question: q5?\nAnswer:") and "q4?" in prompts[0] and "q5?" not in prompts[1]
    with pytest.raises(ValueError):
        gate.gsm8k_prompts(str(path), 4)


def test_verdicts(tmp_path):
    spec = {"kind": "gsm8k", "n": 2}
    before = {"answers": ["7", None], "gold": ["7", "3"], "accuracy": 0.5}
    assert gate.verdict(spec, before, dict(before))["passed"]
    v = gate.verdict(spec, before, {"answers": ["7", "3"], "gold": ["7", "3"], "accuracy": 1.0})
    assert not v["passed"] and v["changed"] == [1] and v["accuracy_after"] == 1.0
    run = {"continuations": [{"prompt": "a", "text": "xyz", "tokens": ["x", "y", "z"]}]}
    ref = tmp_path / "ref.json"
    gate.save(str(ref), run)
    spec = {"kind": "reference", "file": str(ref)}
    assert gate.verdict(spec, run, run)["passed"]
    other = {"continuations": [{"prompt": "a", "text": "xyw", "tokens": ["x", "y", "w"]}]}
    v = gate.verdict(spec, run, other)
    assert not v["passed"] and v["details"] == ["after: 'a' diverges at token 2"]
    assert gate.first_divergence(["a"], ["a", "b"]) == 1 and gate.first_divergence(["a"], ["a"]) is None


def test_flexible_match_takes_the_last_number():
    assert gate.flexible_answer("3 + 4 = 7 apples, so $1,200.") == "1200"
    assert gate.flexible_answer("first 12 then 5") == "5"
    assert gate.flexible_answer("no digits") is None
    assert gate.answers_of(" 2 + 3 = 5.\n#### 5\n\nQuestion: 9 apples") == ("5", "5")
    assert gate.answers_of(" it is 41 or 42") == (None, "42")


def test_gsm8k_verdict_fails_when_a_flexible_answer_changes():
    spec = {"kind": "gsm8k", "n": 2}
    before = {"answers": [None, "3"], "flexible": ["8", "3"], "gold": ["7", "3"], "accuracy": 0.5,
              "flexible_accuracy": 0.5}
    after = dict(before, flexible=["7", "3"], flexible_accuracy=1.0)
    v = gate.verdict(spec, before, after)
    assert not v["passed"] and v["changed"] == [] and v["changed_flexible"] == [0]
    assert v["flexible_accuracy_after"] == 1.0 and "question 0 (flexible): '8' -> '7'" in v["details"]


def test_reference_verdict_carries_first_divergence_positions(tmp_path):
    ref = tmp_path / "ref.json"
    gate.save(str(ref), {"continuations": [{"prompt": "a", "text": "xyz", "tokens": ["x", "y", "z"]},
                                           {"prompt": "b", "text": "pq", "tokens": ["p", "q"]}]})
    run = {"continuations": [{"prompt": "a", "text": "xyz", "tokens": ["x", "y", "z"]},
                             {"prompt": "b", "text": "p", "tokens": ["p"]}]}
    other = {"continuations": [{"prompt": "a", "text": "xw", "tokens": ["x", "w"]},
                               {"prompt": "b", "text": "pq", "tokens": ["p", "q"]}]}
    v = gate.verdict({"kind": "reference", "file": str(ref)}, run, other)
    assert v["divergence"] == [{"prompt": "a", "before": None, "after": 1}, {"prompt": "b", "before": 1, "after": None}]
    from ladle.bench.bottleneck_report import correctness

    lines, head = correctness({k: x for k, x in v.items() if k not in ("before", "after")})
    assert "| 'a' | - | 1 |" in lines and "| 'b' | 1 | - |" in lines and head.startswith("Correctness gate FAILED")
