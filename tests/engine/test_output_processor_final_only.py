"""OutputProcessor(final_only=True), the offline LLM's mode, gives every request exactly the final RequestOutput that
the streaming mode's outputs add up to (the LLM kept the latest CompletionOutput of each choice and the last
RequestOutput's request fields): same text, token ids, logprobs, finish/stop reasons, errors, prompt logprobs, cached
tokens and queue time, with n > 1 choices finishing at different steps, stop strings, aborts and failed outputs;
and it reports the same stop hits and failures every step."""

from __future__ import annotations

import random

from helpers import make_bundle, tiny_model

from ladle.core.outputs import EngineOutput
from ladle.core.sampling_params import SamplingParams
from ladle.engine.client import CompletionOutput, RequestOutput
from ladle.engine.llm import LLM
from ladle.engine.logprobs import offline_request_output
from ladle.engine.output_processor import OutputProcessor

EOS = 2  # SmolLM2's <|im_end|>
ENDINGS = ["length", "eos", "stop_token", "abort", "error", "bad_output"]


def merged_final(outputs: list[RequestOutput]) -> RequestOutput:
    """What the LLM returned from streaming-mode outputs: the latest CompletionOutput of every choice, the request
    fields of the last RequestOutput (the reference the final-only mode must equal)."""
    latest: dict[int, CompletionOutput] = {}
    for ro in outputs:
        for co in ro.outputs:
            latest[co.index] = co
    last = outputs[-1]
    return RequestOutput(request_id=last.request_id, prompt_token_ids=last.prompt_token_ids,
                         outputs=[latest[i] for i in sorted(latest)], finished=last.finished,
                         num_cached_tokens=last.num_cached_tokens, prompt_logprobs=last.prompt_logprobs,
                         queue_time=last.queue_time)


def _token_ids(rng: random.Random, tok, n: int) -> list[int]:
    """Random ids mixing whole words, special tokens and lone bytes of multi-byte characters (held U+FFFD text)."""
    pools = [lambda: rng.randrange(3, len(tok)), lambda: rng.randrange(0, 17), lambda: rng.randrange(100, 260),
             lambda: rng.choice(tok.encode(" é漢字🙂 ok."))]
    return [rng.choice(pools)() for _ in range(n)]


def _logprobs(rng: random.Random, ids: list[int], k: int) -> list:
    return [[(t, -rng.random() * 5, rng.randrange(1, 99))] + [(rng.randrange(49152), -rng.random() * 9, r + 1)
                                                              for r in range(k)] for t in ids]


def _plan(rng: random.Random, tok, params: SamplingParams) -> list[dict]:
    """One child's EngineOutputs, in order, as kwargs; the last one finishes it (token ids end in the EOS / stop
    token for those endings; 'bad_output' carries a token id the tokenizer cannot decode)."""
    ids = _token_ids(rng, tok, rng.randrange(1, 40))
    ending = rng.choice(ENDINGS)
    if ending == "eos":
        ids[-1] = EOS
    chunks, i = [], 0
    while i < len(ids):
        step = 1 if rng.random() < 0.85 else 2
        chunks.append(ids[i:i + step])
        i += step
    plan = [dict(new_token_ids=c) for c in chunks]
    if ending in ("abort", "error"):
        plan.append(dict(new_token_ids=[], finish_reason=ending,
                         error="RuntimeError: injected" if ending == "error" else None))
    elif ending == "bad_output":
        plan.insert(rng.randrange(len(plan)), dict(new_token_ids=[None]))
        plan[-1].update(finish_reason="length")
    else:
        plan[-1].update(finish_reason="length" if ending == "length" else "stop",
                        stop_reason=plan[-1]["new_token_ids"][-1] if ending == "stop_token" else None)
    for out in plan:
        if params.logprobs is not None:
            out["new_logprobs"] = _logprobs(rng, out["new_token_ids"], params.logprobs)
    return plan


def _params(rng: random.Random, tok) -> SamplingParams:
    sample = tok.decode(_token_ids(rng, tok, 30))
    stops = []
    for _ in range(rng.randrange(0, 3)):  # pieces of likely text: some match, some never do
        start = rng.randrange(len(sample))
        stops.append(sample[start:start + rng.randrange(1, 4)] if rng.random() < 0.7 else "\x00never")
    return SamplingParams(n=rng.choice([1, 1, 2, 3]), max_tokens=64, stop=[s for s in stops if s],
                          include_stop_str_in_output=rng.random() < 0.3, skip_special_tokens=rng.random() < 0.7,
                          min_tokens=rng.choice([0, 0, 3]), logprobs=rng.choice([None, 0, 2]),
                          prompt_logprobs=rng.choice([None, 1]))


def _drive(rng: random.Random, tok, num_requests: int, counts: dict) -> None:
    """Feed one random stream to both modes in lockstep and compare."""
    stream, final = OutputProcessor(tok), OutputProcessor(tok, final_only=True)
    plans: dict[str, list[dict]] = {}
    first: dict[str, dict] = {}
    for r in range(num_requests):
        pid, params = f"req-{r}", _params(rng, tok)
        prompt = _token_ids(rng, tok, rng.randrange(1, 12))
        children = stream.add_request(pid, prompt, params)
        assert final.add_request(pid, prompt, params) == children
        first[children[0]] = dict(num_cached_tokens=rng.choice([0, 16]), queue_time=rng.random(),
                                  prompt_logprobs=None if params.prompt_logprobs is None
                                  else [None] + _logprobs(rng, prompt[1:], 1))
        for child in children:
            plans[child] = [dict(out, num_prompt_tokens=len(prompt)) for out in _plan(rng, tok, params)]
    streamed: dict[str, list[RequestOutput]] = {}
    finals: dict[str, RequestOutput] = {}
    echoes: list[EngineOutput] = [EngineOutput("unknown-child", [5])]
    while plans or echoes:
        outs, echoes = echoes, []
        for child in list(plans):
            if rng.random() < 0.7:
                extra = first.pop(child, {}) if child in first else {}
                outs.append(EngineOutput(child, **plans[child].pop(0), **extra))
                if not plans[child]:
                    del plans[child]
        a, b = stream.process(outs), final.process(outs)
        assert (a.stop_hits, a.failed_ids) == (b.stop_hits, b.failed_ids)
        for child, stop in a.stop_hits:  # the engine finishes it; its echo must be ignored
            plans.pop(child, None)
            echoes.append(EngineOutput(child, [], finish_reason="stop", stop_reason=stop))
        for child in a.failed_ids:
            plans.pop(child, None)
            echoes.append(EngineOutput(child, [], finish_reason="error", error="failed"))
        counts["stop_hits"] += len(a.stop_hits)
        counts["failed"] += len(a.failed_ids)
        for ro in a.request_outputs:
            streamed.setdefault(ro.request_id, []).append(ro)
        for ro in b.request_outputs:
            assert ro.finished and ro.request_id not in finals, "final-only reports a request once, finished"
            finals[ro.request_id] = ro
        assert sorted(finals) == sorted(pid for pid, ros in streamed.items() if ros[-1].finished)
    assert sorted(finals) == sorted(f"req-{r}" for r in range(num_requests))
    assert stream.parent_ids == final.parent_ids == []
    for pid, ros in streamed.items():
        assert finals[pid] == merged_final(ros)
        steps = [max(i for i, ro in enumerate(ros) for co in ro.outputs if co.index == c.index and co.finished)
                 for c in finals[pid].outputs]
        counts["n_uneven"] += len(set(steps)) > 1
        counts["errors"] += any(c.finish_reason == "error" for c in finals[pid].outputs)
        counts["aborts"] += any(c.finish_reason == "abort" for c in finals[pid].outputs)


def test_final_only_equals_streamed_final_outputs(smollm2_tokenizer):
    counts = dict(stop_hits=0, failed=0, n_uneven=0, errors=0, aborts=0)
    for seed in range(40):
        _drive(random.Random(seed), smollm2_tokenizer, num_requests=6, counts=counts)
    assert all(v > 0 for v in counts.values()), counts
    print(counts)  # every case was exercised


def test_final_only_fail_all_reports_every_open_request(smollm2_tokenizer):
    stream, final = OutputProcessor(smollm2_tokenizer), OutputProcessor(smollm2_tokenizer, final_only=True)
    for proc in (stream, final):
        proc.add_request("a", [5, 6], SamplingParams(n=2, max_tokens=8))
        proc.add_request("b", [7], SamplingParams(max_tokens=8))
    outs = [EngineOutput("a-0", [300]), EngineOutput("b", [301])]
    assert len(stream.process(outs).request_outputs) == 2 and final.process(outs).request_outputs == []
    a = stream.fail_all("engine died")
    b = final.fail_all("engine died")
    assert [ro.request_id for ro in b.request_outputs] == ["a", "b"]
    assert [ro.request_id for ro in a.request_outputs] == ["a", "b"]
    for ro_final, ro_stream in zip(b.request_outputs, a.request_outputs):  # every choice finishes in this call
        assert ro_final == ro_stream and all(c.finish_reason == "error" for c in ro_final.outputs)
    assert b.request_outputs[0].outputs[0].token_ids == [300] and b.request_outputs[0].outputs[0].error == "engine died"


def test_llm_generate_equals_streamed_replay(smollm2_tokenizer):
    """Through the real engine: the LLM's results equal what the streaming mode makes of the same EngineOutputs
    (in the offline API's logprobs form, engine/logprobs.py, as LLM returns them)."""
    tok = smollm2_tokenizer
    llm = LLM(bundle=make_bundle(tiny_model(seed=0), tokenizer=tok, async_scheduling=True))
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    base = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop = base.text[6:9]
    assert len(stop) == 3
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], logprobs=1)] + [
        SamplingParams(temperature=1.0, seed=3 + i, n=3, max_tokens=20, ignore_eos=True, prompt_logprobs=1,
                       stop=[" a", "e"], logprobs=2) for i in range(3)]
    steps: list[list[EngineOutput]] = []
    real_step = llm.core.step
    llm.core.step = lambda: steps.append(real_step()) or steps[-1]
    outs = llm.generate(prompts, params)
    replay = OutputProcessor(tok)
    for ro, prompt, p in zip(outs, prompts, params):
        replay.add_request(ro.request_id, prompt, p)
    streamed: dict[str, list[RequestOutput]] = {}
    for step in steps:
        for ro in replay.process(step).request_outputs:
            streamed.setdefault(ro.request_id, []).append(ro)
    assert [offline_request_output(merged_final(streamed[ro.request_id]), llm._token_texts) for ro in outs] == outs
    assert any(c.finish_reason == "stop" for ro in outs for c in ro.outputs)
    assert any(len({len(c.token_ids) for c in ro.outputs}) > 1 for ro in outs)  # choices finish at different steps
