"""MoE align A/B on the GPU: the single-program (decode) and multi-program
(prefill) paths of `moe_align_triton`. A script, not a test.

    PYTHONPATH=. python3 benchmarks/gpu_moe_align_ab.py --out moe_align_ab.json
    python3 benchmarks/gpu_moe_align_ab.py --smoke      # CPU: Triton interpreter, tiny shapes, checks only

What: one TP4 rank of MiniMax-M3 (129 experts: 128 routed + the shared one as id 128, k = 5 slots per token), at
numel = T*k = 160 (B = 32 decode), 640 (B = 128), 8192*5 and 32768*5 pairs (prefill), BLOCK_M 16 and 64. Routing is
near-uniform: each token picks 4 distinct routed experts uniformly at random, its 5th slot is always 128.
Variants: `single` (chunk=0, decode sizes only), `multi cN` (chunk=N: two launches over N-pair chunks) and `default`
(chunk=None: the launcher's rule, `align_chunk`).
Checks per variant (an integer op, so no relative error): on fresh random data and on skewed data (every routed slot
to expert 5), the outputs against `moe_align_ref`:
`bad_tiles` = tiles whose expert id differs or that hold a pair of another expert (0 is valid; row order within an
expert is free), rows in use equal, every pair present once, and the zero-at-rest counters back to 0; then a CUDA
graph of one call replayed 5 times (counters carried across replays) and checked again.
Timing: gpu_bench_common.time_graph_us, CUDA-graph replay of 20 back-to-back calls on the same ids (the ids are
small: 656 KB at the largest size, L2-resident as they are after the router), median us per call.
Output: one ROW line per variant, then a table with the speed-up vs `single`; JSON with every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported: the CPU interpreter runs the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import time_graph_us  # noqa: E402
from ladle.kernels.moe_align import align_chunk, moe_align_ref, moe_align_triton  # noqa: E402
from ladle.kernels.split_counters import split_counters  # noqa: E402

E, K, SHARED = 129, 5, 128
PREFILL_CHUNKS = (256, 512, 1024)
SIZES = ((32, (0, 256)), (128, (0, 256)), (8192, PREFILL_CHUNKS), (32768, PREFILL_CHUNKS))  # (T, chunks)
SMOKE_SIZES = ((8, (0, 16)), (220, (0, 128)))  # 40 and 1100 pairs: the default is single, then multi


def routing(T: int, dev: str, skewed: bool = False) -> torch.Tensor:
    """[T, 5] int32: 4 distinct routed experts per token (uniform; all expert 5 when skewed) + the shared 128."""
    routed = torch.rand(T, SHARED, device=dev).topk(K - 1, dim=1).indices.int()
    if skewed:
        routed = torch.full_like(routed, 5)
    return torch.cat([routed, torch.full((T, 1), SHARED, dtype=torch.int32, device=dev)], dim=1)


def bad_tiles(out, ids: torch.Tensor, bm: int) -> int:
    """Tiles that break the alignment contract against moe_align_ref: a tile expert id that differs, or a row of a
    tile whose pair is not routed to the tile's expert (+ 10**6 if rows in use, the pair set — every pair exactly
    once — or the counters are wrong): 0 means a valid alignment. Row order within an expert is free (module doc of
    moe_align.py), so rows are not compared tile by tile."""
    s, ex, n = out
    rs, rex, rn = moe_align_ref(ids, E, bm)
    numel = ids.numel()
    flat = ids.reshape(-1).long()
    rows = s.view(-1, bm).long()
    used = rows < numel
    row_expert = torch.where(used, flat[rows.clamp(max=numel - 1)], -1)
    wrong = (used & (row_expert != ex.long()[:, None])).any(1)
    bad = int((ex != rex).sum()) + int(wrong.sum())
    pairs_ok = torch.equal(torch.sort(s[s < numel]).values, torch.arange(numel, device=s.device, dtype=s.dtype))
    counters_ok = int(split_counters("moe_align", s.device, E + 1)[:E + 1].abs().sum()) == 0
    return bad + (0 if torch.equal(n, rn) and pairs_ok and counters_ok else 10**6)


def graph_bad_tiles(fn, ids: torch.Tensor, bm: int) -> int:
    """Capture one call in a CUDA graph, replay it 5 times, check the last replay's outputs."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return bad_tiles(out, ids, bm)


def run_variant(name, fn, ids, skew, bm, smoke) -> dict:
    row = {"variant": name, "numel": ids.numel(), "block_m": bm}
    try:
        row["bad_tiles"] = bad_tiles(fn(ids), ids, bm)
        row["bad_tiles_skewed"] = bad_tiles(fn(skew), skew, bm)
        if not smoke:
            row["bad_tiles_graph"] = graph_bad_tiles(lambda: fn(ids), ids, bm)
            row["us"] = time_graph_us([lambda: fn(ids)] * 20)
        row["valid"] = row["bad_tiles"] == row["bad_tiles_skewed"] == row.get("bad_tiles_graph", 0) == 0
    except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
        row.update(valid=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="moe_align_ab.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--time-budget-s", type=float, default=90.0)
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    t0 = time.monotonic()
    torch.manual_seed(0)
    rows = []
    for T, chunks in (SMOKE_SIZES if args.smoke else SIZES):
        for bm in (16, 64):
            ids, skew = routing(T, dev), routing(T, dev, skewed=True)
            variants = [("single" if c == 0 else f"multi c{c}", lambda x, bm=bm, c=c: moe_align_triton(x, E, bm, c))
                         for c in chunks]
            default = align_chunk(ids.numel(), bm)
            variants.append((f"default (c{default})", lambda x, bm=bm: moe_align_triton(x, E, bm)))
            base_us = None
            for name, fn in variants:
                if time.monotonic() - t0 > args.time_budget_s:
                    print(f"time budget spent: skipping {name} at T={T} bm={bm}", flush=True)
                    continue
                row = run_variant(name, fn, ids, skew, bm, args.smoke)
                base_us = row.get("us") if name == "single" else base_us
                if base_us and row.get("us"):
                    row["speedup"] = base_us / row["us"]
                rows.append(row)
                print("ROW " + json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"experts": E, "k": K, "rows": rows}, f, indent=1)
    nan = float("nan")
    print(f"\nmoe_align, {E} experts, k = {K}, near-uniform routing; CUDA-graph us per call (20 calls per replay)")
    print(f"{'variant':>15} {'numel':>7} {'BM':>3} {'us':>8} {'vs single':>9} {'bad tiles (rand/skew/graph)':>28}")
    for r in rows:
        bad = f"{r.get('bad_tiles', '-')}/{r.get('bad_tiles_skewed', '-')}/{r.get('bad_tiles_graph', '-')}"
        print(f"{r['variant']:>15} {r['numel']:>7} {r['block_m']:>3} {r.get('us', nan):8.2f} "
              f"{r.get('speedup', nan):9.2f} {bad:>28} {'' if r['valid'] else 'INVALID'} {r.get('error', '')}")
    print(f"valid: {sum(r['valid'] for r in rows)}/{len(rows)} variants")


if __name__ == "__main__":
    main()
