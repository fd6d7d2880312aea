"""MXFP4 W4A16 fused MoE at decode sizes: today's wide-K-step kernel vs the decode path
(ladle/kernels/fused_moe_mxfp4_decode.py: swap AB, PTX dequant into the wgmma A registers) in a few tiles, with the
FP8 fused MoE on the same routing as the yardstick. A script, not a test:

    PYTHONPATH=. python3 benchmarks/gpu_mxfp4_decode_ab.py --out mxfp4_decode_ab.json   # H200, < 100 s
    python3 benchmarks/gpu_mxfp4_decode_ab.py --smoke     # CPU: Triton interpreter, tiny shapes, errors only

Shapes: one TP4 rank of MiniMax-M3 (H 6144, I 768, 128 routed experts + the shared expert as row 128, top-4 +
shared), M = 1, 32, 128 tokens with near-uniform routing (the router on random gates; data builders of
benchmarks/gpu_mxfp4_ab.py: random weights x 0.02 quantized expert by expert). Per (variant, M): one call checked
against `fused_moe_mxfp4_ref` in float32 on the first input set (relative error; the FP8 row against its own
W8A8 reference), then CUDA-graph replay time per call over R input sets with their own routes
(gpu_bench_common.time_graph_us; R = 16 at M = 1 so the experts touched total >= 4x the L2, else 4); GB/s and % of
copy bandwidth over the bytes of the first set's distinct experts (MXFP4: packed + E8M0, 0.5 + 1/32 byte per
weight; FP8: 1 + 4/128). M = 128 is above the decode path's dispatch bound (64): its rows there are forced
(path="decode") to show where the crossover lies. READ: the decode rows' rel_err must equal the wide rows' (about
3e-3: bf16 intermediate and output) -- a large error means the PTX nibble conversion is wrong on the GPU (it is
only replayed in Python on the CPU); "speed-up" is vs the wide kernel at the same M. "... slots16" rows: GEMM 2's
per-slot rows in the activation dtype (slot_dtype=x.dtype: bf16 on the H200, float32 under --smoke; the SLOT_DTYPE
A/B of ladle/kernels/fused_moe.py) for the decode default, the wide kernel and the FP8 yardstick: compare each with
its float32-slot row (at decode sizes the slot rows are small, so little is expected; their rel_err may grow by
the slot rounding, <= 2^-8 relative per slot). Every row runs in its own
try/except; a failure prints as a row. SYNTHETIC DATA.
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
from benchmarks.gpu_bench_common import measure_copy_bandwidth, rel_err, time_graph_us  # noqa: E402
from benchmarks.gpu_mxfp4_ab import FULL, SMOKE, build_weights, inputs, save  # noqa: E402
from ladle.kernels.fp8_quant import quantize_fp8_rows  # noqa: E402
from ladle.kernels.fused_moe import SWIGLU_ALPHA, SWIGLU_LIMIT  # noqa: E402
from ladle.kernels.fused_moe_fp8 import fused_moe_fp8_ref, fused_moe_fp8_triton  # noqa: E402
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_ref, fused_moe_mxfp4_triton  # noqa: E402
from ladle.kernels.fused_moe_mxfp4_decode import DecodeTile, fused_moe_mxfp4_decode  # noqa: E402

MX4_BPW, FP8_BPW = 0.5 + 1 / 32, 1 + 4 / 128
# "decode" = the default tile (2 groups; one K = 32 dot per group since session 9)
DECODE_TILES = {"decode": DecodeTile(), "decode G4": DecodeTile(groups=4), "decode G8": DecodeTile(groups=8),
                "decode BN128 w8": DecodeTile(block_n=128, num_warps=8)}


def fp8_tables(bf16):
    """The FP8 yardstick's tables: the dequantised MXFP4 weights re-quantized per 128 x 128 block, expert by expert."""
    out = []
    for w in bf16:
        pairs = [quantize_fp8_rows(x.float()) for x in w]
        out += [torch.stack([p for p, _ in pairs]), torch.stack([s for _, s in pairs])]
    return out


def variants(tabs, f8):
    """name -> (launch(x, ids, wts), reference(x, ids, wts), bytes per weight)."""
    def ref4(x, ids, wts):
        return fused_moe_mxfp4_ref(x, *tabs, ids, wts, compute_dtype=torch.float32)

    table = {"wide (today)": (lambda x, ids, wts: fused_moe_mxfp4_triton(x, *tabs, ids, wts, path="wide"), ref4,
                              MX4_BPW),
             "wide slots16": (lambda x, ids, wts: fused_moe_mxfp4_triton(x, *tabs, ids, wts, path="wide",
                                                                          slot_dtype=x.dtype), ref4, MX4_BPW)}
    for name, tile in DECODE_TILES.items():
        table[name] = (lambda x, ids, wts, tile=tile: fused_moe_mxfp4_decode(
            x, *tabs, ids, wts, ids.shape[1], SWIGLU_ALPHA, SWIGLU_LIMIT, tile=tile), ref4, MX4_BPW)
        if name == "decode":
            table["decode slots16"] = (lambda x, ids, wts, tile=tile: fused_moe_mxfp4_decode(
                x, *tabs, ids, wts, ids.shape[1], SWIGLU_ALPHA, SWIGLU_LIMIT, tile=tile, slot_dtype=x.dtype), ref4,
                MX4_BPW)
    if f8 is not None:
        def ref8(x, ids, wts):
            return fused_moe_fp8_ref(x, *f8, ids, wts, compute_dtype=torch.float32)

        table["fp8 (yardstick)"] = (lambda x, ids, wts: fused_moe_fp8_triton(x, *f8, ids, wts), ref8, FP8_BPW)
        table["fp8 slots16"] = (lambda x, ids, wts: fused_moe_fp8_triton(x, *f8, ids, wts, slot_dtype=x.dtype), ref8,
                                FP8_BPW)
    return table


_REFS: dict = {}  # (reference, M) -> its output on the first input set (the MXFP4 rows share one reference)


def run_row(s, name, launch, ref, bpw, m, data, bw, smoke):
    xs, routes, distinct = data
    row = {"variant": name, "M": m, "experts": distinct}
    t0 = time.time()
    try:
        out = launch(xs[0], *routes[0])
        key = (ref.__qualname__, m)
        if key not in _REFS:
            _REFS[key] = ref(xs[0], *routes[0]).float()
        row["rel_err"] = rel_err(out.float(), _REFS[key])
        if not smoke:
            us = time_graph_us([lambda x=x, r=r: launch(x, *r) for x, r in zip(xs, routes)])
            row["us"] = us
            row["GB/s"] = distinct * 3 * s["i"] * s["hid"] * bpw / (us * 1e-6) / 1e9
            row["%BW"] = 100 * row["GB/s"] / bw
    except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["wall_s"] = round(time.time() - t0, 1)
    print("ROW", json.dumps(row), flush=True)
    return row


def fmt(row, base):
    def num(key, spec):
        return format(row[key], spec) if isinstance(row.get(key), (int, float)) else "-"

    speed = f"{base / row['us']:.2f}x" if base and isinstance(row.get("us"), float) else "-"
    return (f"{row['variant']:<18} {row['M']:>4} {row['experts']:>4} {num('us', '9.1f'):>9} {num('GB/s', '7.0f'):>7} "
            f"{num('%BW', '6.1f'):>6} {num('rel_err', '9.1e'):>9} {speed:>8}  {row.get('error', '')}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mxfp4_decode_ab.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    ap.add_argument("--time-budget-s", type=float, default=90.0, help="skip the remaining rows after this")
    args = ap.parse_args(argv)
    t_start = time.time()
    s = SMOKE if args.smoke else FULL
    torch.manual_seed(0)
    bw = float("nan") if args.smoke else measure_copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tabs, bf16 = build_weights(s, dtype)
    f8 = fp8_tables(bf16)
    del bf16
    rows = []
    for m in ((1, 32) if args.smoke else (1, 32, 128)):
        try:
            data = inputs(s, m, dtype)
        except Exception as exc:  # noqa: BLE001
            print(f"inputs M={m} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        for name, (launch, ref, bpw) in variants(tabs, f8).items():
            if time.time() - t_start > args.time_budget_s:
                rows.append({"variant": name, "M": m, "experts": data[2], "error": "skipped: --time-budget-s"})
                continue
            rows.append(run_row(s, name, launch, ref, bpw, m, data, bw, args.smoke))
            save(args.out, bw, s, rows)
    print(f"\ncopy {bw:.0f} GB/s; H {s['hid']} I {s['i']} E {s['e']}+1 top-{s['k']}+shared; CUDA-graph us per call; "
          "%BW over the touched experts' bytes; speed-up vs wide (today) at the same M")
    print(f"{'variant':<18} {'M':>4} {'exp':>4} {'us':>9} {'GB/s':>7} {'%BW':>6} {'rel_err':>9} {'speed-up':>8}")
    for row in rows:
        base = next((r.get("us") for r in rows if r["M"] == row["M"] and r["variant"] == "wide (today)"), None)
        print(fmt(row, base if isinstance(base, float) else None))
    save(args.out, bw, s, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
