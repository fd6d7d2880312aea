"""GPU suite for the quantized compute kernels at one TP4 rank of MiniMax-M3 (issue 11). A script, not a test.

    PYTHONPATH=. python3 benchmarks/gpu_quant_suite.py --out quant_suite.json [--quick]

Kernels: the FP8 w8a8 GEMM (ladle/kernels/fp8_gemm.py; 128-group fp32 scales and MXFP8 E8M0 32-group scales) at the
rank's q|k|v|iq|ik (6144 -> 2688) and o_proj (2048 -> 6144) shapes, against bf16 `torch.matmul` on the same data;
the fused MoE in bf16, FP8 (128-group), MXFP8 (as released) and MXFP4 (weight-only) at M = 1, 32, 128 (decode:
GB/s over the bytes of the distinct experts' weights + scales, target >= 70% of copy bandwidth) and M = 8192
(prefill: TFLOP/s). `torch._scaled_mm` for large-M dense GEMMs is not measured yet (it needs row-wise scales on
sm_90; kernels_and_limits.md §5): add it here before choosing it.

SYNTHETIC DATA: random weights (routing roughly uniform over 128 experts + the shared row), random activations.
Method: benchmarks/gpu_bench_common.py (copy bandwidth re-measured; single eager launch and CUDA-graph replay over
input sets >= 4x the L2; error against the op's torch reference in the same run).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import (measure_bf16_gemm_tflops, measure_copy_bandwidth, rel_err,  # noqa: E402
                                         time_graph_us, time_single_us)
from ladle.kernels.fp8_gemm import fp8_gemm_ref, fp8_gemm_triton  # noqa: E402
from ladle.kernels.fp8_quant import act_quant_triton, quantize_fp8_rows, quantize_mxfp4, quantize_mxfp8  # noqa: E402
from ladle.kernels.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from ladle.kernels.fused_moe_fp8 import fused_moe_fp8_ref, fused_moe_fp8_triton  # noqa: E402
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_ref, fused_moe_mxfp4_triton  # noqa: E402
from ladle.kernels.moe_router import moe_router_triton  # noqa: E402

HID, I, E, K_ROUTED = 6144, 768, 128, 4
ROWS: list[dict] = []


def add_row(kernel, shape, single_us, graph_us, nbytes, flops, err, bw, fl):
    row = {"kernel": kernel, "shape": shape, "single_us": single_us, "graph_us": graph_us,
           "GB/s": nbytes / (graph_us * 1e-6) / 1e9 if nbytes else None,
           "TF/s": flops / (graph_us * 1e-6) / 1e12, "error": err}
    row["%BW"] = 100 * row["GB/s"] / bw if nbytes else None
    row["%bf16"] = 100 * row["TF/s"] / fl
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def per_expert(fn, w):
    """Quantize an expert table [E', N, K] expert by expert with fn -> (values, scales) stacked."""
    pairs = [fn(x) for x in w]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def run_gemm(m, bw, fl):
    for n, k in ((2688, 6144), (6144, 2048)):
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4 if m <= 128 else 1)]
        wb = w.to(torch.bfloat16)
        add_row("bf16 matmul", f"M={m} {n}x{k}", time_single_us(lambda: xs[0] @ wb.T),
                time_graph_us([lambda x=x: x @ wb.T for x in xs]), n * k * 2, 2 * m * n * k, "-", bw, fl)
        for name, quantize, scale_bytes in (("fp8 gemm 128", quantize_fp8_rows, 4 / 128),
                                            ("fp8 gemm mxfp8", quantize_mxfp8, 1 / 32)):
            w_q, w_s = quantize(w)
            acts = [act_quant_triton(x) for x in xs]
            fns = [lambda a=a: fp8_gemm_triton(a[0], a[1], w_q, w_s, torch.bfloat16) for a in acts]
            err = rel_err(fns[0](), fp8_gemm_ref(acts[0][0], acts[0][1], w_q, w_s, torch.float32))
            add_row(name, f"M={m} {n}x{k}", time_single_us(fns[0]), time_graph_us(fns),
                    n * k * (1 + scale_bytes), 2 * m * n * k, f"rel {err:.1e}", bw, fl)


def run_moe(m, tables, bw, fl):
    gate = torch.randn(E, HID, device="cuda") * 0.02
    xs = [torch.randn(m, HID, device="cuda", dtype=torch.bfloat16) for _ in range(4 if m <= 128 else 1)]
    routes = [moe_router_triton(x, gate, torch.zeros(E, device="cuda"), K_ROUTED, 2.0, shared_expert=True)
              for x in xs]
    distinct = int(torch.unique(routes[0][0]).numel())
    flops = 2 * m * (K_ROUTED + 1) * 3 * I * HID
    for name, (launch, ref, args, bytes_per_weight) in tables.items():
        fns = [lambda x=x, r=r: launch(x, *args, r[0], r[1]) for x, r in zip(xs, routes)]
        err = rel_err(fns[0]().float(), ref(xs[0], *args, *routes[0], compute_dtype=torch.float32).float())
        nbytes = 0 if m > 256 else distinct * 3 * I * HID * bytes_per_weight
        add_row(name, f"M={m} experts={distinct}", time_single_us(fns[0]), time_graph_us(fns), nbytes, flops,
                f"rel {err:.1e}", bw, fl)


def moe_tables():
    w13 = torch.randn(E + 1, 2 * I, HID, device="cuda") * 0.02
    w2 = torch.randn(E + 1, HID, I, device="cuda") * 0.02
    b13, b2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    f8 = (*per_expert(quantize_fp8_rows, w13), *per_expert(quantize_fp8_rows, w2))
    mx8 = (*per_expert(quantize_mxfp8, w13), *per_expert(quantize_mxfp8, w2))
    mx4 = (*per_expert(quantize_mxfp4, w13), *per_expert(quantize_mxfp4, w2))

    def bf16_ref(x, a, b, ids, w, compute_dtype):
        return fused_moe_ref(x, a, b, ids, w, compute_dtype=compute_dtype)

    return {"fused_moe bf16": (fused_moe_triton, bf16_ref, (b13, b2), 2),
            "fused_moe fp8": (fused_moe_fp8_triton, fused_moe_fp8_ref, f8, 1 + 4 / 128),
            "fused_moe mxfp8": (fused_moe_fp8_triton, fused_moe_fp8_ref, mx8, 1 + 1 / 32),
            "fused_moe mxfp4": (fused_moe_mxfp4_triton, fused_moe_mxfp4_ref, mx4, 0.5 + 1 / 32)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="quant_suite.json")
    ap.add_argument("--quick", action="store_true", help="M = 1 and 128 only")
    args = ap.parse_args()
    bw, fl = measure_copy_bandwidth(), measure_bf16_gemm_tflops()
    print(f"copy {bw:.0f} GB/s, bf16 GEMM {fl:.0f} TFLOP/s", flush=True)
    sizes = (1, 128) if args.quick else (1, 32, 128, 8192)
    tables = moe_tables()
    for m in sizes:
        for fn, extra in ((run_gemm, ()), (run_moe, (tables,))):
            try:
                fn(m, *extra, bw, fl)
            except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
                print(f"{fn.__name__} M={m} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"copy_GBps": bw, "bf16_TFps": fl, "rows": ROWS}, f, indent=1)
    for r in ROWS:
        print(f"{r['kernel']:<18} {r['shape']:<26} {r['graph_us']:>9.1f} us  "
              f"{(r['%BW'] or 0):>5.1f}%BW  {r['%bf16']:>5.1f}%bf16  {r['error']}")


if __name__ == "__main__":
    main()
