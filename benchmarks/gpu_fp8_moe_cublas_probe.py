"""Probe: FP8 block-scaled MoE GEMMs at prefill sizes as one torch._scaled_mm (cuBLASLt) call per expert, against the
Triton FP8 MoE GEMMs (ladle/kernels/fused_moe_fp8.py) on the same routing. A script, not a test:

    PYTHONPATH=. python3 benchmarks/gpu_fp8_moe_cublas_probe.py --out fp8_moe_cublas_probe.json   # H200, ~1-2 min

Why: the Triton FP8 GEMMs wait for every wgmma before the per-128 promotion (fused_moe_fp8.py "K loop"), so at
prefill they run at ~630 (GEMM 1) and ~340 (GEMM 2) TFLOP/s on one TP4 rank of M3 (session 12 profile), while
cuBLASLt's block-wise recipe reached ~1,000 TFLOP/s on the dense linears (round 7). This probe asks whether one
cuBLAS call per expert (rows of one expert contiguous, as the align plan sorts them) beats the grouped Triton kernel
at the rows per expert of an 8K prefill (~256 per routed expert) and of a 32K-token served step (~1,024), the shared
expert (row E) taking every token. Shapes: H 6144, I 768, 128 routed experts top-4 + shared. SYNTHETIC DATA: random
weights x 0.02 quantized per 128 group (`quantize_fp8_rows`), random activations, near-uniform routing
(benchmarks/gpu_quant_suite.py `moe_inputs`).

Rows (per M): "triton g1" / "triton g2" = fp8_moe_gemm1 / fp8_moe_gemm2 on the op's plan (CUDA-graph us);
"cublas g1" / "cublas g2" = the per-expert loop of torch._scaled_mm over the same rows (1x128 activation scales,
weight scales as 1x128 rows: `fp8_gemm_scaled_mm`), timed in a CUDA graph (GPU time) and eagerly
(`time_single_us`: what a prefill step would pay, host launches included, 129 calls per GEMM; session 12's call 2
timed it with its own event loop, without do_bench's L2 flush); each checked against fp8_gemm_ref on
one routed expert and the shared one (rel err). The per-expert GEMM 1 output is the raw gate/up product (no
swigluoai, no routed weight): those would be one elementwise pass and the combine, outside these rows.
Also prints whether torch._scaled_mm accepts 128x128 weight scales and what torch._scaled_grouped_mm says.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import rel_err, time_graph_us, time_single_us  # noqa: E402
from benchmarks.gpu_fp8_moe_prefill_ab import fp8_tables  # noqa: E402
from benchmarks.gpu_quant_suite import Shapes, moe_inputs  # noqa: E402
from ladle.kernels.fp8_gemm import fp8_gemm_ref, fp8_gemm_scaled_mm  # noqa: E402
from ladle.kernels.fp8_quant import act_quant, act_quant_ref  # noqa: E402
from ladle.kernels.fused_moe import SWIGLU_ALPHA, SWIGLU_LIMIT  # noqa: E402
from ladle.kernels.fused_moe_fp8 import fp8_moe_gemm1, fp8_moe_gemm2, fp8_moe_plan  # noqa: E402


def triton_gemms_us(x, ids, wts, tables) -> tuple[float, float]:
    """CUDA-graph us of fp8_moe_gemm1 / fp8_moe_gemm2 on the served family's plan (block-uniform scales) for x and
    the routes ids / wts."""
    w13, s13, w2, s2 = tables
    plan = fp8_moe_plan(x, w13, s13, w2, s2, ids, wts, block_uniform=True)
    a_q, a_s = act_quant(x, use_triton=True)
    g1 = functools.partial(fp8_moe_gemm1, plan, a_q, a_s, w13, s13, SWIGLU_ALPHA, SWIGLU_LIMIT, x.dtype)
    i_q, i_s = act_quant(g1(), use_triton=True)
    g2 = functools.partial(fp8_moe_gemm2, plan, i_q, i_s, w2, s2, wts)
    return time_graph_us([g1]), time_graph_us([g2])


def per_expert_operands(x, ids, num_experts, k_dim, gen):
    """(segments) per expert e with rows: (e, a_q [M_e, K] fp8, a_s [M_e, K/128] M-major) for GEMM 1 from x's
    rows routed to e (M_e padded to a multiple of 4 with zero rows), and for GEMM 2 random activations [M_e, k_dim]."""
    seg1, seg2 = [], []
    for e in range(num_experts):
        tok = (ids == e).any(dim=1).nonzero().flatten()
        if tok.numel() == 0:
            continue
        m = tok.numel()
        mp = (m + 3) // 4 * 4
        xe = torch.zeros(mp, x.shape[1], device=x.device, dtype=x.dtype)
        xe[:m] = x[tok]
        seg1.append((e, *act_quant_ref(xe, m_major_scale=True)))
        ie = torch.randn(mp, k_dim, device=x.device, generator=gen).to(torch.bfloat16)
        seg2.append((e, *act_quant_ref(ie, m_major_scale=True)))
    return seg1, seg2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8_moe_cublas_probe.json")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--shared-split", type=int, nargs="*", default=[],
                    help="sizes M for the shared-expert split: Triton on the routed columns only (k = 4) and the "
                         "shared expert (row E, every token) as two dense torch._scaled_mm calls")
    args = ap.parse_args(argv)
    if args.shared_split:
        return shared_split(args.shared_split, args.out)
    shapes = Shapes()
    gen = torch.Generator(device="cuda").manual_seed(1)
    w13, s13, w2, s2 = fp8_tables(shapes)
    s13t = [s13[e].t().contiguous().t() for e in range(shapes.e + 1)]  # N-minor views: scale_b without a copy
    s2t = [s2[e].t().contiguous().t() for e in range(shapes.e + 1)]
    rows = []
    # 128x128 weight scales and the grouped entry point: do they exist here?
    for label, fn in (
            ("scaled_mm 128x128 scale_b [K/128, N/128]", lambda a, s: torch._scaled_mm(
                a, w13[0].t(), s, s13[0][::128].t().contiguous(), out_dtype=torch.bfloat16)),
            ("scaled_mm 128x128 scale_b [N/128, K/128].t()", lambda a, s: torch._scaled_mm(
                a, w13[0].t(), s, s13[0][::128].contiguous().t(), out_dtype=torch.bfloat16))):
        x = torch.randn(256, shapes.hid, device="cuda", generator=gen).to(torch.bfloat16)
        a_q, a_s = act_quant_ref(x, m_major_scale=True)
        try:
            y = fn(a_q, a_s)
            err = rel_err(y.float(), fp8_gemm_ref(a_q, a_s, w13[0], s13[0], torch.float32))
            print(f"{label}: runs, rel_err {err:.2e}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a probe
            print(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
    print("torch._scaled_grouped_mm:", hasattr(torch, "_scaled_grouped_mm"), flush=True)

    for m in args.sizes:
        xs, routes, distinct = moe_inputs(shapes, m)
        x, (ids, wts) = xs[0], routes[0]
        slots = m * (shapes.k_routed + 1)
        f1, f2 = 2 * slots * 2 * shapes.i * shapes.hid, 2 * slots * shapes.i * shapes.hid
        t1, t2 = triton_gemms_us(x, ids, wts, (w13, s13, w2, s2))
        seg1, seg2 = per_expert_operands(x, ids, shapes.e + 1, shapes.i, gen)
        counts = [s[1].shape[0] for s in seg1]

        def cublas1():
            return [fp8_gemm_scaled_mm(q, s, w13[e], s13t[e], torch.bfloat16) for e, q, s in seg1]

        def cublas2():
            return [fp8_gemm_scaled_mm(q, s, w2[e], s2t[e], torch.bfloat16) for e, q, s in seg2]

        ys1, ys2 = cublas1(), cublas2()
        errs = []
        for j in (0, len(seg1) - 1):  # one routed expert and the shared one (row E)
            e, q, s = seg1[j]
            errs.append(rel_err(ys1[j].float(), fp8_gemm_ref(q, s, w13[e], s13[e], torch.float32)))
            e, q, s = seg2[j]
            errs.append(rel_err(ys2[j].float(), fp8_gemm_ref(q, s, w2[e], s2[e], torch.float32)))
        del ys1, ys2
        c1g, c2g = time_graph_us([cublas1], replays=10), time_graph_us([cublas2], replays=10)
        c1e, c2e = time_single_us(cublas1), time_single_us(cublas2)
        row = dict(M=m, experts=len(seg1), distinct=distinct, rows_routed_median=sorted(counts[:-1])[len(counts) // 2],
                   rows_shared=counts[-1], triton_g1_us=t1, triton_g2_us=t2, cublas_g1_graph_us=c1g,
                   cublas_g2_graph_us=c2g, cublas_g1_eager_us=c1e, cublas_g2_eager_us=c2e,
                   tf_triton_g1=f1 / t1 / 1e6, tf_triton_g2=f2 / t2 / 1e6, tf_cublas_g1=f1 / c1g / 1e6,
                   tf_cublas_g2=f2 / c2g / 1e6, rel_err_max=max(errs))
        rows.append(row)
        print("ROW", json.dumps(row), flush=True)
        del seg1, seg2
        torch.cuda.empty_cache()
    print(f"\n{'M':>6} {'rows/exp':>8} {'triton g1':>10} {'cublas g1 graph/eager':>22} {'triton g2':>10} "
          f"{'cublas g2 graph/eager':>22} {'g1 x':>6} {'g2 x':>6} {'rel_err':>8}")
    for r in rows:
        print(f"{r['M']:>6} {r['rows_routed_median']:>8} {r['triton_g1_us']:>10.1f} "
              f"{r['cublas_g1_graph_us']:>10.1f} / {r['cublas_g1_eager_us']:>9.1f} {r['triton_g2_us']:>10.1f} "
              f"{r['cublas_g2_graph_us']:>10.1f} / {r['cublas_g2_eager_us']:>9.1f} "
              f"{r['triton_g1_us'] / r['cublas_g1_graph_us']:>6.2f} {r['triton_g2_us'] / r['cublas_g2_graph_us']:>6.2f}"
              f" {r['rel_err_max']:>8.1e}")
        print(f"{'':>6} TFLOP/s: triton g1 {r['tf_triton_g1']:.0f}, cublas g1 {r['tf_cublas_g1']:.0f}, "
              f"triton g2 {r['tf_triton_g2']:.0f}, cublas g2 {r['tf_cublas_g2']:.0f}")
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)
    return 0


def shared_split(sizes, out_path) -> int:
    """--shared-split: per M, the Triton GEMMs with all 5 columns (served) and with the 4 routed columns only, and the
    shared expert's two dense GEMMs through fp8_gemm_scaled_mm (GEMM 1 fp32 out, GEMM 2 bf16 out), CUDA-graph us."""
    shapes = Shapes()
    w13, s13, w2, s2 = fp8_tables(shapes)
    rows = []
    for m in sizes:
        xs, routes, _ = moe_inputs(shapes, m)
        x, (ids, wts) = xs[0], routes[0]
        row = {"M": m}
        for label, (i, w) in (("k5", (ids, wts)), ("k4", (ids[:, :-1].contiguous(), wts[:, :-1].contiguous()))):
            row[f"triton_{label}_g1_us"], row[f"triton_{label}_g2_us"] = triton_gemms_us(x, i, w, (w13, s13, w2, s2))
        e = shapes.e
        a_q, a_s = act_quant(x, use_triton=True, m_major_scale=True)
        h = torch.randn(m, shapes.i, device="cuda").to(torch.bfloat16)
        h_q, h_s = act_quant(h, use_triton=True, m_major_scale=True)
        s13e, s2e = s13[e].t().contiguous().t(), s2[e].t().contiguous().t()
        c1 = lambda: fp8_gemm_scaled_mm(a_q, a_s, w13[e], s13e, torch.float32)  # noqa: E731
        c2 = lambda: fp8_gemm_scaled_mm(h_q, h_s, w2[e], s2e, torch.bfloat16)  # noqa: E731
        row["err_shared_g1"] = rel_err(c1(), fp8_gemm_ref(a_q, a_s, w13[e], s13[e], torch.float32))
        row["err_shared_g2"] = rel_err(c2().float(), fp8_gemm_ref(h_q, h_s, w2[e], s2[e], torch.float32))
        row["cublas_shared_g1_us"], row["cublas_shared_g2_us"] = time_graph_us([c1]), time_graph_us([c2])
        k5 = row["triton_k5_g1_us"] + row["triton_k5_g2_us"]
        split = sum(row[k] for k in ("triton_k4_g1_us", "triton_k4_g2_us", "cublas_shared_g1_us",
                                     "cublas_shared_g2_us"))
        row["gemms_k5_us"], row["gemms_split_us"], row["speedup"] = k5, split, k5 / split
        rows.append(row)
        print("ROW", json.dumps(row), flush=True)
    print(f"\n{'M':>6} {'k5 g1':>8} {'k5 g2':>8} {'k4 g1':>8} {'k4 g2':>8} {'sh g1':>8} {'sh g2':>8} {'k5 sum':>8} "
          f"{'split':>8} {'x':>6}")
    for r in rows:
        print(f"{r['M']:>6} {r['triton_k5_g1_us']:>8.1f} {r['triton_k5_g2_us']:>8.1f} {r['triton_k4_g1_us']:>8.1f} "
              f"{r['triton_k4_g2_us']:>8.1f} {r['cublas_shared_g1_us']:>8.1f} {r['cublas_shared_g2_us']:>8.1f} "
              f"{r['gemms_k5_us']:>8.1f} {r['gemms_split_us']:>8.1f} {r['speedup']:>6.3f}   errs "
              f"{r['err_shared_g1']:.1e} {r['err_shared_g2']:.1e}")
    with open(out_path, "w") as f:
        json.dump({"shared_split": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
