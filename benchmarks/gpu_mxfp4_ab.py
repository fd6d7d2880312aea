"""MXFP4 fused MoE at one TP4 rank of MiniMax-M3 (H 6144, I 768, 128 experts top-4 + the shared row): the wide-K-step
kernels of ladle/kernels/fused_moe_mxfp4.py -- W4A16 and W4A8 as dispatched, and the launcher's A/B switches:
W4A16 at BK 256 (`block_k`), both variants dequantising in bf16 arithmetic (`dequant="bf16"`; the default is f32 until this run clears it) -- next
to the bf16 fused MoE on the same (dequantised) weights as the bandwidth yardstick. A script, not a test:

    PYTHONPATH=. python3 benchmarks/gpu_mxfp4_ab.py [--out mxfp4_ab.json] [--prefill] [--tiles]  # H200, 1-3 min
    python3 benchmarks/gpu_mxfp4_ab.py --smoke     # CPU: Triton interpreter, tiny shapes, errors only, no timing

Per (variant, M) with M = 1, 32, 128 (and 8192 with --prefill): CUDA-graph replay time per call over R activation
sets with their own routes (gpu_bench_common.time_graph_us; R = 16 at M = 1 so the experts touched total >= 4x the
L2, else 4), GB/s and % of copy bandwidth over the bytes of the first set's distinct experts (packed weights +
E8M0 scales, 0.5 + 1/32 byte per weight; bf16: 2), the relative error against `fused_moe_mxfp4_ref` in float32 on
the first set (W4A8 against its own fp8-activation reference), and the tile the launcher picked (--tiles: a few
other decode tiles of the default kernels). Round-3 figures of
the previous kernel (K step 32; benchmarks/results/round3/fp8_tiles.txt): W4A16 344.6 / 2279.9 / 3605.1 us
(2.6 / 6.9 / 6.2 %BW) and W4A8 289.8 / 1928.2 / 3050.4 us at M = 1 / 32 / 128. Every row runs in its own
try/except; the table prints whatever failed. READ: the "bf16" rows' rel_err must match the default (f32) rows'
(about 1e-2 or less: bf16 intermediate and output) before dequant="bf16" may become the default; a much larger error
only in the bf16 rows means the GPU flushes bf16 subnormals (the 0.5 code passes through 2^-127).
SYNTHETIC DATA (random weights x 0.02, near-uniform routing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported: the CPU interpreter runs the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import measure_copy_bandwidth, rel_err, time_graph_us  # noqa: E402
from ladle.kernels.fp8_quant import dequant_mxfp4, quantize_mxfp4  # noqa: E402
from ladle.kernels.fused_moe import MoETileConfig, fused_moe_triton, select_config  # noqa: E402
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_ref, fused_moe_mxfp4_triton, mxfp4_block_k  # noqa: E402
from ladle.kernels.moe_router import moe_router_triton  # noqa: E402

FULL = dict(hid=6144, i=768, e=128, k=4, device="cuda")
SMOKE = dict(hid=288, i=96, e=8, k=2, device="cpu")


def build_weights(s, dtype):
    """Packed MXFP4 tables (w13 [E+1, 2I, H/2], its scales, w2 [E+1, H, I/2], its scales), quantized expert by
    expert from random float weights (no full float table kept), and their exact dequantisation in `dtype` (the
    activation dtype: bf16 on the GPU) for the bf16 fused MoE row."""
    g = torch.Generator(device=s["device"]).manual_seed(0)
    tabs = []
    for rows, cols in ((2 * s["i"], s["hid"]), (s["hid"], s["i"])):
        pairs = [quantize_mxfp4(torch.randn(rows, cols, generator=g, device=s["device"]) * 0.02)
                 for _ in range(s["e"] + 1)]
        tabs += [torch.stack([p for p, _ in pairs]), torch.stack([q for _, q in pairs])]
    bf16 = [dequant_mxfp4(tabs[0], tabs[1], dtype), dequant_mxfp4(tabs[2], tabs[3], dtype)]
    return tabs, bf16


def inputs(s, m, dtype):
    sets = 1 if m > 256 else (16 if m == 1 else 4)
    gate = torch.randn(s["e"], s["hid"], device=s["device"]) * 0.02
    xs = [torch.randn(m, s["hid"], device=s["device"]).to(dtype) for _ in range(sets)]
    routes = [moe_router_triton(x, gate, torch.zeros(s["e"], device=s["device"]), s["k"], 2.0, shared_expert=True)
              for x in xs]
    return xs, routes, int(torch.unique(routes[0][0]).numel())


def variants(tabs, bf16):
    """name -> (launch(x, ids, wts), reference(x, ids, wts), bytes per weight)."""
    mx = functools.partial
    ref16 = mx(fused_moe_mxfp4_ref, w13=tabs[0], w13_scale=tabs[1], w2=tabs[2], w2_scale=tabs[3],
               compute_dtype=torch.float32)

    def call(fn, **kw):
        return lambda x, ids, wts: fn(x, *tabs, ids, wts, **kw)

    def ref(**kw):
        return lambda x, ids, wts: ref16(x=x, topk_ids=ids, topk_weights=wts, **kw)

    return {
        "w4a16 bf16": (call(fused_moe_mxfp4_triton, dequant="bf16"), ref(), 0.5 + 1 / 32),
        "w4a16 bk256": (call(fused_moe_mxfp4_triton, block_k=256), ref(), 0.5 + 1 / 32),
        "w4a16": (call(fused_moe_mxfp4_triton), ref(), 0.5 + 1 / 32),
        "w4a8 bf16": (call(fused_moe_mxfp4_triton, fp8_activations=True, dequant="bf16"), ref(fp8_activations=True),
                      0.5 + 1 / 32),
        "w4a8": (call(fused_moe_mxfp4_triton, fp8_activations=True), ref(fp8_activations=True), 0.5 + 1 / 32),
        "bf16 (same weights)": (lambda x, ids, wts: fused_moe_triton(x, bf16[0], bf16[1], ids, wts), ref(), 2.0),
    }


def tile_variants(tabs, m, refs):
    """--tiles: the default W4A16 / W4A8 kernels over a few MoETileConfig around the current decode tile (the
    MOE_TILES rows were chosen for the K-step-32 kernel)."""
    out = {}
    for fp8 in (False, True):
        fam = "w4a8" if fp8 else "mxfp4"
        for bn1, bn2, ns in ((32, 64, 2), (32, 64, 4), (64, 64, 3), (64, 128, 3), (16, 64, 3), (32, 128, 3)):
            cfg = MoETileConfig(16 if m <= 64 else 32, bn1, bn2, 128, 4, ns)
            name = f"{fam} tile {cfg.block_m},{bn1},{bn2},w4,s{ns}"
            out[name] = (lambda x, ids, wts, cfg=cfg, fp8=fp8: fused_moe_mxfp4_triton(
                x, *tabs, ids, wts, config=cfg, fp8_activations=fp8), refs[fp8], 0.5 + 1 / 32)
    return out


def run_row(s, name, launch, ref, bpw, m, data, bw, smoke):
    xs, routes, distinct = data
    row = {"variant": name, "M": m, "experts": distinct}
    t0 = time.time()
    try:
        fam = "w4a8" if name.startswith("w4a8") else ("bf16" if name.startswith("bf16") else "mxfp4")
        cfg = select_config(m, fam)
        row["tile"] = f"{cfg.block_m},{cfg.block_n1},{cfg.block_n2},w{cfg.num_warps},s{cfg.num_stages}"
        if fam != "bf16":
            row["tile"] += f",BK{256 if 'bk256' in name else mxfp4_block_k(fam == 'w4a8')}"
        if " tile " in name:
            row["tile"] = name.split(" tile ")[1] + ",BK128"
        out = launch(xs[0], *routes[0])
        row["rel_err"] = rel_err(out.float(), ref(xs[0], *routes[0]).float())
        if not smoke:
            us = time_graph_us([lambda x=x, r=r: launch(x, *r) for x, r in zip(xs, routes)])
            row["us"] = us
            if m <= 256:
                nbytes = distinct * 3 * s["i"] * s["hid"] * bpw
                row["GB/s"] = nbytes / (us * 1e-6) / 1e9
                row["%BW"] = 100 * row["GB/s"] / bw
            else:
                row["TF/s"] = 2 * m * (s["k"] + 1) * 3 * s["i"] * s["hid"] / (us * 1e-6) / 1e12
    except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["wall_s"] = round(time.time() - t0, 1)
    print("ROW", json.dumps(row), flush=True)
    return row


def fmt(row):
    def num(key, spec):
        return format(row[key], spec) if isinstance(row.get(key), (int, float)) else "-"

    speed = f"{num('%BW', '6.1f')}%BW" if "%BW" in row else (f"{num('TF/s', '6.1f')}TF/s" if "TF/s" in row else "-")
    tail = row.get("error", "")
    return (f"{row['variant']:<28} {row['M']:>5} {row['experts']:>4} {num('us', '10.1f'):>10} {num('GB/s', '8.0f'):>8} "
            f"{speed:>11} {num('rel_err', '9.1e')}  {row.get('tile', '-'):<26} {tail}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mxfp4_ab.json"))
    ap.add_argument("--prefill", action="store_true", help="also M = 8192")
    ap.add_argument("--tiles", action="store_true", help="also a few tiles of the default kernels at M = 32, 128")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    args = ap.parse_args(argv)
    s = SMOKE if args.smoke else FULL
    torch.manual_seed(0)
    bw = float("nan") if args.smoke else measure_copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tabs, bf16 = build_weights(s, dtype)
    rows = []
    sizes = (1, 32) if args.smoke else ((1, 32, 128, 8192) if args.prefill else (1, 32, 128))
    for m in sizes:
        try:
            data = inputs(s, m, dtype)
        except Exception as exc:  # noqa: BLE001
            print(f"inputs M={m} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        table = variants(tabs, bf16)
        if args.tiles and m in (32, 128):
            table.update(tile_variants(tabs, m, {False: table["w4a16"][1], True: table["w4a8"][1]}))
        for name, (launch, ref, bpw) in table.items():
            rows.append(run_row(s, name, launch, ref, bpw, m, data, bw, args.smoke))
            save(args.out, bw, s, rows)  # after every row: a run cut short keeps what it measured
    print(f"\ncopy {bw:.0f} GB/s; H {s['hid']} I {s['i']} E {s['e']}+1 top-{s['k']}+shared; CUDA-graph us per call")
    print(f"{'variant':<28} {'M':>5} {'exp':>4} {'us':>10} {'GB/s':>8} {'speed':>11} {'rel_err':>9}  tile")
    for row in rows:
        print(fmt(row))
    return 0


def save(path, bw, s, rows):
    try:
        with open(path, "w") as f:
            json.dump({"copy_GBps": bw, "shapes": s, "rows": rows}, f, indent=1)
    except OSError as exc:
        print(f"could not write {path}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
