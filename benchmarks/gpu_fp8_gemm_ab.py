"""FP8 dense GEMM A/B at one TP4 rank of MiniMax-M3: the Triton kernel vs the "scaled_mm" path (torch._scaled_mm's
block-wise 1x128 x 1x128 recipe, ladle/kernels/fp8_gemm.py), to place SCALED_MM_MIN_TOKENS. A script, not a test:

    PYTHONPATH=. python3 benchmarks/gpu_fp8_gemm_ab.py --out fp8_gemm_ab.json [--time-budget-s 80]   # H200, ~1 min
    python3 benchmarks/gpu_fp8_gemm_ab.py --smoke     # CPU: Triton interpreter, tiny shapes, errors only, no timing

What is timed: the whole op as a layer calls it, `fp8_linear(x, w_q, w_scale, use_triton=True)` on bf16 x [M, K]
(activation quantization, the scale layouts and the GEMM), with `fp8_gemm.SCALED_MM_MIN_TOKENS` set so the wanted
path runs (0: scaled_mm, huge: Triton); the dispatch record of the check call names the op that executed. Plus, at
M = 8192, "scaled_mm gemm only": torch._scaled_mm alone on operands prepared outside the timed call (the difference
to the whole op is the act_quant + layout cost), and two correctness-only rows of the path's function
`fp8_gemm_scaled_mm` outside the op's rule: M = 2050 (M % 4 != 0, which the rule sends to Triton today) and K = 384
(3 scale groups). READ: if "raw M%4" has a small rel err, the rule's M % 4 condition can go.

Method: per (shape, M), one check call against `fp8_gemm_ref` in float32 on the same quantized activations (same
bytes as the op's), relative error printed per row (bf16 output: ~1e-3 expected); then CUDA-graph replay time per
call (gpu_bench_common.time_graph_us) over R weight copies (M = 128: R copies totalling >= 4x the L2, at most 16; else
R = 1). TFLOP/s = 2 M N K / time; speed-up = time of the path the current threshold picks at that M / this row's.
Shapes (N, K) of one TP4 rank (ladle make-checkpoint minimax-m3 --preset tp4-rank; the 60-layer proxy's 126 dense
GEMM calls per step): qkv of MSA layers (2560, 6144) x57, qkv of the 3 dense-attention layers (2304, 6144), o_proj
(6144, 2048) x60, dense-MLP gate|up (6144, 6144) and down (6144, 3072) x3 each, and gpu_quant_suite's qkv
(2688, 6144). M = 128, 1024, 2048, 8192. SYNTHETIC DATA (randn weights / sqrt(K), randn activations). Every row runs
in its own try/except; a row that cannot run (e.g. scaled_mm unsupported) prints why.
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
from benchmarks.gpu_bench_common import L2_BYTES, rel_err, time_graph_us  # noqa: E402
from ladle.kernels import fp8_gemm  # noqa: E402
from ladle.kernels.fp8_gemm import (OP, OP_SCALED_MM, fp8_gemm_ref, fp8_gemm_scaled_mm, fp8_linear,  # noqa: E402
                                    scaled_mm_ineligible)
from ladle.kernels.fp8_quant import act_quant_triton, quantize_fp8_rows  # noqa: E402
from ladle.observe import dispatch  # noqa: E402

FULL = {"shapes": {"qkv msa": (2560, 6144), "qkv dense": (2304, 6144), "o_proj": (6144, 2048),
                   "mlp gate|up": (6144, 6144), "mlp down": (6144, 3072), "qkv suite": (2688, 6144)},
        "sizes": (128, 1024, 2048, 8192), "device": "cuda", "dtype": torch.bfloat16}
SMOKE = {"shapes": {"tiny a": (96, 256), "tiny b": (256, 128)}, "sizes": (8, 16), "device": "cpu",
         "dtype": torch.float32}
NEVER = 1 << 62  # SCALED_MM_MIN_TOKENS value that keeps the Triton path at every M


def make_case(cfg, m, n, k, copies):
    """bf16 x [m, k]; `copies` quantized weights (w_q [n, k] fp8, w_scale [n, k/128] fp32); float32 reference."""
    dev = cfg["device"]
    x = torch.randn(m, k, device=dev).to(cfg["dtype"])
    weights = [quantize_fp8_rows(torch.randn(n, k, device=dev) / k ** 0.5) for _ in range(copies)]
    a_q, a_s = act_quant_triton(x)  # the op's bytes (act_quant_ref gives the same)
    return x, weights, fp8_gemm_ref(a_q, a_s, *weights[0], torch.float32)


def executed_op() -> str:
    """The fp8 GEMM op that executed in the last (reset) dispatch window."""
    ops = dispatch.snapshot()["ops"]
    done = [op for op in (OP_SCALED_MM, OP) if any(b["executed"] for b in ops.get(op, {}).get("buckets", {}).values())]
    return "+".join(done) or "reference"


def op_row(name, threshold, case, smoke):
    """fp8_linear with SCALED_MM_MIN_TOKENS = threshold: check call (error, executed op), then graph time."""
    x, weights, ref = case
    row = {}
    if name == "scaled_mm":
        reason = scaled_mm_ineligible(x, *weights[0])
        if reason is not None:
            return {"error": f"scaled_mm not eligible: {reason}"}
    saved = fp8_gemm.SCALED_MM_MIN_TOKENS
    fp8_gemm.SCALED_MM_MIN_TOKENS = threshold
    try:
        dispatch.reset()
        out = fp8_linear(x, *weights[0], use_triton=True)
        row["executed"] = executed_op()
        row["rel_err"] = rel_err(out.float(), ref)
        if not smoke:
            row["us"] = time_graph_us([lambda w=w: fp8_linear(x, *w, use_triton=True) for w in weights])
    finally:
        fp8_gemm.SCALED_MM_MIN_TOKENS = saved
    return row


def gemm_only_row(case, smoke):
    """torch._scaled_mm alone, operands (M-major activation scales, [K/128, N] weight scales) prepared beforehand."""
    x, weights, ref = case
    a_q, a_s = act_quant_triton(x, m_major_scale=True)
    prepared = [(w_q.t(), w_s.t().contiguous()) for w_q, w_s in weights]
    call = [lambda b=b, s=s: torch._scaled_mm(a_q, b, a_s, s, out_dtype=x.dtype) for b, s in prepared]
    row = {"executed": "torch._scaled_mm", "rel_err": rel_err(call[0]().float(), ref)}
    if not smoke:
        row["us"] = time_graph_us(call)
    return row


def raw_row(cfg, m, n, k):
    """Correctness only: `fp8_gemm_scaled_mm` (no eligibility rule) at a shape the rule may refuse."""
    x = torch.randn(m, k, device=cfg["device"]).to(cfg["dtype"])
    w_q, w_s = quantize_fp8_rows(torch.randn(n, k, device=cfg["device"]) / k ** 0.5)
    a_q, a_s = act_quant_triton(x, m_major_scale=True)
    out = fp8_gemm_scaled_mm(a_q, a_s, w_q, w_s, torch.float32)
    return {"executed": "fp8_gemm_scaled_mm", "rel_err": rel_err(out, fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32))}


def record(rows, variant, shape, m, n, k, build):
    """Run one row (`build()` returns its fields or raises), print it as a ROW line and append it."""
    t0 = time.time()
    row = {"variant": variant, "shape": shape, "N": n, "K": k, "M": m}
    try:
        row.update(build())
    except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    if isinstance(row.get("us"), float):
        row["TF/s"] = 2 * m * n * k / (row["us"] * 1e-6) / 1e12
    row["wall_s"] = round(time.time() - t0, 1)
    print("ROW", json.dumps(row), flush=True)
    rows.append(row)
    return row


def add_speedups(rows):
    """speed-up vs the path SCALED_MM_MIN_TOKENS picks today at that (shape, M) (Triton below it)."""
    by_key = {(r["variant"], r["shape"], r["M"]): r for r in rows}
    for r in rows:
        default = "scaled_mm" if r["M"] >= fp8_gemm.SCALED_MM_MIN_TOKENS else "triton"
        base = by_key.get((default, r["shape"], r["M"]), {})
        if isinstance(base.get("us"), float) and isinstance(r.get("us"), float):
            r["speedup"] = base["us"] / r["us"]


def fmt(row):
    def num(key, spec):
        return format(row[key], spec) if isinstance(row.get(key), (int, float)) else "-"

    return (f"{row['variant']:<20} {row['shape']:<12} {row['N']:>5}x{row['K']:<5} {row['M']:>5} {num('us', '9.1f'):>9} "
            f"{num('TF/s', '7.1f'):>7} {num('rel_err', '9.1e'):>9} {num('speedup', '6.2f'):>6}  "
            f"{row.get('executed', '-'):<20} {row.get('error', '')}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "fp8_gemm_ab.json"))
    ap.add_argument("--time-budget-s", type=float, default=80.0, help="no new (shape, M) starts after this")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    args = ap.parse_args(argv)
    cfg = SMOKE if args.smoke else FULL
    torch.manual_seed(0)
    start, rows = time.time(), []
    for m in cfg["sizes"]:
        for shape, (n, k) in cfg["shapes"].items():
            if time.time() - start > args.time_budget_s:
                rows.append({"variant": "*", "shape": shape, "N": n, "K": k, "M": m, "error": "skipped: time budget"})
                continue
            copies = 1 if m > 256 or args.smoke else max(1, min(16, math.ceil(4 * L2_BYTES / (n * k * 1.03))))
            try:
                case = make_case(cfg, m, n, k, copies)
            except Exception as exc:  # noqa: BLE001
                print(f"inputs {shape} M={m} failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            record(rows, "triton", shape, m, n, k, lambda: op_row("triton", NEVER, case, args.smoke))
            record(rows, "scaled_mm", shape, m, n, k, lambda: op_row("scaled_mm", 0, case, args.smoke))
            if m == max(cfg["sizes"]):
                record(rows, "scaled_mm gemm only", shape, m, n, k, lambda: gemm_only_row(case, args.smoke))
            del case
            save(args.out, rows)  # after every (shape, M): a run cut short keeps what it measured
    n, k = next(iter(cfg["shapes"].values()))
    m_ragged, m_k384 = (6, 8) if args.smoke else (2050, 1024)
    record(rows, "raw M%4", "ragged M", m_ragged, n, k, lambda: raw_row(cfg, m_ragged, n, k))
    record(rows, "raw K=384", "3 groups", m_k384, 256, 384, lambda: raw_row(cfg, m_k384, 256, 384))
    add_speedups(rows)
    save(args.out, rows)
    print(f"\nSCALED_MM_MIN_TOKENS = {fp8_gemm.SCALED_MM_MIN_TOKENS}; CUDA-graph us per call of the whole op "
          f"(act_quant + layouts + GEMM); speed-up vs the path picked today; rel_err vs fp8_gemm_ref float32")
    print(f"{'variant':<20} {'shape':<12} {'N x K':>11} {'M':>5} {'us':>9} {'TF/s':>7} {'rel_err':>9} {'x':>6}  "
          f"{'executed':<20} note")
    for row in rows:
        print(fmt(row))
    return 0


def save(path, rows):
    try:
        with open(path, "w") as f:
            json.dump({"scaled_mm_min_tokens": fp8_gemm.SCALED_MM_MIN_TOKENS, "rows": rows}, f, indent=1)
    except OSError as exc:
        print(f"could not write {path}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
