"""The TP4-rank proxy of MiniMax-M3 on one GPU, served by ladle's engine with CUDA graphs (issue 6, deliverables 2
and 3 "proxy"). A script, not a test.

H200 command (one `nvidia-h200` run, no carry: the config and tokenizer are written on the host, and every import
is in its preinstalled python3; JSON and log land in $OUT; about 100 s on an H200, --time-budget-s 500 caps the stepping):

    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 && set -o pipefail &&
    python3 benchmarks/gpu_m3_proxy.py --out $OUT/m3_proxy.json 2>&1 | tee $OUT/m3_proxy.log

The script imports the ladle beside it: to A/B an older tree (back to a7214e7), copy this file into that tree's
benchmarks/ and run both in one call, alternating.

CPU smoke (tiny preset, 3 of 4 layers, no graphs; runs the script end to end on the engine's CPU path, i.e. the torch
reference ops: the Triton kernels, the fused norms and the profiler run on CUDA only; --smoke overrides --batches): `.venv/bin/python benchmarks/gpu_m3_proxy.py
--smoke --out /tmp/m3_proxy_smoke.json`.

The proxy: `make_checkpoint(dir, "tp4-rank", config_only=True)` (= `ladle make-checkpoint minimax-m3 --preset
tp4-rank --config-only DIR`: one TP4 rank's shapes, design/minimax_m3.md §5.2), loaded with `--load-format dummy`,
`--dtype bfloat16` and `--hf-overrides` = `ladle.tools.checkpoint_m3.layer_overrides("tp4-rank", L)` (the first L
layers: 3 dense + L-3 MSA/MoE). L = 28 by default: bf16 weights 91.5 GiB (model built on the meta device here and
summed, printed each run) + a KV/index-K pool for 128 requests x 8320 tokens at 20736 B/token = 20.6 GiB, leaving
13.8 GiB of the 0.9 x 139.8 GiB budget for activations, CUDA context and graphs (L = 29 is the largest that fits
with a 6 GiB reserve; 30 does not). That is the plan used to pick L; the engine then profiles its real peak and gives
the KV pool everything left under --gpu-mem-util (31.8 GiB on an H200 at L = 28). Only the decode batch sizes are captured as graph buckets (the engine's
`cuda_graph_sizes` = --batches; a single --batches value B captures 1 2 4 and the multiples of 8 up to B, vLLM's rule);
prefix caching is off.

Measured, all in this one run:
* ceilings: device copy bandwidth (read + write) and bf16 GEMM rate (benchmarks/gpu_bench_common.py);
* 8K prefill: one 8192-token prompt per step (max_num_batched_tokens = 8192), 1 warm-up + --prefill-reps, against
  the bf16 FLOP roofline (useful FLOPs: GEMMs with (top-k + shared) experts per token and last-token logits, causal
  attention over the keys each query may see (dense: all; MSA: its top-16 blocks), the indexer's causal q.k);
* decode at each batch B: B distinct random prompts (~8K tokens, sized so the mean context in the timed window is
  ~8192) are prefilled by the engine itself (real KV/index-K written by the dummy model, no synthetic fill), then
  --warm + --steps decode steps with all B requests running are timed (CUDA-graph replays), per step: wall clock of
  `EngineCore.step` (host: schedule, input prep, launches, sampling, the one host copy; no detokenizer), GPU time of
  the forward (events around the graph replay incl. its input copy-in), GPU span of logits + sampling, and GPU idle =
  wall - forward - head (the engine is synchronous, so this is host-only time); host spans (JSON only): sched_ms
  (Scheduler.schedule, in prep), update_ms (Scheduler.update) and obs_ms (the observe record, ladle/observe/steps.py
  `end`), both in post. Then --rec-steps decode steps run eagerly with the routing recorded (the same router math,
  in torch) to count distinct routed experts per MoE layer.
* byte roofline per decode step (bf16): all non-expert weights (attention and indexer projections, dense MLPs,
  routers in fp32, shared experts, lm_head over the full 200064 vocab, norms, the B embedding rows) + distinct routed
  experts per layer x expert bytes + KV read (dense layers: the whole context; MSA layers: min(top-k, blocks) x 128
  tokens) + index-K read (whole context per MSA layer), over the copy bandwidth measured here. Activations and the
  KV writes are left out (< 0.1 %).
* per-kernel profile (--profile-batches, default 1 32 128): --profile-steps graph-replayed decode steps under
  torch.profiler, kernel durations summed by name and by group (benchmarks/gpu_kernel_profile.py); with
  --profile-prefill also one whole --ctx-token prefill (eager);
* --no-fused-norms: the same run with the norms and RoPE as torch ops (the engine's `fused_norms=False`, i.e.
  `--no-fused-norms`), for an A/B against the fused kernels in one call.
The table is printed last; everything goes to --out as JSON. Results: benchmarks/results/m3_proxy/ (NOTES.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from gpu_e2e import _StepTimer  # noqa: E402
from gpu_kernel_profile import format_profile, profile_kernels  # noqa: E402
from gpu_m3_proxy_roofline import (GiB, decode_step_bytes, expected_distinct, memory_plan,  # noqa: E402
                                   prefill_flops, weight_bytes)


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------ measuring
class ProxyTimer(_StepTimer):
    """Per engine step: wall clock of core.step, GPU time of the forward, GPU span of logits + sampling, the batch
    geometry (decode or not, requests, seq_lens) and whether graphs were on. CPU runs use perf_counter spans."""

    def __init__(self, core, cuda: bool):
        self.cuda, self.rows, self.cur = cuda, [], None
        super().__init__(core)  # the runner's own _forward replays its graphs
        model, runner = core.runner.model, core.runner
        self.orig_logits, self.orig_sample = model.compute_logits, runner._sample

        def logits(hidden):
            if self.cur is not None:
                self.cur["head0"] = self._mark()
            return self.orig_logits(hidden)

        def sample(*a, **kw):
            out = self.orig_sample(*a, **kw)
            if self.cur is not None:
                self.cur["head1"], self.cur["cpu_head1"] = self._mark(), time.perf_counter()
            return out
        model.compute_logits, runner._sample = logits, sample
        # host spans inside prep / post (ms): Scheduler.schedule, Scheduler.update, the per-step observe record (trees
        # with ladle/observe/steps.py; EngineCore.step looks `end` up on the module at each call)
        self.host, self.wrapped = {}, []
        try:
            from ladle.observe import steps as observe_steps
        except ImportError:
            observe_steps = None
        for owner, name, key in ((core.scheduler, "schedule", "sched_ms"), (core.scheduler, "update", "update_ms"),
                                 (observe_steps, "end", "obs_ms")):
            if owner is not None and hasattr(owner, name):
                self.wrapped.append((owner, name, getattr(owner, name)))
                setattr(owner, name, self._host_span(getattr(owner, name), key))

    def _host_span(self, fn, key):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.host[key] = self.host.get(key, 0.0) + (time.perf_counter() - t) * 1e3
        return timed

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def _forward(self, batch, kv_caches):
        md = batch.attn_metadata
        self.cur = dict(decode=md.max_query_len == 1, num_reqs=len(md.seq_lens_cpu), seq_lens=list(md.seq_lens_cpu),
                        tokens=int(md.num_actual_tokens))
        graphs = getattr(self.runner, "graphs", None)
        self.cur["graphs"] = graphs is not None and graphs.ineligible_reason(md) is None
        self.cur["cpu_fwd0"], self.cur["fwd0"] = time.perf_counter(), self._mark()
        out = self.orig_forward(batch, kv_caches)
        self.cur["fwd1"] = self._mark()
        return out

    def _step(self):
        self.cur, self.host = None, {}
        t = time.perf_counter()
        res = self.orig_step()
        end = time.perf_counter()
        if self.cur is not None:
            self.cur.update(wall_ms=(end - t) * 1e3, prep_ms=(self.cur["cpu_fwd0"] - t) * 1e3,
                            post_ms=(end - self.cur.get("cpu_head1", end)) * 1e3, **self.host)
            self.rows.append(self.cur)
        return res

    def resolve(self, row: dict) -> dict:
        """Turn a row's marks into milliseconds (syncs once)."""
        if self.cuda:
            torch.cuda.synchronize()
        fwd = self._ms(row["fwd0"], row["fwd1"])
        head = self._ms(row["head0"], row["head1"]) if "head1" in row else 0.0
        return dict(wall_ms=row["wall_ms"], fwd_ms=fwd, head_ms=head, idle_ms=row["wall_ms"] - fwd - head,
                    prep_ms=row["prep_ms"], post_ms=row["post_ms"],
                    **{k: row.get(k, 0.0) for k in ("sched_ms", "update_ms", "obs_ms")})

    def restore(self):
        super().restore()
        self.runner.model.compute_logits, self.runner._sample = self.orig_logits, self.orig_sample
        for owner, name, fn in reversed(self.wrapped):
            setattr(owner, name, fn)


class RouteRecorder:
    """While `on`, each MoE layer's forward also computes its routing (FusedMoE.route, the configured router op) and stores
    the number of distinct routed experts in `cur[layer]`; off (e.g. during graph capture) it adds nothing."""

    def __init__(self, model):
        from ladle.layers.moe import FusedMoE

        self.on, self.cur, self.steps = False, {}, []
        for i, layer in enumerate(model.layers):
            if isinstance(layer.mlp, FusedMoE):
                layer.mlp.forward = self._wrap(i, layer.mlp)

    def _wrap(self, i, mlp):
        orig = mlp.forward

        def forward(x, *a, **kw):
            if self.on:
                self.cur[i] = int(torch.unique(mlp.route(x)[0]).numel())
            return orig(x, *a, **kw)
        return forward


DEADLINE = [float("inf")]  # time.time() after which loops stop stepping (--time-budget-s)


def _run_until(core, timer, start: int, done) -> None:
    while core.has_unfinished_requests() and not done(timer.rows[start:]) and time.time() < DEADLINE[0]:
        core.step()


def run_prefill(llm, timer, args, cfg, ceil_tf) -> list[dict]:
    from ladle.core.sampling_params import SamplingParams

    core, rows, g = llm.core, [], torch.Generator().manual_seed(7)
    fl = prefill_flops(cfg, args.ctx)
    for rep in range(1 + args.prefill_reps):
        rid = f"prefill-{rep}"
        prompt = torch.randint(3, cfg.vocab_size - 3, (args.ctx,), generator=g).tolist()
        core.add_requests([core.make_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))])
        start = len(timer.rows)
        try:
            _run_until(core, timer, start, lambda r: False)
        finally:
            core.abort_requests([rid])
        pre = [r for r in timer.rows[start:] if not r["decode"] and r["tokens"] == args.ctx]
        if rep == 0 or not pre:  # warm-up, or the prompt was split (it should not be)
            continue
        t = timer.resolve(pre[0])
        rows.append(dict(**t, tflops=fl["total"] / (t["fwd_ms"] * 1e-3) / 1e12,
                         roof_ms=fl["total"] / (ceil_tf * 1e12) * 1e3))
    if args.profile_prefill and cuda_available() and rows:
        rows[-1]["profile"] = _profile_prefill(core, cfg, args, g)
    return rows


def _profile_prefill(core, cfg, args, g) -> dict:
    """Per-kernel profile of whole --ctx-token prefills (eager: prefill is not graph-captured): each profiled call adds
    one fresh random prompt (max_tokens 1) and steps the engine until it is done."""
    from ladle.core.sampling_params import SamplingParams

    calls = [0]

    def one_prefill() -> None:
        calls[0] += 1
        rid = f"prefill-profile-{calls[0]}"
        prompt = torch.randint(3, cfg.vocab_size - 3, (args.ctx,), generator=g).tolist()
        core.add_requests([core.make_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))])
        try:
            while core.has_unfinished_requests():
                core.step()
        finally:
            core.abort_requests([rid])

    try:
        return profile_kernels(one_prefill, 1)
    except Exception as exc:  # noqa: BLE001 - a profiler failure must not lose the timings
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_decode(llm, timer, rec, batch: int, args, cfg, wb, bw_gbps, kv_elt) -> dict:
    """One batch size: prefill `batch` prompts through the engine, time full-batch decode steps, record routing."""
    from ladle.core.sampling_params import SamplingParams

    core, runner = llm.core, llm.core.runner
    prompt_len = max(8, args.ctx - batch // 2 - args.warm - args.steps // 2)
    gen = math.ceil(1.15 * batch) + args.warm + args.steps + args.rec_steps + args.profile_steps + 9
    bs = runner.block_size
    need = batch * -(-(prompt_len + gen) // bs)
    if need > runner.num_blocks - 1:
        log(f"WARNING B={batch}: needs {need} KV blocks, pool has {runner.num_blocks - 1}: expect preemption")
    g = torch.Generator().manual_seed(1000 + batch)
    prompts = torch.randint(3, cfg.vocab_size - 3, (batch, prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=gen, ignore_eos=True, temperature=0.0)
    ids = [f"dec{batch}-{i}" for i in range(batch)]
    core.add_requests([core.make_request(r, p, params) for r, p in zip(ids, prompts)])
    full = lambda r: r["decode"] and r["num_reqs"] == batch  # noqa: E731
    start, saved = len(timer.rows), runner.graphs
    try:
        _run_until(core, timer, start, lambda rows: len(rows) >= args.warm + args.steps
                   and all(full(r) for r in rows[-(args.warm + args.steps):]))
        timed = [r for r in timer.rows[start:][-args.steps:] if full(r)]
        prof = None
        if batch in args.profile_batches and cuda_available():
            try:  # the same graph-replayed step, its kernels summed by name (CUPTI reports graph kernels too)
                prof = profile_kernels(core.step, args.profile_steps)
            except Exception as exc:  # noqa: BLE001 - a profiler failure must not lose the timings
                prof = dict(error=f"{type(exc).__name__}: {exc}")
        runner.graphs, rec.on, rec.steps = None, True, []
        t0 = len(timer.rows)
        for _ in range(args.rec_steps):
            if not core.has_unfinished_requests():
                break
            rec.cur = {}
            core.step()
            rec.steps.append(rec.cur)
    finally:
        rec.on, runner.graphs = False, saved
        core.abort_requests(ids)
        while core.has_unfinished_requests():
            core.step()
    eager = [timer.resolve(r)["wall_ms"] for r in timer.rows[t0:] if full(r)]
    if not timed or not rec.steps:
        return dict(batch=batch, error=f"{len(timed)} full-batch graph steps, {len(rec.steps)} routing steps")
    moe_idx = [i for i, d in enumerate(wb["layers"]) if d["moe"]]
    distinct = [statistics.mean(s.get(i, 0) for s in rec.steps) if i in moe_idx else 0
                for i in range(len(wb["layers"]))]
    t = [timer.resolve(r) for r in timed]
    byts = [decode_step_bytes(wb, cfg, r["seq_lens"], distinct, kv_elt) for r in timed]
    med = {k: statistics.median(x[k] for x in t) for k in t[0]}
    mb = {k: statistics.mean(b[k] for b in byts) for k in byts[0]}
    roof = mb["total"] / (bw_gbps * 1e9) * 1e3
    return dict(batch=batch, steps=len(t), graphs=all(r["graphs"] for r in timed),
                mean_ctx=statistics.mean(statistics.mean(r["seq_lens"]) for r in timed), **med,
                eager_step_ms=statistics.median(eager) if eager else None,
                distinct_experts=statistics.mean(distinct[i] for i in moe_idx) if moe_idx else 0,
                uniform_expect=expected_distinct(cfg.num_local_experts, cfg.num_experts_per_tok, batch),
                bytes=mb, roof_ms=roof, pct_roof_fwd=100 * roof / med["fwd_ms"], pct_roof_step=100 * roof / med["wall_ms"],
                tok_s=batch / (med["wall_ms"] * 1e-3), profile=prof, per_step=[dict(**x, ctx=statistics.mean(r["seq_lens"]))
                                                                for x, r in zip(t, timed)])


def cuda_available() -> bool:
    return torch.cuda.is_available()


def ceilings(cuda: bool) -> tuple[float, float]:
    """(copy GB/s counting read + write, dense matmul TFLOP/s): gpu_bench_common on CUDA, a rough CPU stand-in."""
    if cuda:
        from gpu_bench_common import measure_bf16_gemm_tflops, measure_copy_bandwidth

        bw, tf = measure_copy_bandwidth(), measure_bf16_gemm_tflops()
        torch.cuda.empty_cache()
        return bw, tf
    src, a = torch.rand(2**25), torch.rand(512, 512)
    dst = torch.empty_like(src)
    t = min(_wall(lambda: dst.copy_(src)) for _ in range(5))
    m = min(_wall(lambda: a @ a) for _ in range(5))
    return 2 * src.numel() * 4 / t / 1e9, 2 * 512**3 / m / 1e12


def _wall(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ------------------------------------------------------------------------------------------------------ main
def build_llm(args, model_dir: str, overrides: dict, cuda: bool, enforce_eager: bool = False):
    from ladle.engine.llm import LLM

    kw = dict(load_format="dummy", hf_overrides=json.dumps(overrides), max_model_len=args.ctx + 256,
              max_num_seqs=max(args.batches), max_num_batched_tokens=args.ctx, enable_prefix_caching=False, seed=0,
              cuda_graph_sizes=tuple(sorted(set(args.batches))),  # capture only the timed batch sizes
              fused_norms=not args.no_fused_norms, kv_cache_dtype=args.kv_cache_dtype,
              engine_core_process=False)  # the harness times and profiles the in-process core's steps
    if args.quantization:
        kw["quantization"] = args.quantization
    if cuda:
        kw.update(device="cuda", dtype="bfloat16", gpu_memory_utilization=args.gpu_mem_util, enforce_eager=enforce_eager)
    else:
        kw.update(device="cpu", dtype="float32", kv_cache_memory_bytes=256 << 20)
    return LLM(model_dir, **kw)


def print_table(res: dict) -> None:
    log(f"\nMiniMax-M3 TP4-rank proxy: {res['layers']} layers ({res['preset']}), {res['device']}; copy "
        f"{res['copy_gbps']:.0f} GB/s, dense GEMM {res['gemm_tflops']:.0f} TFLOP/s (ceilings, this run); weights "
        f"{res['weights_gib']:.1f} GiB, KV pool {res['kv_pool_gib']:.1f} GiB")
    hdr = (f"{'decode':<7} {'ctx':>5} {'step':>7} {'GPU fwd':>7} {'head':>5} {'idle':>5} {'prep':>5} {'post':>5} "
           f"{'eager':>6} {'exp/L':>5} {'unif':>5} {'wts GB':>6} {'exp GB':>6} {'KV GB':>6} {'idxK GB':>7} "
           f"{'roof':>6} {'%fwd':>5} {'%step':>5} {'tok/s':>6}")
    log(hdr + "\n" + "-" * len(hdr))
    for r in res["decode"]:
        if "error" in r:
            log(f"B={r['batch']:<5} FAILED: {r['error']}")
            continue
        b = r["bytes"]
        label = f"{r['batch']}{'' if r['graphs'] else ' e'}"  # ' e': eager steps (no graph replay)
        log(f"B={label:<5} {r['mean_ctx']:>5.0f} {r['wall_ms']:>7.2f} {r['fwd_ms']:>7.2f} {r['head_ms']:>5.2f} "
            f"{r['idle_ms']:>5.2f} {r['prep_ms']:>5.2f} {r['post_ms']:>5.2f} {r['eager_step_ms'] or 0:>6.1f} "
            f"{r['distinct_experts']:>5.1f} {r['uniform_expect']:>5.1f} {b['weights'] / 1e9:>6.2f} "
            f"{b['experts'] / 1e9:>6.2f} {b['kv'] / 1e9:>6.3f} {b['index_k'] / 1e9:>7.3f} {r['roof_ms']:>6.2f} "
            f"{r['pct_roof_fwd']:>5.1f} {r['pct_roof_step']:>5.1f} {r['tok_s']:>6.0f}")
    log("ms, medians per step. head = logits + sampling GPU span; idle = step - fwd - head (GPU idle = host-only "
        "time), of which prep = schedule + input build before the forward, post = scheduler update after sampling; "
        "eager = step with graphs off (routing recorded); exp/L = distinct routed experts per MoE layer (measured), "
        "unif = expected if uniform; roof = byte roofline at the copy ceiling; %fwd, %step = roof / GPU fwd, "
        "roof / step (target: %step >= 55 at B = 32, 128)")
    fl = res["prefill_flops"]
    for i, p in enumerate(res["prefill"]):
        if "error" in p:
            log(f"prefill FAILED: {p['error']}")
            continue
        log(f"prefill {res['ctx']} tokens #{i}: step {p['wall_ms']:.1f} ms, GPU fwd {p['fwd_ms']:.1f} ms, "
            f"{p['tflops']:.0f} TFLOP/s = {100 * p['roof_ms'] / p['fwd_ms']:.1f}% of the bf16 GEMM ceiling "
            f"(roofline {p['roof_ms']:.1f} ms for {fl['total'] / 1e12:.2f} TFLOP: GEMM {fl['gemm'] / 1e12:.2f}, "
            f"attention {fl['attention'] / 1e12:.2f}, indexer {fl['indexer'] / 1e12:.3f}); "
            f"{100 * p['roof_ms'] / p['wall_ms']:.1f}% of the step")


def _dump(res: dict, path: str, cuda: bool) -> None:
    if cuda:
        res["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="m3_proxy.json")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny preset, 3 layers, ctx 128, batches 1 4")
    ap.add_argument("--preset", default="tp4-rank")
    ap.add_argument("--layers", default="28", help="layers kept (first N), or 'auto' (largest that fits)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--ctx", type=int, default=8192, help="decode context (mean) and prefill length, tokens")
    ap.add_argument("--steps", type=int, default=32, help="timed full-batch decode steps per batch size")
    ap.add_argument("--warm", type=int, default=4, help="full-batch decode steps before timing")
    ap.add_argument("--rec-steps", type=int, default=3, help="eager steps with the routing recorded")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--gpu-mem-util", type=float, default=0.9)
    ap.add_argument("--reserve-gib", type=float, default=6.0, help="activations + context + graphs, for 'auto'")
    ap.add_argument("--model-dir", default=None, help="config-only checkpoint dir (written if missing)")
    ap.add_argument("--time-budget-s", type=float, default=500, help="stop stepping after this; results so far kept")
    ap.add_argument("--profile-batches", type=int, nargs="*", default=[1, 32, 128],
                    help="batch sizes whose graph-replayed decode step is also profiled per kernel (torch.profiler)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--profile-prefill", action="store_true",
                    help="also profile one --ctx-token prefill per kernel (torch.profiler, eager), after the timed ones")
    ap.add_argument("--no-fused-norms", action="store_true",
                    help="M3 kernel path with the torch norm/RoPE ops instead of the fused kernels (A/B)")
    ap.add_argument("--quantization", default=None, help="fp8: FP8 block-scaled weights quantized at load (issue 11)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e5m2: the K/V and index-K cache dtype")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.layers, args.batches, args.ctx = "tiny", "3", [1, 4], 128
        args.steps, args.warm, args.rec_steps, args.prefill_reps = 4, 2, 2, 1
    cuda = torch.cuda.is_available() and not args.smoke
    from ladle.tools.checkpoint_m3 import layer_overrides, make_checkpoint

    t0 = time.time()
    DEADLINE[0] = t0 + args.time_budget_s
    device = torch.cuda.get_device_name() if cuda else "cpu"
    total = torch.cuda.mem_get_info()[1] if cuda else 139.8 * GiB
    bw, tf = ceilings(cuda)
    log(f"device {device}: copy {bw:.0f} GB/s, dense GEMM {tf:.1f} TFLOP/s")
    tokens_per_seq = -(-(args.ctx + max(args.batches) // 2 + 64) // 128) * 128
    plan = memory_plan(args.preset, 60 if args.layers == "auto" else int(args.layers), max(args.batches),
                       tokens_per_seq, total, args.gpu_mem_util, int(args.reserve_gib * GiB))
    layers = plan["largest_fitting"] if args.layers == "auto" else int(args.layers)
    if args.layers == "auto":
        plan = memory_plan(args.preset, layers, max(args.batches), tokens_per_seq, total, args.gpu_mem_util,
                           int(args.reserve_gib * GiB))
    log(f"memory plan (bf16): {json.dumps(plan)}")
    model_dir = args.model_dir or f"/tmp/ladle_m3_proxy_{args.preset}"
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        make_checkpoint(model_dir, args.preset, config_only=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        overrides = layer_overrides(json.load(f)["text_config"], layers)
    log(f"--hf-overrides '{json.dumps(overrides, separators=(',', ':'))}'")
    _dump(dict(device=device, copy_gbps=bw, gemm_tflops=tf, memory_plan=plan, hf_overrides=overrides), args.out, cuda)
    graphs_error = None
    try:
        llm = build_llm(args, model_dir, overrides, cuda)
    except Exception as exc:  # noqa: BLE001 - e.g. a capture failure: measure eagerly rather than not at all
        if not cuda:
            raise
        traceback.print_exc()
        graphs_error = f"{type(exc).__name__}: {exc}"
    if graphs_error:
        log(f"ENGINE BUILD FAILED ({graphs_error}); retrying with enforce_eager=True (no CUDA graphs)")
        gc.collect()
        torch.cuda.empty_cache()
        llm = build_llm(args, model_dir, overrides, cuda, enforce_eager=True)
    core = llm.core
    model, runner = core.runner.model, core.runner
    cfg = model.config  # parsed by the engine from config.json + the overrides
    assert cfg.num_hidden_layers == layers == len(model.layers), "the --hf-overrides did not apply"
    wb = weight_bytes(model)
    kv_elt = torch.empty(0, dtype=getattr(runner, "kv_dtype", model.dtype)).element_size()  # --kv-cache-dtype (fp8: 1)
    res = dict(device=device, argv=sys.argv[1:], preset=args.preset, layers=layers, ctx=args.ctx,
               quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
               fused_norms=not args.no_fused_norms, copy_gbps=bw, gemm_tflops=tf,
               memory_plan=plan, weights_gib=wb["total"] / GiB, kv_pool_gib=runner.kv_cache_bytes / GiB,
               kv_blocks=runner.num_blocks, graph_buckets=sorted(runner.graphs.graphs) if runner.graphs else [],
               hf_overrides=overrides, synthetic="dummy weights (uniform, seed 0); random prompt token ids; KV and "
               "index-K written by the model's own prefill", engine_ready_s=time.time() - t0, graphs_error=graphs_error)
    log(f"engine ready in {res['engine_ready_s']:.0f}s: {layers} layers, weights {res['weights_gib']:.2f} GiB, "
        f"KV pool {res['kv_pool_gib']:.1f} GiB ({runner.num_blocks} blocks), graphs {res['graph_buckets']}")
    timer, rec = ProxyTimer(core, cuda), RouteRecorder(model)
    res["prefill_flops"], res["prefill"], res["decode"] = prefill_flops(cfg, args.ctx), [], []
    phases = [("prefill", lambda: run_prefill(llm, timer, args, cfg, tf))]
    phases += [(f"decode B={b}", lambda b=b: run_decode(llm, timer, rec, b, args, cfg, wb, bw, kv_elt))
               for b in args.batches]
    for name, fn in phases:
        try:
            if time.time() > DEADLINE[0]:
                raise TimeoutError(f"--time-budget-s {args.time_budget_s} spent before this phase")
            r = fn()
        except Exception as exc:  # noqa: BLE001 - report and go on with the next phase
            traceback.print_exc()
            r = dict(batch=int(name.split("=")[-1]) if "=" in name else 0, error=f"{type(exc).__name__}: {exc}")
        if name == "prefill":
            res["prefill"] = r if isinstance(r, list) else [r]
        else:
            res["decode"].append(r)
        brief = ([{k: v for k, v in x.items() if k != "profile"} for x in r] if isinstance(r, list)
                 else {k: v for k, v in r.items() if k not in ("per_step", "profile")})
        log(f"{name} done {time.time() - t0:.0f}s: {json.dumps(brief)}")
        _dump(res, args.out, cuda)
    timer.restore()
    from ladle.observe import dispatch

    res["dispatch"] = dispatch.snapshot()
    _dump(res, args.out, cuda)
    log("\ndispatch record (ops captured in a graph count once, at capture):\n" + dispatch.format_table())
    norms = f"fused norms {res['fused_norms']}"
    profiled = [(r, 20, f"prefill {args.ctx} tokens (eager, {norms})") for r in res["prefill"]]
    profiled += [(r, 15, f"B={r['batch']} (graph replay, {norms})") for r in res["decode"]]
    for r, top, label in profiled:
        p = r.get("profile")
        if p and "error" in p:
            log(f"profile {label}: FAILED {p['error']}")
        elif p:
            log(format_profile(p, top=top, label=label))
    print_table(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
