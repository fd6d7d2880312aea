"""FP8 block-scaled fused MoE at prefill sizes: the round-3 K loop vs the options of ladle/kernels/fused_moe_fp8.py
(`Fp8MoEOptions`: gate+up as one interleaved [BK, 2*BN1] dot, 2 K steps per iteration, a register cap, one weight
scale per 128-row block) at a few tiles. A script, not a test:

    PYTHONPATH=. python3 benchmarks/gpu_fp8_moe_prefill_ab.py --out fp8_moe_prefill_ab.json   # H200, ~60-100 s
    python3 benchmarks/gpu_fp8_moe_prefill_ab.py --smoke     # CPU: Triton interpreter, tiny shapes, errors only
    (--mxfp8: also the MXFP8 tables at M = 8192: round-3, gu, gu regs168; about 6 more kernels to compile)
    (--only "gu block w8,gu block w8 f32 slots,gu block,gu block bf16 slots": just those variants, at every M:
     the slot-dtype A/B in a few kernels)

Shapes: one TP4 rank of MiniMax-M3 (H 6144, I 768, 128 routed experts + the shared row 128, top-4 + shared = 5 slots
per token), 128-group fp32 weight scales (`quantize_fp8_rows`, as the FP8 checkpoints load); M = 8192 and 2048 tokens
(prefill) and M = 32 (decode guard: the decode tile with each option). SYNTHETIC DATA: random weights x 0.02, bf16
activations, near-uniform routing from the router on a random gate (benchmarks/gpu_quant_suite.py `moe_inputs`).
Method (benchmarks/gpu_bench_common.py): per variant one call checked against `fused_moe_fp8_ref` in float32 on the
same inputs (relative error of the [M, H] output, printed per row), then CUDA-graph replay medians of the whole op
(`fused_moe_fp8_triton`: act quant, GEMM 1, act quant, GEMM 2, combine) and of GEMM 1, GEMM 2 and the combine alone
(`fp8_moe_gemm1` / `fp8_moe_gemm2` on the op's own plan and quantized inputs, `fp8_moe_combine` on GEMM 2's slot
rows; "comb us"; with "aligned" GEMM 2 the aligned rows, gathered by `aligned_positions`, which "comb us"
includes). Slot rows: "bf16 slots" rows (since round 10 also the default from 257 tokens; "f32 slots" rows
force round 9's float32) store GEMM 2's per-slot rows in bf16 (the SLOT_DTYPE A/B of ladle/kernels/fused_moe.py:
half the 8192 x 5 x 6144 x 4 B = 1.0 GB written by GEMM 2 and read by the combine at M = 8192), on the served tile
and options ("gu block w8": MOE_TILES / FP8_MOE_OPTIONS "fp8_block")
and on the decode tile; after the table the script prints each bf16-slot row against its float32-slot twin (same
M, tile and options): op, GEMM 2 and combine speed-ups and both rel_errs. TFLOP/s over the routed rows
(M x 5 slots): GEMM 1 2*M*5*2I*H, GEMM 2 2*M*5*I*H, the op their sum. Speed-up: against "round-3" (the loop and
prefill tile before the options: two dots per K step, per-column scales); "table" is what the launcher picks for
per-row scales (the quant method picks the "gu block w8" row for block-uniform ones). Round 3
(benchmarks/results/round3/fp8_tiles.txt): the op at M = 8192, that prefill tile, 4133 us (281 TF/s).
READ: bf16 slots are worth adopting (flip SLOT_DTYPE) when the op is faster at both prefill sizes and the rel_err
grows by no more than the slot rounding (each slot rounded to bf16 once: <= 2^-8 relative per slot, the size of the
bf16 output's own rounding). A variant is a candidate when its rel_err matches round-3's (~1e-2 or less: bf16
intermediate and output, fp8 activations) and its op time is lower at both prefill sizes; the script prints the tile
and options of the best one (for MOE_TILES["fp8"] and FP8_MOE_OPTIONS). "block" rows hold only for block-uniform
scales (128x128-block checkpoints, as this data; not MXFP8). A variant that fails to compile or is wrong prints a row
saying so; the others still run. --smoke's rel_err is about 1e-2 for every row, round-3's included: the interpreter
truncates the bf16 intermediate and output where the reference rounds to nearest (ladle/kernels/_common.py
`round_to`); the H200 measured 4.4e-3 at M = 8192 (round 3).
Compilation dominates the wall time: about 30 kernels; --time-budget-s (80) skips the variants left when it runs out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported: the CPU interpreter runs the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import rel_err  # noqa: E402
from benchmarks.gpu_quant_suite import Shapes, moe_inputs, per_expert  # noqa: E402
from ladle.kernels.fp8_quant import act_quant, quantize_fp8_rows, quantize_mxfp8  # noqa: E402
from ladle.kernels.fused_moe import (SWIGLU_ALPHA, SWIGLU_LIMIT, MoETileConfig, select_config,  # noqa: E402
                                     slot_dtype_for)
from ladle.kernels.fused_moe_fp8 import (GLUON_OP, Fp8MoEOptions, fp8_moe_combine, fp8_moe_gemm1,  # noqa: E402
                                         fp8_moe_gemm2, fp8_moe_plan, fused_moe_fp8_ref, fused_moe_fp8_triton,
                                         select_options)
from ladle.observe import dispatch  # noqa: E402

SMOKE = Shapes(hid=256, i=128, e=8, k_routed=2, device="cpu")  # I = 128: the block-scale rows run too
T3 = MoETileConfig(64, 64, 128, 64, 4, 3)  # today's prefill tile at 3 stages: the smem of 3 CTAs per SM
W8 = MoETileConfig(64, 64, 128, 64, 8, 3)  # 8 warps at BM 64: with block scales ~120 registers, 2 CTAs per SM
GU_BLOCK = Fp8MoEOptions(gu_dot=True, block_scales=True)
# (name, tile or None = the table's for M, options or None = the table's[, slot dtype: None = SLOT_DTYPE]), in the
# order the time budget keeps them


def GLUON(n_tiles):  # noqa: N802 - reads as the table's other option constants
    """Served "fp8_block" options with GEMM 2's aligned rows from the Gluon kernel over n_tiles column tiles."""
    return Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=n_tiles, gemm2_aligned=True, gemm2_gluon=True)


ROUND3 = Fp8MoEOptions()  # the round-3 loop (two dots per K step, per-column scales): the A/B's baseline
R3_PREFILL = MoETileConfig(64, 64, 128, 64, 4, 4)  # its prefill tile
PREFILL = (
    ("round-3", R3_PREFILL, ROUND3),
    ("table", None, None),
    ("gu block w8", W8, GU_BLOCK),  # round 9's served prefill tile and options (block-uniform scales)
    ("gu block w8 f32 slots", W8, GU_BLOCK, torch.float32),  # round 9's slot rows (float32), the twin of the above
    # round 10: GEMM 2 programs over 2 / 4 column tiles (Fp8MoEOptions.gemm2_n_tiles; GEMM 1 unchanged)
    ("gu block w8 g2n2", W8, Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=2)),
    ("gu block w8 g2n4", W8, Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=4)),
    ("gu block w8 s4 g2n4", MoETileConfig(64, 64, 128, 64, 8, 4), Fp8MoEOptions(gu_dot=True, block_scales=True,
                                                                                 gemm2_n_tiles=4)),  # served, r10
    # session 9: wider tiles (GEMM 2 has only K/128 = 6 steps at one TP4 rank; GEMM 1 a 256-wide gate+up dot)
    ("gu block w8 bn1 128", MoETileConfig(64, 128, 128, 64, 8, 3), GU_BLOCK),
    ("gu w8 bn2 256", MoETileConfig(64, 64, 256, 64, 8, 3), Fp8MoEOptions(gu_dot=True)),
    ("gu block bm128 w8 s4", MoETileConfig(128, 64, 128, 64, 8, 4), GU_BLOCK),
    ("gu", T3, Fp8MoEOptions(gu_dot=True)),
    ("block w8", W8, Fp8MoEOptions(block_scales=True)),
    ("gu block w8 s4", MoETileConfig(64, 64, 128, 64, 8, 4), GU_BLOCK),
    ("gu regs168", T3, Fp8MoEOptions(gu_dot=True, max_regs=168)),
    ("gu unroll2 block w8", MoETileConfig(64, 64, 128, 64, 8, 2), Fp8MoEOptions(gu_dot=True, k_unroll=2,
                                                                                 block_scales=True)),
    ("gu block bm128 w8", MoETileConfig(128, 64, 128, 64, 8, 3), GU_BLOCK),
    # session 12: a 32K-token served prefill step has ~1,024 rows per routed expert (8K: ~256): taller row tiles
    ("gu block bm128 w8 s4 g2n4", MoETileConfig(128, 64, 128, 64, 8, 4),
     Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=4)),
    ("gu block bm128 w8 s3 g2n2", MoETileConfig(128, 64, 128, 64, 8, 3),
     Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=2)),
    ("gu block w8 s4 g2n8", MoETileConfig(64, 64, 128, 64, 8, 4),
     Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=8)),
    ("gu block bm128 bn1 128 w8 s3", MoETileConfig(128, 128, 128, 64, 8, 3), GU_BLOCK),
    # session 15: GEMM 2 into aligned rows (hoisted weight pointers, no slot / routed-weight loads in its epilogue;
    # the combine gathers and weights; calls 2-3 of round 15 also ran BM 64 under a BM 128 plan: no gain, removed)
    ("gu block w8 s4 g2n4 aligned", MoETileConfig(64, 64, 128, 64, 8, 4),
     Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=4, gemm2_aligned=True)),
    ("gu block bm128 w8 s4 g2n4 aligned", MoETileConfig(128, 64, 128, 64, 8, 4),
     Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=4, gemm2_aligned=True)),
    ("gu block w8 s4 g2n8 aligned", MoETileConfig(64, 64, 128, 64, 8, 4),
     Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=8, gemm2_aligned=True)),
    ("gu block w8 s3 g2n4 aligned", MoETileConfig(64, 64, 128, 64, 8, 3),
     Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=4, gemm2_aligned=True)),
    # session 16: the aligned rows from the Gluon GEMM 2 (TMA ring of the tile's stages, one wgmma in flight during
    # the promotion; 4 warps per 64 rows whatever the tile's num_warps)
    ("gu block w8 s4 g2n4 gluon", MoETileConfig(64, 64, 128, 64, 8, 4), GLUON(4)),
    ("gu block w8 s3 g2n4 gluon", MoETileConfig(64, 64, 128, 64, 8, 3), GLUON(4)),
    ("gu block w8 s4 g2n8 gluon", MoETileConfig(64, 64, 128, 64, 8, 4), GLUON(8)),
    ("gu block w8 s4 g2n2 gluon", MoETileConfig(64, 64, 128, 64, 8, 4), GLUON(2)),
    ("gu block bm128 w8 s4 g2n4 gluon", MoETileConfig(128, 64, 128, 64, 8, 4), GLUON(4)),
    ("gu block bm128 w8 s3 g2n4 gluon", MoETileConfig(128, 64, 128, 64, 8, 3), GLUON(4)),
    # (round 16 also ran, and did not keep: a Gluon GEMM 1, "gluon both ..." in call 2, commit 8842ee4; the Gluon
    # GEMM 2 at 64-row tiles under the 128-row plan, "... gluon g2bm64" in call 4, commit a1d4b30)
)
MX5 = MoETileConfig(64, 64, 128, 64, 4, 5)  # MXFP8's prefill row with BN1 64 (gate+up: a 128-wide dot)
MXFP8 = (  # --mxfp8, M = 8192 only: E8M0 scales per 32 (block_scales does not apply)
    ("round-3", None, ROUND3),
    ("gu", MX5, Fp8MoEOptions(gu_dot=True)),
    ("gu regs168", MX5, Fp8MoEOptions(gu_dot=True, max_regs=168)),
)
DECODE = (  # the decode tile (BN1 32, BN2 64) with each option
    ("round-3", None, ROUND3),
    ("gu", None, Fp8MoEOptions(gu_dot=True)),
    ("gu block", None, GU_BLOCK),
    ("gu block bf16 slots", None, GU_BLOCK, torch.bfloat16),  # decode sizes keep float32 rows by default
    ("gu block g2n2", None, Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=2)),
    ("gu block g2n4", None, Fp8MoEOptions(gu_dot=True, block_scales=True, gemm2_n_tiles=4)),
)


def fp8_tables(shapes, quantize=quantize_fp8_rows):
    """w13 / w2 float weights (x 0.02, as gpu_quant_suite.moe_tables) quantized expert by expert (128-group FP8, or
    MXFP8 with quantize_mxfp8): (w13 [E+1, 2I, H] fp8, its scales, w2 [E+1, H, I] fp8, its scales)."""
    dev, g = shapes.device, torch.Generator(device=shapes.device).manual_seed(0)
    out = []
    for rows, cols in ((2 * shapes.i, shapes.hid), (shapes.hid, shapes.i)):
        w = torch.randn(shapes.e + 1, rows, cols, device=dev, generator=g) * 0.02
        out += per_expert(quantize, w)
        del w
    return out


def timers(smoke):
    if smoke:
        return None
    from benchmarks.gpu_bench_common import time_graph_us

    return time_graph_us


def run_variant(name, cfg, opt, m, data, tabs, shapes, graph_us, slot=None):
    """One table row: error against the reference, then the op / GEMM 1 / GEMM 2 / combine times (module doc;
    graph_us None: the smoke run, error only). slot: GEMM 2's slot dtype (None: SLOT_DTYPE)."""
    xs, routes, ref = data
    slots = m * (shapes.k_routed + 1)
    family = "mxfp8" if tabs[1].dtype == torch.uint8 else "fp8"
    tile = cfg or select_config(m, family)
    options = opt or select_options(m, family)
    row = {"variant": name, "M": m, "format": family,
           "tile": f"{tile.block_m},{tile.block_n1},{tile.block_n2},w{tile.num_warps},s{tile.num_stages}",
           "options": f"gu={int(options.gu_dot)} unroll={options.k_unroll} regs={options.max_regs or '-'} "
                      f"block={int(options.block_scales)}" + _slots_label(slot, xs[0].dtype, m)
                      + (f" n2={options.gemm2_n_tiles}" if options.gemm2_n_tiles > 1 else "")
                      + (" aligned" if options.gemm2_aligned else "") + (" gluon" if options.gemm2_gluon else "")}
    t0 = time.time()
    try:
        out = fused_moe_fp8_triton(xs[0], *tabs, *routes[0], config=cfg, options=opt, slot_dtype=slot)
        row["rel_err"] = rel_err(out.float(), ref.float())
        if graph_us is None:
            return finish(row, t0)
        row["us"] = graph_us([lambda x=x, r=r: fused_moe_fp8_triton(x, *tabs, *r, config=cfg, options=opt,
                                                                     slot_dtype=slot)
                              for x, r in zip(xs, routes)])
        g1, g2, comb = [], [], []
        for x, (ids, wts) in zip(xs, routes):
            plan = fp8_moe_plan(x, *tabs, ids, wts, cfg, opt, slot_dtype=slot)
            a_q, a_s = act_quant(x, use_triton=True)
            gemm1 = functools.partial(fp8_moe_gemm1, plan, a_q, a_s, tabs[0], tabs[1], SWIGLU_ALPHA, SWIGLU_LIMIT,
                                      x.dtype)
            i_q, i_s = act_quant(gemm1(), use_triton=True)
            g1.append(gemm1)
            g2.append(lambda p=plan, a=i_q, s=i_s, w=wts: fp8_moe_gemm2(p, a, s, tabs[2], tabs[3], w))
            comb.append(functools.partial(fp8_moe_combine, plan, g2[-1](), wts, x.dtype))
        row["us_g1"], row["us_g2"], row["us_comb"] = graph_us(g1), graph_us(g2), graph_us(comb)
        if options.gemm2_gluon:  # the Gluon rows against the Triton loop's aligned rows on the same plan and inputs
            p = plan._replace(opt=dataclasses.replace(options, gemm2_gluon=False))
            got, want = g2[-1]().float(), fp8_moe_gemm2(p, i_q, i_s, tabs[2], tabs[3], wts).float()
            n = int(plan.npp.item())
            row["gluon_vs_triton_max_rel"] = float(((got[:n] - want[:n]).abs().max() / want[:n].abs().max()))
            buckets = dispatch.snapshot()["ops"][GLUON_OP]["buckets"].values()
            row["gluon_executed"] = sum(b["executed"] for b in buckets)
        f1, f2 = 2 * slots * 2 * shapes.i * shapes.hid, 2 * slots * shapes.i * shapes.hid
        for key, us, flops in (("TF/s", "us", f1 + f2), ("TF/s_g1", "us_g1", f1), ("TF/s_g2", "us_g2", f2)):
            row[key] = flops / (row[us] * 1e-6) / 1e12
    except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return finish(row, t0)


def finish(row, t0):
    row["wall_s"] = round(time.time() - t0, 1)
    print("ROW", json.dumps(row), flush=True)
    return row


def fmt(row, base):
    def num(key, spec):
        return format(row[key], spec) if isinstance(row.get(key), (int, float)) else "-"

    def speed(key):
        ok = base and isinstance(row.get(key), float) and isinstance(base.get(key), float) and row[key] > 0
        return f"{base[key] / row[key]:.2f}x" if ok else "-"

    return (f"{row['variant']:<24} {row.get('format', '-'):<6} {row['M']:>5} {row['tile']:<18} {row['options']:<41} "
            f"{num('us', '9.1f'):>9} "
            f"{num('TF/s', '6.0f'):>6} {num('us_g1', '9.1f'):>9} {num('TF/s_g1', '6.0f'):>6} {num('us_g2', '9.1f'):>9} "
            f"{num('TF/s_g2', '6.0f'):>6} {num('us_comb', '9.1f'):>9} {num('rel_err', '8.1e'):>8} {speed('us'):>6} "
            f"{speed('us_g1'):>6} {speed('us_g2'):>6} {row.get('error', '')}")


def today(rows, row):
    """The "round-3" row of row's M and weight format (the speed-up base), or None."""
    return next((r for r in rows if (r["M"], r.get("format"), r["variant"]) == (row["M"], row.get("format"), "round-3")),
                None)


def _slots_label(slot, x_dtype, m):
    """" slots=bf16" when GEMM 2's slot rows are bf16 at this M (given, or the default `slot_dtype_for` picks)."""
    return " slots=bf16" if slot_dtype_for(x_dtype, m, slot) == torch.bfloat16 else ""


def slot_pairs(rows):
    """Each bf16-slot row against its float32-slot twin (same format, M, tile and options): the A/B of SLOT_DTYPE."""
    for r in rows:
        if not r.get("options", "").endswith(" slots=bf16"):
            continue
        key = (r.get("format"), r["M"], r["tile"], r["options"][:-len(" slots=bf16")])
        twin = next((b for b in rows if (b.get("format"), b["M"], b["tile"], b.get("options")) == key), None)
        if twin is None or not all(isinstance(x.get("rel_err"), float) for x in (r, twin)):
            continue
        line = (f"{r['variant']!r} M={r['M']} vs {twin['variant']!r}: rel_err {r['rel_err']:.2e} vs "
                f"{twin['rel_err']:.2e}")
        for key_us, label in (("us", "op"), ("us_g2", "gemm2"), ("us_comb", "combine")):
            if isinstance(r.get(key_us), float) and isinstance(twin.get(key_us), float):
                line += f"; {label} {r[key_us]:.1f} vs {twin[key_us]:.1f} us ({twin[key_us] / r[key_us]:.2f}x)"
        print("SLOTS", line)


def best_rows(rows):
    """The fastest correct prefill variant per (format, M) (rel_err within 1.5x of today's): its tile and options."""
    for fam, m in sorted({(r.get("format"), r["M"]) for r in rows if r["M"] > 256 and r.get("format") != "-"}):
        at_m = [r for r in rows if (r.get("format"), r["M"]) == (fam, m) and isinstance(r.get("us"), float)]
        base = today(rows, {"M": m, "format": fam})
        ok = [r for r in at_m if base and r["rel_err"] <= 1.5 * base["rel_err"] + 1e-6]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            print(f"{fam} M={m}: best {b['variant']!r} {b['us']:.1f} us ({base['us'] / b['us']:.2f}x today): tile "
                  f"{b['tile']}, options {b['options']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_moe_prefill_ab.json"))
    ap.add_argument("--time-budget-s", type=float, default=80.0,
                    help="skip the variants left after this wall time (not in --smoke)")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    ap.add_argument("--mxfp8", action="store_true", help="also MXFP8 tables (E8M0 scales) at M = 8192 (or 12)")
    ap.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 2048],
                    help="prefill sizes M (tokens); 32768 is a served 32K-token step (not in --smoke)")
    args = ap.parse_args(argv)
    start = time.time()
    shapes = SMOKE if args.smoke else Shapes()
    torch.manual_seed(0)
    graph_us, rows, fp8 = timers(args.smoke), [], fp8_tables(shapes)
    big = 12 if args.smoke else args.sizes[0]
    sizes = [(big, PREFILL, fp8)] + ([] if args.smoke else [(m, PREFILL, fp8) for m in args.sizes[1:]])
    sizes.append((4 if args.smoke else 32, DECODE, fp8))
    if args.mxfp8:
        sizes.append((big, MXFP8, fp8_tables(shapes, quantize_mxfp8)))
    for m, variants, tabs in sizes:
        xs, routes, _ = moe_inputs(shapes, m)
        ref = fused_moe_fp8_ref(xs[0], *tabs, *routes[0], compute_dtype=torch.float32)
        for name, cfg, opt, *slot in variants:
            if args.only and name not in args.only.split(","):
                continue
            if time.time() - start > args.time_budget_s and not args.smoke:
                rows.append({"variant": name, "M": m, "format": "-", "tile": "-", "options": "-",
                             "error": "skipped: time budget"})
                continue
            rows.append(run_variant(name, cfg, opt, m, (xs, routes, ref), tabs, shapes, graph_us, *slot))
            save(args.out, shapes, rows)
    print(f"\nH {shapes.hid} I {shapes.i} E {shapes.e}+1 top-{shapes.k_routed}+shared; CUDA-graph us "
          f"per call; speed-up vs today (op, gemm1, gemm2); wall {time.time() - start:.0f} s")
    print(f"{'variant':<24} {'format':<6} {'M':>5} {'tile BM,BN1,BN2':<18} {'options':<41} {'op us':>9} {'TF/s':>6} "
          f"{'gemm1 us':>9} "
          f"{'TF/s':>6} {'gemm2 us':>9} {'TF/s':>6} {'comb us':>9} {'rel_err':>8} {'op':>6} {'g1':>6} {'g2':>6}")
    for row in rows:
        print(fmt(row, today(rows, row)))
    best_rows(rows)
    slot_pairs(rows)
    for row in rows:
        if "gluon_vs_triton_max_rel" in row:
            print(f"gluon {row['variant']} M={row['M']}: GEMM 2 rows against the Triton loop's, max |diff| / max "
                  f"|rows| {row['gluon_vs_triton_max_rel']:.2e}; gluon launches recorded so far "
                  f"{row['gluon_executed']}")
    return 1 if any("error" in r and not r["error"].startswith("skipped") for r in rows) else 0


def save(path, shapes, rows):
    try:
        with open(path, "w") as f:
            json.dump({"shapes": shapes.__dict__, "rows": rows}, f, indent=1)
    except OSError as exc:
        print(f"could not write {path}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
