"""Host time per phase of a MiniMax-M3 decode step (`EngineCore.step`), with the model forward stubbed out, so only
the engine's own host work is left: what a CUDA-graph decode step costs the CPU besides the graph replay.

The engine: the `tiny` M3 preset (ladle/tools/checkpoint_m3.py, --load-format dummy, float32 on CPU) with
--hf-overrides giving one KV head of 16 dims and 128-token blocks (the tp4-rank block size), so B requests of ~8K
tokens fit in a small pool; `runner._forward` returns rows of a fixed random [8192, hidden] tensor (the model never
runs, so the layer count does not matter). B prompts of ctx - B/2 random ids are prefilled by the engine, then
--steps decode steps with all B requests running are timed (greedy, ignore_eos). perf_counter spans wrapped around
the engine's own calls (nothing in ladle is instrumented), microseconds, median per run:

  schedule         Scheduler.schedule
  update_states    ModelRunner._update_states
  prepare_inputs   ModelRunner._prepare_inputs (block-table rows + build_batch_inputs)
  forward          the stub (a slice)
  logits           model.compute_logits (real CPU math: hidden x vocab 512)
  sampling_tensors ModelRunner._sampling_tensors
  sampler          Sampler.sample (+ the rest of _sample: sample_total)
  update           Scheduler.update
  observe_begin / observe_end   ladle.observe.steps begin / end (trees that have them)
  prep             step start -> forward start (gpu_m3_proxy.py's prep); post: end of _sample -> step end (its post)
  step             the whole EngineCore.step

`--compare-tree DIR` measures an unmodified ladle too (e.g. `git archive a7214e7 | tar -x -C DIR`): --rounds
rounds, each one fresh interpreter per tree (PYTHONPATH), alternating so load drift on a shared machine hits both;
the table gives the median over rounds of each run's median, and after - before.

CPU:  .venv/bin/python benchmarks/host_phases_m3.py --batches 32 128 --compare-tree /tmp/before --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

PHASES = ["step", "prep", "post", "observe_begin", "schedule", "update_states", "prepare_inputs", "forward", "logits",
          "sampling_tensors", "sampler", "sample_total", "update", "observe_end"]


def build(batch: int, ctx: int):
    from ladle.engine.llm import LLM
    from ladle.tools.checkpoint_m3 import make_checkpoint

    model_dir = make_checkpoint(tempfile.mkdtemp(prefix="ladle_m3_host_"), "tiny", config_only=True)
    freq = [0, 1]
    over = {"text_config": {"num_hidden_layers": 2, "moe_layer_freq": freq, "max_position_embeddings": 32768,
                            "num_key_value_heads": 1, "head_dim": 16, "rotary_dim": 8,
                            "sparse_attention_config": {"sparse_attention_freq": freq,
                                                        "sparse_disable_index_value": freq, "sparse_block_size": 128,
                                                        "sparse_index_dim": 16, "sparse_num_index_heads": 1}}}
    per_token = 2 * 2 * 16 * 4 + 16 * 4  # K+V of 2 layers + index-K of 1, float32
    return LLM(model_dir, load_format="dummy", hf_overrides=json.dumps(over), device="cpu", dtype="float32",
               max_model_len=ctx + 512, max_num_seqs=batch, max_num_batched_tokens=8192, enable_prefix_caching=False,
               seed=0, kv_cache_memory_bytes=int(batch * (ctx + 512) * per_token * 1.2) + (16 << 20))


class Spans:
    """perf_counter accumulators around named callables (per step), plus the prep / post marks."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.marks: dict[str, float] = {}

    def wrap(self, owner, name: str, key: str, mark_start: str = "", mark_end: str = "") -> None:
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            if mark_start:
                self.marks[mark_start] = t0
            try:
                return fn(*a, **kw)
            finally:
                t1 = time.perf_counter()
                self.acc[key] += t1 - t0
                if mark_end:
                    self.marks[mark_end] = t1
        setattr(owner, name, timed)


def measure(batch: int, ctx: int, steps: int) -> dict:
    import torch

    from ladle.core.sampling_params import SamplingParams

    torch.set_num_threads(1)
    llm = build(batch, ctx)
    core, runner = llm.core, llm.core.runner
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8192, runner.model.config.hidden_size, generator=g)
    runner._forward = lambda batch_inputs, kv_caches: hidden[:batch_inputs.input_ids.shape[0]]
    s = Spans()
    for owner, name, key in ((core.scheduler, "schedule", "schedule"), (core.scheduler, "update", "update"),
                             (runner, "_update_states", "update_states"), (runner, "_prepare_inputs", "prepare_inputs"),
                             (runner.model, "compute_logits", "logits"), (runner, "_sampling_tensors", "sampling_tensors"),
                             (runner.sampler, "sample", "sampler")):
        s.wrap(owner, name, key)
    s.wrap(runner, "_forward", "forward", mark_start="fwd0")
    s.wrap(runner, "_sample", "sample_total", mark_end="head1")
    try:
        from ladle.observe import steps as observe_steps  # EngineCore.step looks these up on the module

        s.wrap(observe_steps, "begin", "observe_begin")
        s.wrap(observe_steps, "end", "observe_end")
    except ImportError:
        pass
    prompt_len = ctx - batch // 2
    params = SamplingParams(max_tokens=int(1.15 * batch) + steps + 30, ignore_eos=True, temperature=0.0)
    prompts = torch.randint(3, 500, (batch, prompt_len), generator=g).tolist()
    core.add_requests([core.make_request(f"r{i}", p, params) for i, p in enumerate(prompts)])
    rows, full_steps = [], 0
    while core.has_unfinished_requests() and len(rows) < steps:
        s.acc.clear()
        s.marks.clear()
        t0 = time.perf_counter()
        outs = core.step()
        t1 = time.perf_counter()
        if len(outs) == batch and all(len(o.new_token_ids) == 1 for o in outs) and all(
                r.num_computed_tokens > prompt_len for r in core.scheduler.running):
            full_steps += 1
            if full_steps > 5:  # warm
                row = {k: v * 1e6 for k, v in s.acc.items()}
                row.update(step=(t1 - t0) * 1e6, prep=(s.marks["fwd0"] - t0) * 1e6, post=(t1 - s.marks["head1"]) * 1e6)
                rows.append(row)
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in PHASES} | {"steps": len(rows)}


def run_child(tree: str, batch: int, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--batches", str(batch), "--ctx", str(args.ctx),
           "--steps", str(args.steps), "--out", out]
    subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=os.path.abspath(tree)), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out, encoding="utf-8") as f:
        res = json.load(f)
    os.remove(out)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compare-tree", default=None, help="also measure the ladle package under this dir (before)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(measure(args.batches[0], args.ctx, args.steps), f)
        return 0
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = ([("before", args.compare_tree)] if args.compare_tree else []) + [("after", here)]
    report = {}
    for batch in args.batches:
        runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
        for _ in range(args.rounds):
            for label, tree in trees:
                runs[label].append(run_child(tree, batch, args))
        med = {label: {k: statistics.median(r[k] for r in rs) for k in PHASES} for label, rs in runs.items()}
        report[batch] = {"runs": runs, "median": med}
        print(f"\nB={batch}, ctx {args.ctx}: us per decode step (median over {args.rounds} runs of each run's median)")
        print(f"{'phase':<17}" + "".join(f"{label:>10}" for label, _ in trees) + ("     delta" if len(trees) > 1 else ""))
        for k in PHASES:
            vals = [med[label][k] for label, _ in trees]
            delta = f"{vals[-1] - vals[0]:>+10.1f}" if len(vals) > 1 else ""
            print(f"{k:<17}" + "".join(f"{v:>10.1f}" for v in vals) + delta)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
