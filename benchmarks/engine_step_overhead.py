"""Engine CPU overhead per decode step: where the host time of one `EngineCore.step` (+ output processing) goes.

Builds the real engine (`build_engine`, the path `LLM` and the server use) around a model whose forward is nearly
free: SmolLM2-135M's config.json and tokenizer with `--load-format dummy` and --hf-overrides shrinking it to
hidden 64, one layer (vocab stays 49152, so the sampler, logits and detokenizer see SmolLM2's real sizes). Then
B concurrent requests (--input-len random prompt ids / --output-len outputs, ignore_eos) run to completion, once
greedy and once with temperature 1 + top_p 0.9, and every decode step (all B requests feeding one token) is split
with time.perf_counter hooks wrapped around the engine's own calls (nothing in ladle is instrumented):

  schedule      Scheduler.schedule
  prepare       runner: per-request state updates + model inputs (input_batch)
  forward       runner._forward (CUDA: graph replay or eager launches; CPU: the math itself)
  logits        model.compute_logits
  sample_prep   per-row sampling parameters -> tensors
  sampler       Sampler.sample (+ compute_logprobs) (CUDA: launches; CPU: the math itself)
  d2h           the runner's one device->host copy (Tensor.tolist; on CUDA it includes waiting for the GPU)
  runner_other  the rest of ModelRunner.execute (RunnerOutput assembly, bookkeeping)
  update        Scheduler.update
  output        OutputProcessor.process (detokenization, stop strings, RequestOutput)
  other         the rest of the step loop
  total         wall time of one step + its output processing
  overhead      engine bookkeeping: schedule + prepare + sample_prep + runner_other + update + output + other
  host          total - d2h: on CUDA, the CPU time of the step (launches included) outside the wait for the GPU

A step runs from one `EngineCore.step` call to the next, so it includes the driving loop's work on its outputs:
by default this script's streaming loop (every step's outputs through a streaming-mode OutputProcessor, as the
servers do); with --offline the tree's own `LLM._run` and the processor its LLM builds (final-only where the tree
has that mode), which is what `LLM.generate` pays per step, and the final texts are compared too. With asynchronous
scheduling (the default at one rank) the runner's launch + wait count as its execute.

Columns are medians over decode steps (so they need not add up to the total's median exactly). On CPU, forward /
logits / sampler are real math that a GPU does asynchronously; the engine-overhead columns are the others.

`--compare-tree DIR` measures every (batch, sampling) point twice, alternating fresh interpreters with
PYTHONPATH=DIR (e.g. an unmodified copy of ladle from `git archive HEAD ladle | tar -x -C DIR`) and with this
checkout, then prints both tables and the after/before ratios (and whether both produced the same tokens, and with
--offline the same texts).

CPU:  .venv/bin/python benchmarks/engine_step_overhead.py --device cpu --out /tmp/step_overhead.json
CPU, the offline path of this checkout against HEAD's:
      git archive HEAD ladle | tar -x -C /tmp/before && .venv/bin/python benchmarks/engine_step_overhead.py --offline \
      --batch-sizes 128 --output-len 256 --samplings greedy --repeats 3 --compare-tree /tmp/before
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections import defaultdict

DEFAULT_MODEL_DIR = ".bench_assets/smollm2-135m"
TINY_OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 32}
COMPONENTS = ["schedule", "prepare", "forward", "logits", "sample_prep", "sampler", "d2h", "runner_other", "update",
              "output", "other", "total"]
OVERHEAD = ["schedule", "prepare", "sample_prep", "runner_other", "update", "output", "other"]
COLUMNS = COMPONENTS + ["overhead", "host"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="config dir (config.json + tokenizer)")
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--samplings", default="greedy,top_p", help="greedy and/or top_p (temperature 1, top_p 0.9)")
    p.add_argument("--logprobs", type=int, default=None, help="also request this many top logprobs")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on cpu")
    p.add_argument("--offline", action="store_true",
                   help="drive the core with the tree's own LLM._run and LLM processor (default: a streaming loop)")
    p.add_argument("--repeats", type=int, default=1, help="generate runs per (batch, sampling); steps pooled")
    p.add_argument("--compare-tree", default=None, help="also measure the ladle package under this dir (before)")
    p.add_argument("--after-tree", default=None, help="with --compare-tree: the 'after' ladle (default: this checkout)")
    p.add_argument("--label", default="current")
    p.add_argument("--out", default="engine_step_overhead.json")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.samplings = [s for s in args.samplings.split(",") if s]
    return args


class Hooks:
    """perf_counter accumulators around named callables of live objects (restored by `remove`). `only_inside`
    (key -> enclosing key) counts a hook only when the innermost enclosing hooked call is that key (so the
    device->host `tolist` is counted where the runner makes its copy, not inside forward or the sampler)."""

    def __init__(self, only_inside: dict | None = None) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.only_inside = only_inside or {}
        self._stack: list[str] = []
        self._undo: list[tuple[object, str, object, bool]] = []

    def wrap(self, owner: object, name: str, key: str) -> bool:
        fn = getattr(owner, name, None)
        if fn is None:
            return False
        acc, stack, inside = self.acc, self._stack, self.only_inside.get(key)

        def timed(*a, **k):
            if inside is not None and (not stack or stack[-1] != inside):
                return fn(*a, **k)
            stack.append(key)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.perf_counter() - t0
                stack.pop()

        had = name in getattr(owner, "__dict__", {})
        self._undo.append((owner, name, getattr(owner, "__dict__", {}).get(name), had))
        setattr(owner, name, timed)
        return True

    def remove(self) -> None:
        for owner, name, old, had in reversed(self._undo):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._undo.clear()


def build(args):
    from ladle.engine.engine_factory import build_engine, engine_config_from_kwargs

    overrides = dict(TINY_OVERRIDES, num_hidden_layers=args.layers)
    max_b = max(args.batch_sizes)
    kw = dict(load_format="dummy", hf_overrides=json.dumps(overrides), device=args.device,
              max_model_len=args.input_len + args.output_len + 16, max_num_seqs=max(256, max_b),
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager)
    kw["kv_cache_memory_bytes"] = 256 << 20  # ~128k blocks: a GPU-sized pool would be millions of Python blocks
    return build_engine(engine_config_from_kwargs(args.model, **kw))


def install_hooks(bundle, processor, hooks: Hooks) -> None:
    """Hooks that exist in both the original and the optimised runner, so one script measures both."""
    import torch

    import ladle.runner.model_runner as mr

    core, runner = bundle.core, bundle.core.runner
    hooks.wrap(core.scheduler, "schedule", "schedule")
    hooks.wrap(core.scheduler, "update", "update")
    hooks.wrap(runner, "execute", "execute")
    if getattr(core, "async_scheduling", False):  # EngineCore calls launch / wait, not execute
        hooks.wrap(runner, "launch", "execute")
        hooks.wrap(runner, "wait", "execute")
    hooks.wrap(runner, "_update_states", "prepare")
    if not hooks.wrap(runner, "_prepare_inputs", "prepare"):
        hooks.wrap(mr, "build_batch_inputs", "prepare")
    hooks.wrap(runner, "_forward", "forward")
    hooks.wrap(runner.model, "compute_logits", "logits")
    if not hooks.wrap(runner, "_sampling_tensors", "sample_prep"):
        hooks.wrap(mr, "build_sampling_tensors", "sample_prep")
    hooks.wrap(runner.sampler, "sample", "sampler")
    hooks.wrap(mr, "compute_logprobs", "sampler")
    hooks.wrap(torch.Tensor, "tolist", "d2h")  # the runner's one copy (and, on CUDA, the wait for the GPU)
    hooks.wrap(processor, "process", "output")


class StepClock:
    """Per-decode-step wall time and hook totals, with step boundaries at `EngineCore.step` calls (wrapped on the
    core instance until `remove`): a step runs from its `core.step` call to the next one (or to `close`), so it
    includes whatever the driving loop (this script's or `LLM._run`) does with its outputs. Also collects every
    request's tokens."""

    def __init__(self, core, hooks: Hooks, batch: int, input_len: int, timed: bool) -> None:
        self.core, self.hooks, self.batch, self.input_len, self.timed = core, hooks, batch, input_len, timed
        self.steps: list[dict] = []
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self._open: tuple[float, bool] | None = None  # (start, is a decode step) of the step not closed yet
        self._step = core.step
        core.step = self._timed_step

    def _timed_step(self):
        t0 = time.perf_counter()
        self.close(t0)
        self.hooks.acc.clear()
        outputs = self._step()
        for out in outputs:
            self.tokens[out.request_id].extend(out.new_token_ids)
        decode = len(outputs) == self.batch and all(len(o.new_token_ids) == 1 for o in outputs) and all(
            r.num_computed_tokens > self.input_len for r in self.core.scheduler.running)
        self._open = (t0, decode)
        return outputs

    def close(self, now: float | None = None) -> None:
        """End the open step (at `now`, default: now)."""
        now = time.perf_counter() if now is None else now
        if self._open is not None and self._open[1] and self.timed:
            self.steps.append(dict(self.hooks.acc, total=now - self._open[0]))
        self._open = None

    def remove(self) -> None:
        del self.core.step


def run_one(bundle, batch: int, params, args, seed: int, timed: bool):
    """Generate for `batch` requests; returns per-decode-step component times (seconds), a token checksum and (with
    --offline) a digest of the final texts.

    Streaming (default): this script's loop, as the servers drive the core: every step's outputs go through an
    OutputProcessor in streaming mode. --offline: the tree's own `LLM._run` with the processor its LLM builds (so a
    tree whose LLM processes final-only is measured that way)."""
    from ladle.engine.engine_core import child_params

    core = bundle.core
    llm = None
    if args.offline:
        from ladle.engine.llm import LLM

        llm = LLM(bundle=bundle)
        processor = llm.processor
    else:
        from ladle.engine.output_processor import OutputProcessor

        # trees before 2026-11-30 passed the core's queue-time lookup; newer EngineOutputs carry queue_time
        processor = OutputProcessor(bundle.tokenizer, *([core.queue_time] if hasattr(core, "queue_time") else []))
    rng = random.Random(seed)
    vocab = 49152
    requests, order = [], []
    for i in range(batch):
        ids = [rng.randrange(3, vocab) for _ in range(args.input_len)]
        pid = f"cmpl-bench-{seed}-{i}"
        order.append(pid)
        for j, child in enumerate(processor.add_request(pid, ids, params)):
            requests.append(core.make_request(child, ids, child_params(params, j)))
    core.add_requests(requests)
    hooks = Hooks(only_inside={"d2h": "execute"})
    if timed:
        install_hooks(bundle, processor, hooks)
    clock = StepClock(core, hooks, batch, args.input_len, timed)
    text_digest = None
    try:
        if llm is not None:
            if "order" in llm._run.__code__.co_varnames[:llm._run.__code__.co_argcount]:  # trees before 87bed5d
                finals = llm._run(order)
            else:  # parent id -> final RequestOutput
                final = llm._run()
                finals = [final[pid] for pid in order]
            texts = "\x00".join(c.text for ro in finals for c in ro.outputs)
            text_digest = hashlib.sha1(texts.encode()).hexdigest()[:16]
        else:
            while core.has_unfinished_requests():
                outputs = core.step()
                processed = processor.process(outputs)
                for child, stop in processed.stop_hits:
                    core.finish_requests([child], "stop", stop)
                core.finish_requests(processed.failed_ids, "error")
        clock.close()
    finally:
        hooks.remove()
        clock.remove()
    assert all(len(t) == args.output_len for t in clock.tokens.values()), "every request must yield --output-len"
    checksum = sum(sum(t) for t in clock.tokens.values()) % (1 << 31)
    return clock.steps, checksum, text_digest


def summarize(steps: list[dict]) -> dict:
    rows = []
    for s in steps:
        parts = {k: s.get(k, 0.0) for k in ("schedule", "prepare", "forward", "logits", "sample_prep", "sampler",
                                              "d2h", "update", "output")}
        parts["runner_other"] = s.get("execute", 0.0) - sum(
            parts[k] for k in ("prepare", "forward", "logits", "sample_prep", "sampler", "d2h"))
        parts["other"] = s["total"] - s.get("execute", 0.0) - parts["schedule"] - parts["update"] - parts["output"]
        parts["total"] = s["total"]
        parts["overhead"] = sum(parts[k] for k in OVERHEAD)
        parts["host"] = s["total"] - parts["d2h"]
        rows.append(parts)
    med = {k: statistics.median(r[k] for r in rows) * 1e6 for k in COLUMNS}
    return {"num_steps": len(rows), "median_us": med}


def measure(args) -> dict:
    import torch

    from ladle.core.sampling_params import SamplingParams

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    bundle = build(args)
    samplings = {"greedy": dict(temperature=0.0), "top_p": dict(temperature=1.0, top_p=0.9, seed=None)}
    results = []
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    run_one(bundle, 2, warm, argparse.Namespace(**{**vars(args), "output_len": 4}), seed=99, timed=False)
    for name in args.samplings:
        for batch in args.batch_sizes:
            params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, logprobs=args.logprobs,
                                    **samplings[name])
            all_steps, checks, digests = [], [], []
            for r in range(args.repeats):
                steps, check, digest = run_one(bundle, batch, params, args, seed=1000 * batch + r, timed=True)
                all_steps += steps
                checks.append(check)
                digests.append(digest)
            row = {"batch": batch, "sampling": name, **summarize(all_steps), "token_checksums": checks,
                   "text_digests": digests}
            results.append(row)
            print(f"  [{args.label}] B={batch} {name}: {row['num_steps']} decode steps, total median "
                  f"{row['median_us']['total']:.0f} us, overhead {row['median_us']['overhead']:.0f} us", flush=True)
    import ladle

    return {"label": args.label, "ladle_path": os.path.dirname(ladle.__file__), "device": args.device,
            "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "model": {"config": args.model, "overrides": dict(TINY_OVERRIDES, num_hidden_layers=args.layers),
                      "weights": "dummy (random)"},
            "input_len": args.input_len, "output_len": args.output_len, "results": results}


def print_table(res: dict) -> None:
    print(f"\n{res['label']} ({res['ladle_path']}, {res['device']}): median us per decode step")
    print(f"{'B':>4} {'sampling':>8} " + " ".join(f"{c:>12}" for c in COLUMNS))
    for row in res["results"]:
        m = row["median_us"]
        cells = [f"{m[c]:12.0f}" for c in COLUMNS]
        print(f"{row['batch']:>4} {row['sampling']:>8} " + " ".join(cells))


def compare(before: dict, after: dict) -> list[dict]:
    out = []
    print("\nafter / before (median us; ratio < 1 is faster)")
    print(f"{'B':>4} {'sampling':>8} {'overhead':>22} {'output':>22} {'total':>22} {'same tokens':>12} "
          f"{'same text':>10}")
    for b, a in zip(before["results"], after["results"]):
        assert (b["batch"], b["sampling"]) == (a["batch"], a["sampling"])
        mb, ma = b["median_us"], a["median_us"]
        same = b["token_checksums"] == a["token_checksums"]
        same_text = b.get("text_digests") == a.get("text_digests") if a.get("text_digests", [None])[0] else None
        out.append({"batch": a["batch"], "sampling": a["sampling"], "same_tokens": same, "same_text": same_text,
                    **{f"{k}_ratio": ma[k] / mb[k] for k in ("overhead", "output", "total")}})
        cells = " ".join(f"{mb[k]:8.0f} -> {ma[k]:6.0f} ({ma[k] / mb[k]:4.2f})"
                         for k in ("overhead", "output", "total"))
        print(f"{a['batch']:>4} {a['sampling']:>8} {cells} {str(same):>12} {str(same_text):>10}")
    return out


def _subprocess(argv: list[str], batch: int, sampling: str, label: str, tree: str, out: str) -> dict:
    """Measure one (batch, sampling) point in a fresh interpreter importing ladle from `tree`."""
    cmd = [sys.executable, os.path.abspath(__file__)] + argv + [
        "--batch-sizes", str(batch), "--samplings", sampling, "--label", label, "--out", out]
    subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)), check=True)
    with open(out, encoding="utf-8") as f:
        res = json.load(f)["result"]
    os.remove(out)
    return res


def _merge(parts: list[dict]) -> dict:
    merged = dict(parts[0])
    merged["results"] = [row for part in parts for row in part["results"]]
    return merged


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    report = {"command": " ".join(["python", "benchmarks/engine_step_overhead.py"] + argv)}
    if args.compare_tree:
        # before and after alternate point by point (fresh interpreters), so load drift on a shared machine
        # hits both sides alike
        base = []
        skip = {"--compare-tree", "--after-tree", "--batch-sizes", "--samplings", "--label", "--out"}
        it = iter(argv)
        for a in it:
            if a in skip:
                next(it, None)
            elif a.split("=")[0] not in skip:
                base.append(a)
        here = args.after_tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        before, after = [], []
        for sampling in args.samplings:
            for batch in args.batch_sizes:
                before.append(_subprocess(base, batch, sampling, "before", args.compare_tree, args.out + ".b.json"))
                after.append(_subprocess(base, batch, sampling, "after", here, args.out + ".a.json"))
        report["before"], report["after"] = _merge(before), _merge(after)
        print_table(report["before"])
        print_table(report["after"])
        report["ratios"] = compare(report["before"], report["after"])
    else:
        report["result"] = measure(args)
        print_table(report["result"])
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
