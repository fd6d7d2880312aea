"""The correctness gate of `ladle bench serve --gate ...`, run before and after the load (issue 15).

`--gate gsm8k[:N]`: GSM8K, 5-shot, greedy. `--gate-data PATH` is a JSONL of {"question", "answer"} (the answer
ends in "#### <final>"); its first 5 records are the shots, the next N (default 100) the questions. The prompt is
the lm-evaluation-harness gsm8k layout ("Question: q\\nAnswer: a\\n\\n" per shot, then "Question: q\\nAnswer:"),
generation stops at "Question:" (or after `--gate-max-tokens`, default 256), and strict match takes the first "#### <number>" of the
completion, commas, "$" and a final "." removed (lm-eval's gsm8k strict-match filter and exact_match settings);
flexible match takes the last number of the completion (lm-eval's gsm8k "flexible-extract" filter, same
normalisation). Passes when every question's extracted answers (strict and flexible) are the same before and
after the load (so both accuracies are too).

`--gate reference FILE`: greedy continuations (32 tokens) of the fixed GATE_PROMPTS, compared token by token to
FILE (written earlier with `--save-gate FILE`, e.g. by a reference engine or dtype), before and after the load;
passes when both runs equal the file. The first-divergence token position of each prompt and run is reported
(`divergence` in the JSON result, a table in the report's Correctness section).
`--save-gate FILE` alone writes the continuations of the run before the load.

Requests go one at a time (a fixed batch composition, so the two runs are comparable), temperature 0.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

import aiohttp

SHOTS = 5
GSM8K_MAX_TOKENS = 256
REFERENCE_MAX_TOKENS = 32
GATE_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "The three primary colours are",
    "Water boils at a temperature of",
)
GSM8K_STOP = "Question:"
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
# lm-evaluation-harness gsm8k.yaml, filter "flexible-extract": regex (-?[$0-9.,]{2,})|(-?[0-9]+), last match
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def parse_gate(values: Optional[list[str]]) -> Optional[dict[str, Any]]:
    """['gsm8k'] / ['gsm8k:N'] / ['reference', FILE] -> {"kind", "n" | "file"}; None for no gate. Raises ValueError."""
    if not values:
        return None
    kind = values[0]
    if kind.startswith("gsm8k"):
        n = int(kind.split(":", 1)[1]) if ":" in kind else 100
        if n <= 0 or len(values) > 1:
            raise ValueError("--gate gsm8k[:N] takes a positive N and no file")
        return {"kind": "gsm8k", "n": n}
    if kind == "reference":
        if len(values) != 2:
            raise ValueError("--gate reference takes one FILE (written earlier by --save-gate)")
        return {"kind": "reference", "file": values[1]}
    raise ValueError(f"unknown --gate {kind!r}: use gsm8k[:N] or reference FILE")


def strict_answer(text: str) -> Optional[str]:
    """The first '#### <number>' of `text`, normalised; None when there is none."""
    m = _STRICT.search(text)
    return None if m is None else _normalise(m.group(1))


def flexible_answer(text: str) -> Optional[str]:
    """The last number of `text` (either alternative of the flexible regex), normalised; None when there is none."""
    found = _FLEXIBLE.findall(text)
    if not found:
        return None
    return _normalise(next(g for g in found[-1] if g))


def answers_of(completion: str) -> tuple[Optional[str], Optional[str]]:
    """(strict, flexible) answers of a completion, cut at the gate's stop string first (as the server cuts it)."""
    text = completion.split(GSM8K_STOP, 1)[0]
    return strict_answer(text), flexible_answer(text)


def _normalise(s: str) -> str:
    return re.sub(r"\.$", "", s.replace(",", "").replace("$", "").strip())


def gsm8k_prompts(path: str, n: int) -> tuple[list[str], list[str]]:
    """(prompts, gold answers) of questions SHOTS..SHOTS+n-1 of the JSONL at `path`."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) < SHOTS + n:
        raise ValueError(f"--gate-data {path} has {len(rows)} records; {SHOTS} shots + {n} questions needed")
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows[:SHOTS])
    qs = rows[SHOTS:SHOTS + n]
    return [f"{shots}Question: {r['question']}\nAnswer:" for r in qs], \
        [_normalise(r["answer"].split("####")[-1]) for r in qs]


async def _complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
                    stop: Optional[list[str]]) -> tuple[str, list[str]]:
    """(text, tokens) of one greedy completion (tokens from logprobs=0)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    if stop:
        body["stop"] = stop
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"gate request failed with HTTP {r.status}: {str(data)[:300]}")
    choice = data["choices"][0]
    return choice["text"], list((choice.get("logprobs") or {}).get("tokens") or [])


async def _room(session: aiohttp.ClientSession, base_url: str, model: str, prompt: str, want: int) -> int:
    """min(want, max_model_len - prompt tokens) from the server's /v1/models and /tokenize; `want` when the
    server does not say."""
    try:
        async with session.get(base_url + "/v1/models") as r:
            limit = (await r.json(content_type=None))["data"][0].get("max_model_len")
        async with session.post(base_url + "/tokenize", json={"model": model, "prompt": prompt}) as r:
            count = (await r.json(content_type=None))["count"]
    except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError):
        return want
    return max(1, min(want, limit - count)) if limit else want


async def run_once(session: aiohttp.ClientSession, base_url: str, model: str, spec: dict,
                   gate_data: Optional[str], max_tokens: int = GSM8K_MAX_TOKENS) -> dict[str, Any]:
    """One pass: {"answers" | "continuations": [...], "accuracy"?}."""
    url = base_url + "/v1/completions"
    if spec["kind"] == "gsm8k":
        if not gate_data:
            raise ValueError("--gate gsm8k needs --gate-data PATH (a GSM8K JSONL)")
        prompts, gold = gsm8k_prompts(gate_data, spec["n"])
        answers, flexible = [], []
        for p in prompts:
            room = await _room(session, base_url, model, p, max_tokens)
            strict, flex = answers_of((await _complete(session, url, model, p, room, [GSM8K_STOP]))[0])
            answers.append(strict)
            flexible.append(flex)
        return {"answers": answers, "flexible": flexible, "gold": gold, "accuracy": _accuracy(answers, gold),
                "flexible_accuracy": _accuracy(flexible, gold)}
    conts = []
    for p in GATE_PROMPTS:
        text, tokens = await _complete(session, url, model, p, REFERENCE_MAX_TOKENS, None)
        conts.append({"prompt": p, "text": text, "tokens": tokens})
    return {"continuations": conts}


def _accuracy(answers: list[Optional[str]], gold: list[str]) -> float:
    return sum(a == g for a, g in zip(answers, gold)) / len(gold)


def first_divergence(a: list[str], b: list[str]) -> Optional[int]:
    """Index of the first differing token (the shorter length when one is a prefix), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def verdict(spec: dict, before: dict, after: dict) -> dict[str, Any]:
    """{"kind", "passed", "summary", "details", "before", "after"} for the JSON result and the report."""
    if spec["kind"] == "gsm8k":
        return _gsm8k_verdict(before, after)
    with open(spec["file"]) as f:
        ref = json.load(f)["continuations"]
    details, failed, divergence = [], 0, []
    for i, r in enumerate(ref):
        row = {"prompt": r["prompt"]}
        for phase, run in (("before", before), ("after", after)):
            conts = run["continuations"]
            c = conts[i] if i < len(conts) else {"text": None, "tokens": []}  # a prompt the run lacks diverges at 0
            pos = first_divergence(r["tokens"], c["tokens"]) if r["tokens"] or c["tokens"] else (
                None if r["text"] == c["text"] else 0)
            row[phase] = pos
            if pos is not None:
                failed += 1
                details.append(f"{phase}: {r['prompt']!r} diverges at token {pos}")
        divergence.append(row)
    n = len(ref)
    summary = (f"{n} prompts x 2 runs against {spec['file']}: {2 * n - failed} identical, {failed} diverged")
    return {"kind": "reference", "passed": failed == 0, "summary": summary, "details": details,
            "divergence": divergence, "before": before, "after": after}


def _gsm8k_verdict(before: dict, after: dict) -> dict[str, Any]:
    """Passes when no question's strict or flexible answer changed between the two runs."""
    flex_b, flex_a = before.get("flexible") or before["answers"], after.get("flexible") or after["answers"]
    changed = [i for i, (x, y) in enumerate(zip(before["answers"], after["answers"])) if x != y]
    changed_flex = [i for i, (x, y) in enumerate(zip(flex_b, flex_a)) if x != y]
    n = len(before["answers"])
    acc = (before["accuracy"], after["accuracy"])
    flex = (before.get("flexible_accuracy", acc[0]), after.get("flexible_accuracy", acc[1]))
    summary = (f"strict-match accuracy {acc[0]:.3f} before and {acc[1]:.3f} after the load on {n} questions "
               f"(flexible {flex[0]:.3f} / {flex[1]:.3f}); {len(changed)} strict and {len(changed_flex)} flexible "
               f"answers changed")
    details = [f"question {i}: {before['answers'][i]!r} -> {after['answers'][i]!r}" for i in changed]
    details += [f"question {i} (flexible): {flex_b[i]!r} -> {flex_a[i]!r}" for i in changed_flex]
    return {"kind": "gsm8k", "passed": not changed and not changed_flex, "summary": summary, "details": details,
            "accuracy_before": acc[0], "accuracy_after": acc[1], "flexible_accuracy_before": flex[0],
            "flexible_accuracy_after": flex[1], "changed": changed, "changed_flexible": changed_flex,
            "before": before, "after": after}


def save(path: str, run: dict) -> None:
    """Write a reference file (`--save-gate`): {"continuations": [{"prompt", "text", "tokens"}]}."""
    with open(path, "w") as f:
        json.dump({"continuations": run["continuations"], "max_tokens": REFERENCE_MAX_TOKENS}, f, indent=1)
