"""MoE router A/B at one TP4 rank of MiniMax-M3 (H 6144, E 128 routed experts, top-4 + the shared column, bf16 x,
fp32 router weight and bias as the layer stores them). A script, not a test:

    PYTHONPATH=. python3 benchmarks/gpu_moe_router_ab.py --out moe_router_ab.json [--time-budget-s 150]  # H200, <3 min
    PYTHONPATH=. python3 benchmarks/gpu_moe_router_ab.py --smoke   # CPU: Triton interpreter, small shapes, checks only

Variants per T in {1, 32, 128, 8192}:
  "today"          torch logits + the routing epilogue: logits = x.float() @ W^T in torch (IEEE fp32, TF32 off: a
                   cuBLAS fp32 GEMM plus the fp32 copy of x), then `route_from_logits` (`_router_topk_kernel`) on them;
  "kernel"         the Triton logits kernel forced at every T (`moe_router_kernel`, precision "tf32x3"): x read in
                   bf16, 3xTF32 tl.dot, epilogue fused or split K + `_router_topk_kernel` by the launch rule;
  "kernel tf32x2w" the same kernel and launch, W split in the kernel (TF32 high part + residual, two tf32 dots;
                   ladle/kernels/moe_router.py's module doc), every T;
  "kernel ieee"    the same kernel and launch with fp32 FMA products (exact-rounded, as the reference), T <= 128;
  "op"             `moe_router_triton` as dispatched by the module's switches (ROUTER_KERNEL_MIN_TOKENS,
                   ROUTER_LARGE_T_PRECISION, ROUTER_SMALL_T_PRECISION; today: "today"'s path below 128 tokens,
                   "kernel"'s from there).
The "cfg" column names the path: "torch", or the kernel's precision and BLOCK_T/BLOCK_K/splits.
READ: "op" must match the fastest allowed variant at every T (round 7 on the H200: today 13.1/20.6/25.4/411.0 us,
kernel 22.1/26.3/23.6/370.4 us at T = 1/32/128/8192), with logit rel err ~1e-7..1e-6 and ids=f64 equal to today's
count (or off by a near-tie). Then flip the switches: "kernel tf32x2w" faster than "kernel" from 128 tokens (offline
sm_90 SASS of the fused BLOCK_T 64 launch: 162 instructions per K step vs 500 for tf32x3) with the same error class
-> ROUTER_LARGE_T_PRECISION = "tf32x2w"; "kernel ieee" faster than "today" below 128 -> ROUTER_SMALL_T_PRECISION =
"ieee"; if a crossing moves, move ROUTER_KERNEL_MIN_TOKENS. "kernel ieee" and "kernel" share the split-K launch and
its `_router_topk_kernel` pass (96 splits at T = 1 and 32), so a gap between "kernel ieee" and "kernel" at small T is
the dot, and what both keep over ~1 us (3 MB of W at copy bandwidth) is the launch and the split sum. Session 11:
"today e1" and "kernel x2w e1" (T <= 128) run "today" / "kernel tf32x2w" with the epilogue as it was before (16
token rows per program, one split per load: two programs walk 96 dependent loads at T = 32): the same-run baseline
of the blocked epilogue (4 rows per program up to 256 tokens, up to 16 splits per load). "small x2w" / "small ieee"
(T <= 64): `moe_router_small_t`, one launch of 8 expert blocks x 12 K splits with two-level arrival counters (the
last split of a block sums its partials, the last block routes): the candidate for ROUTER_SMALL_T_PRECISION (its
"logit rel" column is the split-K kernel's at the same precision: the one-launch kernel keeps its logits inside).
Checks, on fresh random data per T (x ~ N(0,1), W ~ N(0, 1/H) so logits ~ N(0,1), bias ~ N(0, 0.1^2)): the logits'
relative error against a float64 reference (the logits of the path the variant runs: torch's fp32 logits, or the
kernel's own via `moe_router_logits_triton` with the same splits), the ids that equal the float64 reference's top-4
(stable, lower id on ties) and the routed weights' relative error against float64 weights for each variant's own
ids. Timing
(gpu_bench_common): CUDA-graph replay over R (x, W, bias) sets totalling >= 4x the L2 (each of the 57 MoE layers has
its own W, so W is not L2-resident in a real step), median per-call us; GB/s over x + W + outputs, % of the copy
bandwidth measured in this run; TFLOP/s = 2 T H E / t. A variant that fails prints a row saying so.
SYNTHETIC DATA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported: the CPU interpreter runs the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import L2_BYTES, measure_copy_bandwidth, rel_err, time_graph_us  # noqa: E402
from ladle.kernels import moe_router  # noqa: E402
from ladle.kernels.moe_router import (moe_router_kernel, moe_router_small_t, moe_router_logits_triton, moe_router_triton,  # noqa: E402
                                      route_from_logits, router_launch, router_logits, router_path)

FULL = dict(h=6144, e=128, k=4, tokens=(8192, 1, 32, 128), device="cuda")  # prefill first: the budget cuts last
SMOKE = dict(h=256, e=12, k=4, tokens=(1, 17, 128), device="cpu")  # 128: the op's kernel path
ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


def make_sets(s: dict, T: int, R: int, seed: int) -> list[tuple]:
    g = torch.Generator(device=s["device"]).manual_seed(seed)
    dev, h, e = s["device"], s["h"], s["e"]
    return [(torch.randn(T, h, generator=g, device=dev).bfloat16(),
             torch.randn(e, h, generator=g, device=dev) / math.sqrt(h),
             torch.randn(e, generator=g, device=dev) * 0.1) for _ in range(R)]


# variant -> (the kernel precision it forces (None: "today" = torch logits, "op" = the module's rule), max T it runs,
# split-K count (None: `router_launch`'s rule; session 9: fewer splits at decode sizes, where the rule gives 96 and
# the epilogue sums them one after another in cdiv(T, 16) programs))
VARIANTS = {"today": (None, None, None), "kernel": ("tf32x3", None, None), "kernel tf32x2w": ("tf32x2w", None, None),
            "kernel ieee": ("ieee", 128, None), "kernel s8": ("tf32x3", 128, 8), "kernel s16": ("tf32x3", 128, 16),
            "kernel s32": ("tf32x3", 128, 32), "kernel ieee s32": ("ieee", 128, 32), "op": (None, None, None),
            "today e1": (None, 128, None), "kernel x2w e1": ("tf32x2w", 128, None),
            "small x2w": ("tf32x2w", 64, None), "small ieee": ("ieee", 64, None)}
# "... e1": the epilogue as before session 11 (`_router_topk_kernel` with 16 token rows per program and one split per
# load), the rest as the variant without the suffix: the same-run baseline of the blocked epilogue.
OLD_EPILOGUE = dict(EPILOGUE_BLOCK_T_SMALL=16, EPILOGUE_TILE_ELEMS=1)


class old_epilogue:
    """Context: moe_router's epilogue constants as before session 11 (read when a launch is built or captured)."""

    def __enter__(self):
        self.saved = {k: getattr(moe_router, k) for k in OLD_EPILOGUE}
        for k, v in OLD_EPILOGUE.items():
            setattr(moe_router, k, v)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(moe_router, k, v)


def path_of(name: str, T: int, x_dtype: torch.dtype) -> str:
    """The logits path a variant runs at T: "torch logits" or "triton logits <precision>" (`router_path`)."""
    if name in ("today", "today e1"):
        return "torch logits"
    return router_path(T, x_dtype, VARIANTS[name][0])


def call(name: str, x, w, b, k):
    if name.endswith(" e1"):
        with old_epilogue():
            return call({"today e1": "today", "kernel x2w e1": "kernel tf32x2w"}[name], x, w, b, k)
    if name.startswith("small "):
        return moe_router_small_t(x, w, b, k, 2.0, shared_expert=True, precision=VARIANTS[name][0])
    if name == "today":
        return route_from_logits(router_logits(x, w)[None], b, k, 2.0, shared_expert=True)
    if name == "op":
        return moe_router_triton(x, w, b, k, 2.0, shared_expert=True)
    return moe_router_kernel(x, w, b, k, 2.0, shared_expert=True, precision=VARIANTS[name][0],
                             splits=VARIANTS[name][2])


def check(name: str, x, w, b, k) -> dict:
    """Errors of one call against float64 (module doc)."""
    T, l64 = x.shape[0], x.double() @ w.double().T
    splits = router_launch(T, x.shape[1], w.shape[0], x.device, VARIANTS.get(name, (0, 0, None))[2]).splits
    path = path_of(name, T, x.dtype)
    logits = (router_logits(x, w) if path == "torch logits"
              else moe_router_logits_triton(x, w, splits=splits, precision=path.split()[-1]))
    ids, wts = call(name, x, w, b, k)
    choice = torch.sigmoid(l64) + b.double()
    rids = torch.sort(choice, dim=1, descending=True, stable=True).indices[:, :k]
    sig = torch.sigmoid(l64).gather(1, ids[:, :k].long())
    w64 = sig / sig.sum(1, keepdim=True) * 2.0
    shared_ok = bool((ids[:, k] == w.shape[0]).all() and (wts[:, k] == 1.0).all())
    return dict(logit_rel_err=rel_err(logits, l64), ids_agree=int((ids[:, :k].long() == rids).all(1).sum()),
                weight_rel_err=rel_err(wts[:, :k], w64), shared_ok=shared_ok, ids=ids)


def run_T(s: dict, T: int, bw: float, deadline: float, smoke: bool) -> None:
    per_set = T * s["h"] * 2 + s["e"] * s["h"] * 4
    R = 1 if smoke else max(1, min(64, math.ceil(4 * L2_BYTES / per_set)))
    sets = make_sets(s, T, R, seed=T)
    x, w, b = sets[0]
    base_us, base_ids = None, None
    for name, (_, max_t, splits) in VARIANTS.items():
        if max_t is not None and T > max_t:
            continue
        cfg, path = router_launch(T, s["h"], s["e"], x.device, splits), path_of(name, T, x.dtype)
        row = dict(variant=name, T=T, H=s["h"], E=s["e"], R=R, cfg="torch" if path == "torch logits" else
                   f"{path.split()[-1]} one launch" if name.startswith("small ") else
                   f"{path.split()[-1]} {cfg.block_t}/{cfg.block_k}/{cfg.splits}")
        if time.time() > deadline:
            ROWS.append(dict(row, error="skipped: time budget"))
            log(json.dumps(ROWS[-1]))
            continue
        try:
            row.update(check(name, x, w, b, s["k"]))
            ids = row.pop("ids")
            base_ids = ids if name == "today" else base_ids
            row["ids_agree_today"] = -1 if base_ids is None else int((ids == base_ids).all(1).sum())
            if not smoke:
                us = time_graph_us([lambda xs=xs: call(name, *xs, s["k"]) for xs in sets])
                base_us = us if name == "today" else base_us
                nbytes = per_set + T * (s["k"] + 1) * 8
                row.update(us=us, tflops=2 * T * s["h"] * s["e"] / (us * 1e-6) / 1e12,
                           pct_bw=100 * nbytes / (us * 1e-6) / 1e9 / bw,
                           speedup=base_us / us if base_us else float("nan"))
        except Exception as exc:  # a failing variant is a row, never the end of the run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        ROWS.append(row)
        log(json.dumps(row))


def print_table() -> None:
    hdr = (f"{'variant':<14} {'T':>5} {'cfg prec BT/BK/S':<17} {'us':>8} {'TFLOP/s':>8} {'%BW':>6} {'x today':>7} "
           f"{'logit rel':>9} {'ids=f64':>8} {'ids=today':>9} {'w rel':>8}")
    log("\n" + hdr + "\n" + "-" * len(hdr))
    for r in sorted(ROWS, key=lambda r: r["T"]):
        head = f"{r['variant']:<14} {r['T']:>5} {r['cfg']:<17}"
        if "error" in r:
            log(f"{head} FAILED/SKIPPED: {r['error']}")
            continue
        timing = (f"{r['us']:>8.1f} {r['tflops']:>8.2f} {r['pct_bw']:>6.1f} {r['speedup']:>7.2f}" if "us" in r
                  else f"{'-':>8} {'-':>8} {'-':>6} {'-':>7}")
        log(f"{head} {timing} {r['logit_rel_err']:>9.1e} {r['ids_agree']:>4}/{r['T']:<3} {r['ids_agree_today']:>5}/"
            f"{r['T']:<3} {r['weight_rel_err']:>8.1e}" + ("" if r["shared_ok"] else "  SHARED COLUMN WRONG"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="moe_router_ab.json")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, checks only (no timing)")
    ap.add_argument("--time-budget-s", type=float, default=150.0, help="skip the remaining variants after this")
    args = ap.parse_args()
    s = SMOKE if args.smoke else FULL
    t0 = time.time()
    deadline = t0 + args.time_budget_s
    bw, dev = 0.0, "cpu (Triton interpreter)"
    if not args.smoke:
        dev, bw = torch.cuda.get_device_name(), measure_copy_bandwidth()
    log(f"device {dev}: copy {bw:.0f} GB/s")
    for T in s["tokens"]:
        run_T(s, T, bw, deadline, args.smoke)
        if not args.smoke:
            torch.cuda.empty_cache()
    log(f"all done {time.time() - t0:.0f}s")
    with open(args.out, "w") as f:
        json.dump(dict(device=dev, copy_gbps=bw, synthetic=True, rows=ROWS), f, indent=1)
    print_table()


if __name__ == "__main__":
    main()
