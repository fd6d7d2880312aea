"""Tile sweep for the FP8 / MXFP8 dense GEMM and the FP8 / MXFP8 / MXFP4 fused MoE at one TP4 rank of MiniMax-M3
(issue 11: "tiles chosen from the local shape"). A script, not a test; one device call of about 4 minutes:

    PYTHONPATH=. python3 benchmarks/gpu_fp8_tiles.py --out fp8_tiles.json [--time-budget-s 200] [--only fused_moe]
    python3 benchmarks/gpu_fp8_tiles.py --smoke       # CPU: Triton interpreter, tiny shapes, 2 configs, no timing

Writes fp8_tiles.json (every row; rewritten after each) and fp8_tiles.txt (the report below); prints one ROW line
per config, then the report. Worst case it ends at --time-budget-s + --grace-s (225 s) after start-up.

What it measures, per (kernel, M) with M = 1, 32, 128 (decode) and 8192 (prefill), shapes of benchmarks/
gpu_quant_suite.py (whose data builders it reuses): `fp8_gemm_triton` with 128-group fp32 and MXFP8 E8M0 weight
scales at (N, K) = (2688, 6144) and (6144, 2048) over a grid of GemmTileConfig (BLOCK_K is the weight group, not
swept); `fused_moe_fp8_triton` (128-group, MXFP8) and `fused_moe_mxfp4_triton` (W4A16, W4A8) over a grid of
MoETileConfig (block_k is ignored by these kernels: their K step is the scale group). The current choice of
`select_gemm_config` / `select_config` is always measured first. References, same data: bf16 torch.matmul,
torch._scaled_mm row-wise at M >= 128 (speed only: not the block-scaled math, gpu_quant_suite's module doc) and the
bf16 fused MoE at its current tile.

Every config: one call checked against the op's torch reference on the same random data (relative error; a config
above --tol, or that fails to compile / launch, is recorded and skipped), then CUDA-graph replay time
(gpu_bench_common.time_graph_us; --single adds the eager time_single_us). Decode rows report % of copy bandwidth
over the weight + scale bytes read (the dense GEMM rotates over weight copies totalling >= 4x the L2, the METHOD's
rule, which gpu_quant_suite did not apply to the GEMM: its M=1 figures may include L2 hits); prefill rows TFLOP/s.

Budget: jobs run round-robin over the (kernel, M) groups in order of candidate rank (the current tile first), so a
cut-short run still has the baseline and the likeliest configs everywhere. No job starts after --time-budget-s; a
watchdog prints the table, writes the JSON and exits at budget + --grace-s whatever the main thread is doing. The
JSON is rewritten after every row. Compilation: --compile-workers processes compile every config ahead of the main
thread into Triton's on-disk cache (launches replaced by JITFunction warm-up: no GPU kernels of theirs overlap the
timing, apart from small torch ops on their tiny data), so the main thread mostly loads cubins.

Output: per (kernel, M, shape) the current tile's time, the best tile and its time, the speedup; then a ready-to-paste
GEMM_TILES / MOE_TILES literal (ladle/kernels/fp8_gemm.py, ladle/kernels/fused_moe.py) with the best config per
kernel family and M bucket (dense GEMM: the least summed time over both shapes; buckets without a measured winner
keep today's config). SYNTHETIC DATA (random weights, near-uniform routing), as gpu_quant_suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing as mp
import os
import sys
import threading
import time

if "--smoke" in sys.argv:  # before triton is imported: the CPU interpreter runs the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, ".")
from benchmarks.fp8_tile_grid import Recorder, cuda_poisoned, gemm_candidates, moe_candidates  # noqa: E402
from benchmarks.gpu_bench_common import L2_BYTES, rel_err  # noqa: E402
from benchmarks.gpu_quant_suite import (GEMM_FORMATS, SMOKE, Shapes, Timer, gemm_inputs,  # noqa: E402
                                        moe_inputs, moe_tables, scaled_mm_case)
from ladle.kernels import fp8_gemm, fused_moe  # noqa: E402
from ladle.kernels.fp8_gemm import fp8_gemm_ref, fp8_gemm_triton  # noqa: E402
from ladle.kernels.fp8_quant import act_quant_triton  # noqa: E402
from ladle.kernels.moe_align import moe_align_triton  # noqa: E402

GEMM_FAMILY = {"fp8 gemm 128": "fp8", "fp8 gemm mxfp8": "mxfp8"}
MOE_FAMILY = {"fused_moe fp8": "fp8", "fused_moe mxfp8": "mxfp8", "fused_moe mxfp4": "mxfp4",
              "fused_moe w4a8": "w4a8"}
PRIORITY = ("fused_moe fp8", "fp8 gemm 128", "fused_moe mxfp8", "fp8 gemm mxfp8", "fused_moe w4a8", "fused_moe mxfp4")


@dataclasses.dataclass
class Group:
    """One (kernel, M, shape) of the sweep: `fns(cfg)` builds the timed calls (one per rotated input set),
    `check(cfg)` runs the first once and returns its relative error against the op's torch reference (computed
    once per group). family None: a reference row (one run, no tile)."""

    key: str
    kernel: str
    family: object
    table: str  # "gemm" | "moe" | "ref"
    m: int
    shape: str
    nbytes: float
    flops: float
    candidates: list
    fns: object
    check: object


class Data:
    """Inputs shared by every group of one M (same weights, activations and routes for all configs), built lazily.
    compile_only (the compile workers): one weight copy, no references."""

    def __init__(self, shapes: Shapes, smoke: bool, compile_only: bool = False):
        self.shapes, self.smoke, self.compile_only = shapes, smoke, compile_only
        self._gemm, self._moe, self._tables = {}, {}, None

    def gemm(self, m, n, k):
        if (m, n, k) not in self._gemm:
            self._gemm[(m, n, k)] = gemm_inputs(self.shapes, m, n, k)
        return self._gemm[(m, n, k)]

    def moe(self, m):
        if m not in self._moe:
            self._moe[m] = moe_inputs(self.shapes, m)
        return self._moe[m]

    def tables(self):
        if self._tables is None:
            self._tables = moe_tables(self.shapes)
        return self._tables

    def copies(self, m, nbytes):
        """Decode sizes rotate over weight copies totalling >= 4x the L2 (METHOD), at most 16; prefill: one."""
        if m > 256 or self.smoke or self.compile_only:
            return 1
        return max(1, min(16, math.ceil(4 * L2_BYTES / nbytes)))


def _lazy(build):
    """A memoised zero-argument builder."""
    box = []
    return lambda: box[0] if box else (box.append(build()) or box[0])


def fp8_gemm_group(data, m, n, k, name, quantize, scale_bytes, max_cfg):
    family, nbytes = GEMM_FAMILY[name], n * k * (1 + scale_bytes)
    w_acts = _lazy(lambda: ([quantize(data.gemm(m, n, k)[0]) for _ in range(data.copies(m, nbytes))],
                            [act_quant_triton(x) for x in data.gemm(m, n, k)[1]]))
    ref = _lazy(lambda: fp8_gemm_ref(*w_acts()[1][0], *w_acts()[0][0], torch.float32))

    def fns(cfg):
        weights, acts = w_acts()
        return [lambda a=acts[i % len(acts)], w=w: fp8_gemm_triton(a[0], a[1], w[0], w[1], torch.bfloat16, config=cfg)
                for i, w in enumerate(weights)]

    current = fp8_gemm.select_gemm_config(m, family)
    return Group(f"{name}|{m}|{n}x{k}", name, family, "gemm", m, f"{n}x{k}", nbytes, 2 * m * n * k,
                 gemm_candidates(m, family, current, max_cfg), fns, lambda cfg: rel_err(fns(cfg)[0](), ref()))


def gemm_groups(data, m, n, k, max_cfg, wanted):
    """The two FP8 GEMM formats at (m, n, k) plus the bf16 matmul and (M >= 128) scaled_mm references."""
    flops, shape = 2 * m * n * k, f"{n}x{k}"
    groups = [fp8_gemm_group(data, m, n, k, *fmt, max_cfg) for fmt in GEMM_FORMATS if wanted(fmt[0])]
    if data.compile_only:
        return groups
    bf16_w = _lazy(lambda: [data.gemm(m, n, k)[0].to(torch.bfloat16) for _ in range(data.copies(m, 2 * n * k))])

    def bf16_fns(_cfg):
        xs = data.gemm(m, n, k)[1]
        return [lambda x=xs[i % len(xs)], wb=wb: x @ wb.T for i, wb in enumerate(bf16_w())]

    if wanted("bf16 matmul"):
        groups.append(Group(f"bf16 matmul|{m}|{shape}", "bf16 matmul", None, "ref", m, shape, 2 * n * k, flops,
                            [None], bf16_fns, _run_once(bf16_fns)))
    if m >= 128 and wanted("scaled_mm rowwise*"):
        def mm_fns(_cfg):
            w, xs = data.gemm(m, n, k)
            return [f for i in range(data.copies(m, n * k)) for f in scaled_mm_case(w, [xs[i % len(xs)]])[0]]

        mm = _memo_fns(mm_fns)
        groups.append(Group(f"scaled_mm|{m}|{shape}", "scaled_mm rowwise*", None, "ref", m, shape, n * k, flops,
                            [None], mm, _run_once(mm)))
    return groups


def _run_once(fns):
    """check() of a reference row: one call (so smoke runs it too); its error is not measured (NaN)."""
    return lambda cfg: (fns(cfg)[0](), float("nan"))[1]


def _memo_fns(build):
    """fns(cfg) for a reference row, built once (scaled_mm quantizes its operands when built)."""
    box = _lazy(lambda: build(None))
    return lambda _cfg: box()


def moe_group(data, m, name, max_cfg):
    s, family = data.shapes, MOE_FAMILY.get(name)
    launch, ref_fn, args, bytes_per_weight = data.tables()[name]
    xs, routes, distinct = data.moe(m)
    ref = _lazy(lambda: ref_fn(xs[0], *args, *routes[0], compute_dtype=torch.float32).float())

    def fns(cfg):
        return [lambda x=x, r=r: launch(x, *args, r[0], r[1], config=cfg) for x, r in zip(xs, routes)]

    current = fused_moe.select_config(m, family or "bf16")
    cands = [current] if family is None else moe_candidates(m, family, current, max_cfg)
    nbytes = distinct * 3 * s.i * s.hid * bytes_per_weight if m <= 256 else 0
    return Group(f"{name}|{m}", name, family, "moe" if family else "ref", m, f"experts={distinct}", nbytes,
                 2 * m * (s.k_routed + 1) * 3 * s.i * s.hid, cands, fns,
                 lambda cfg: rel_err(fns(cfg)[0]().float(), ref()))


def build_groups(data, sizes, max_cfg, only):
    """Every group of the sweep, in priority order (PRIORITY kernels, prefill first, then the references)."""
    def wanted(kernel):
        return not only or any(o in kernel for o in only)

    groups = []
    for m in sizes:
        for n, k in data.shapes.gemms:
            groups += gemm_groups(data, m, n, k, max_cfg, wanted)
        names = tuple(MOE_FAMILY) if data.compile_only else ("fused_moe bf16",) + tuple(MOE_FAMILY)
        groups += [moe_group(data, m, name, max_cfg) for name in names if wanted(name)]
    rank = {name: i for i, name in enumerate(PRIORITY)}
    return sorted(groups, key=lambda g: (rank.get(g.kernel, len(rank)), -g.m if g.m > 256 else g.m))


def job_order(groups):
    """Round-robin over groups by candidate rank: every group's current tile, then every group's first
    alternative, ..."""
    depth = max(len(g.candidates) for g in groups)
    return [(g, g.candidates[r]) for r in range(depth) for g in groups if r < len(g.candidates)]


# ---------------------------------------------------------------------------------------------------- compile workers
_WORKER: dict = {}


def _worker_init(shapes: Shapes, sizes, max_cfg, smoke):
    """A compile worker: Triton launches become JITFunction warm-ups (compile into the on-disk cache, no kernel
    runs), on the same shapes with 8 experts (the GEMM kernels' specialisation does not depend on the expert count;
    moe_align's does, so it is warmed with the real count)."""
    if not smoke:
        from triton.runtime.jit import JITFunction

        run = JITFunction.run

        def warm_run(self, *args, **kwargs):
            kwargs["warmup"] = True
            return run(self, *args, **kwargs)

        JITFunction.run = warm_run
    try:
        data = Data(dataclasses.replace(shapes, e=7), smoke, compile_only=True)
        _WORKER.update({g.key: g for g in build_groups(data, sizes, max_cfg, None)})
        _WORKER["align"] = (data, shapes.e + 1)
    except Exception as exc:  # noqa: BLE001 - a raising initializer would be respawned by the pool forever
        _WORKER["broken"] = f"{type(exc).__name__}: {exc}"


def _worker_job(job):
    key, cfg = job
    if "broken" in _WORKER:
        return _WORKER["broken"]
    try:
        g = _WORKER[key]
        g.fns(cfg)[0]()
        if g.table == "moe":  # moe_align specialises on the expert count: warm it for the real table's
            data, experts = _WORKER["align"]
            moe_align_triton(data.moe(g.m)[1][0][0], experts, cfg.block_m)
        return None
    except Exception as exc:  # noqa: BLE001 - the main thread compiles (and records) it again
        return f"{key} {cfg}: {type(exc).__name__}"


def start_compile_workers(n, shapes, sizes, max_cfg, smoke, jobs):
    """A spawn pool compiling the Triton jobs in the main thread's order; None when n == 0 or it cannot start."""
    if n <= 0:
        return None
    try:
        pool = mp.get_context("spawn").Pool(n, _worker_init, (shapes, sizes, max_cfg, smoke))
        pool.map_async(_worker_job, [(g.key, cfg) for g, cfg in jobs if g.family], chunksize=1)
        return pool
    except Exception as exc:  # noqa: BLE001 - compiling in the main thread still works
        print(f"compile workers not started: {type(exc).__name__}: {exc}", flush=True)
        return None


# ---------------------------------------------------------------------------------------------------------- the sweep
def run_job(g: Group, cfg, timer, args) -> dict:
    """Check one config against the reference, then time it; every failure is recorded in the row."""
    row = {"kernel": g.kernel, "family": g.family, "table": g.table, "m": g.m, "shape": g.shape,
           "config": dataclasses.asdict(cfg) if cfg else None, "config_key": repr(cfg), "config_obj": cfg,
           "is_current": g.candidates[0] == cfg, "status": "error", "rel_err": None, "graph_us": None}
    t = time.monotonic()
    try:
        row["rel_err"] = err = g.check(cfg)
        if g.family is not None and not err <= args.tol:
            row["status"] = "wrong"
        else:
            fns = g.fns(cfg)
            us = row["graph_us"] = timer.graph_us(fns)
            if args.single:
                row["single_us"] = timer.single_us(fns[0])
            row["GB/s"] = g.nbytes / (us * 1e-6) / 1e9 if g.nbytes else None
            row["%BW"] = 100 * row["GB/s"] / timer.bw if g.nbytes else None
            row["TF/s"] = g.flops / (us * 1e-6) / 1e12
            row["%bf16"] = 100 * row["TF/s"] / timer.fl
            row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - one failing config must not stop the sweep
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if cuda_poisoned():
            row["status"] = "cuda-error"
    if g.m > 256 and torch.cuda.is_available():
        torch.cuda.empty_cache()  # prefill graphs hold ~1 GB pools each
    row["job_s"] = round(time.monotonic() - t, 2)
    return row


def watchdog(rec: Recorder, seconds: float) -> None:
    """At budget + grace: print the table, write the JSON and exit, whatever the main thread is doing."""
    def fire():
        rec.stopped = f"watchdog at {seconds:.0f} s"
        print(f"\nWATCHDOG: {seconds:.0f} s reached, reporting what was measured", flush=True)
        for child in mp.active_children():
            child.kill()
        rec.finish(finished=False)
        sys.stdout.flush()
        os._exit(0 if rec.rows else 3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="fp8_tiles.json")
    ap.add_argument("--time-budget-s", type=float, default=200.0, help="no job starts after this (from start-up)")
    ap.add_argument("--grace-s", type=float, default=25.0, help="watchdog: report and exit at budget + grace")
    ap.add_argument("--sizes", default=None, help="comma-separated M values (default 1,32,128,8192)")
    ap.add_argument("--only", default=None, help="comma-separated substrings of kernel names to keep")
    ap.add_argument("--max-configs", type=int, default=10, help="per (kernel, M), the current tile included")
    ap.add_argument("--compile-workers", type=int, default=None, help="default min(12, cpus - 2); 0: none")
    ap.add_argument("--tol", type=float, default=None,
                    help="relative error above which a config is wrong (default 2e-2; smoke 5e-2: tiny K)")
    ap.add_argument("--single", action="store_true", help="also time a single eager call (time_single_us)")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, 2 configs, no timing")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    shapes = SMOKE if args.smoke else Shapes()
    sizes = tuple(int(v) for v in args.sizes.split(",")) if args.sizes else ((1, 32) if args.smoke else
                                                                              (1, 32, 128, 8192))
    max_cfg = 2 if args.smoke else args.max_configs
    args.tol = args.tol if args.tol is not None else (5e-2 if args.smoke else 2e-2)
    only = args.only.split(",") if args.only else None
    workers = args.compile_workers if args.compile_workers is not None else (
        0 if args.smoke else min(12, (os.cpu_count() or 4) - 2))
    timer = Timer(args.smoke)
    rec = Recorder(args.out, timer, args)
    rec.t0 = t0
    watchdog(rec, args.time_budget_s + args.grace_s - (time.monotonic() - t0))
    print(f"copy {timer.bw:.0f} GB/s, bf16 GEMM {timer.fl:.0f} TFLOP/s", flush=True)
    groups = build_groups(Data(shapes, args.smoke), sizes, max_cfg, only)
    jobs = job_order(groups)
    pool = start_compile_workers(workers, shapes, sizes, max_cfg, args.smoke, jobs)
    print(f"{len(groups)} groups, {len(jobs)} jobs, {workers if pool else 0} compile workers, "
          f"{time.monotonic() - t0:.1f} s in", flush=True)
    for i, (g, cfg) in enumerate(jobs):
        if time.monotonic() - t0 > args.time_budget_s:
            rec.skipped = len(jobs) - i
            break
        row = run_job(g, cfg, timer, args)
        rec.add(row)
        if row["status"] == "cuda-error":
            rec.stopped, rec.skipped = f"CUDA context lost at {g.key} {cfg}", len(jobs) - i - 1
            break
    if pool is not None:
        pool.terminate()
    rec.finish(finished=rec.skipped == 0 and rec.stopped is None)
    return 0 if rec.rows else 1


if __name__ == "__main__":
    sys.exit(main())
