"""GPU suite for the quantized compute kernels at one TP4 rank of MiniMax-M3 (issue 11). A script, not a test.

    PYTHONPATH=. python3 benchmarks/gpu_quant_suite.py --out quant_suite.json [--quick]
    python3 benchmarks/gpu_quant_suite.py --smoke     # CPU: every row's launch and error at tiny shapes, no timing

Kernels: the FP8 w8a8 GEMM (ladle/kernels/fp8_gemm.py; 128-group fp32 scales and MXFP8 E8M0 32-group scales) at the
rank's q|k|v|iq|ik (6144 -> 2688) and o_proj (2048 -> 6144) shapes, against bf16 `torch.matmul` on the same data;
the fused MoE in bf16, FP8 (128-group), MXFP8 (as released), MXFP4 weight-only (W4A16) and MXFP4 with FP8
activations (W4A8, ladle/kernels/fused_moe_mxfp4.py) at M = 1, 32, 128 (decode: GB/s over the bytes of the distinct
experts' weights + scales, target >= 70% of copy bandwidth) and M = 8192 (prefill: TFLOP/s).

`torch._scaled_mm` (cuBLASLt FP8) rows, M >= 128, are a SPEED REFERENCE ONLY: on sm_90 it takes per-tensor or
row-wise scales ([M, 1] activation x [1, N] weight, kernels_and_limits.md §5), not the 1x128 activation x 128-group
weight block scales of ladle's FP8 layers, so it does not compute the same math (its error column is against its
own row-wise reference). Choosing it for large-M dense GEMMs would need a per-output-channel weight scale (lossier
than block-wise) or per-128-group partial products; this row says what that would buy. Its activation quantization
is not timed, as for the Triton rows (both take quantized activations).

SYNTHETIC DATA: random weights (routing roughly uniform over 128 experts + the shared row), random activations.
Method: benchmarks/gpu_bench_common.py (copy bandwidth re-measured; single eager launch and CUDA-graph replay over
input sets >= 4x the L2; error against the op's torch reference in the same run). One device call: about 2-3
minutes with Triton compilation (--quick: M = 1 and 128 only).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import dataclass

if "--smoke" in sys.argv:  # before triton is imported: the CPU interpreter runs the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import rel_err  # noqa: E402
from ladle.kernels.fp8_gemm import fp8_gemm_ref, fp8_gemm_triton  # noqa: E402
from ladle.kernels.fp8_quant import (FP8_DTYPE, FP8_MAX, act_quant_triton, quantize_fp8_rows,  # noqa: E402
                                     quantize_mxfp4, quantize_mxfp8)
from ladle.kernels.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from ladle.kernels.fused_moe_fp8 import fused_moe_fp8_ref, fused_moe_fp8_triton  # noqa: E402
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_ref, fused_moe_mxfp4_triton  # noqa: E402
from ladle.kernels.moe_router import moe_router_triton  # noqa: E402

ROWS: list[dict] = []


@dataclass(frozen=True)
class Shapes:
    """hid, i (per rank), experts, routed top-k, dense GEMM (N, K) pairs, device."""

    hid: int = 6144
    i: int = 768
    e: int = 128
    k_routed: int = 4
    gemms: tuple = ((2688, 6144), (6144, 2048))
    device: str = "cuda"


SMOKE = Shapes(hid=256, i=64, e=8, k_routed=2, gemms=((96, 256), (256, 128)), device="cpu")


class Timer:
    """GPU: gpu_bench_common's eager and CUDA-graph timers, copy bandwidth and bf16 rate. Smoke (CPU): each fn runs
    once and no time is reported."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        if smoke:
            self.bw = self.fl = float("nan")
            return
        from benchmarks.gpu_bench_common import measure_bf16_gemm_tflops, measure_copy_bandwidth

        self.bw, self.fl = measure_copy_bandwidth(), measure_bf16_gemm_tflops()

    def single_us(self, fn) -> float:
        if self.smoke:
            fn()
            return float("nan")
        from benchmarks.gpu_bench_common import time_single_us

        return time_single_us(fn)

    def graph_us(self, fns) -> float:
        if self.smoke:
            return float("nan")
        from benchmarks.gpu_bench_common import time_graph_us

        return time_graph_us(fns)


def add_row(timer, kernel, shape, fns, nbytes, flops, err):
    single_us, graph_us = timer.single_us(fns[0]), timer.graph_us(fns)
    row = {"kernel": kernel, "shape": shape, "single_us": single_us, "graph_us": graph_us,
           "GB/s": nbytes / (graph_us * 1e-6) / 1e9 if nbytes else None,
           "TF/s": flops / (graph_us * 1e-6) / 1e12, "error": err}
    row["%BW"] = 100 * row["GB/s"] / timer.bw if nbytes else None
    row["%bf16"] = 100 * row["TF/s"] / timer.fl
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def per_expert(fn, w):
    """Quantize an expert table [E', N, K] expert by expert with fn -> (values, scales) stacked."""
    pairs = [fn(x) for x in w]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (fp8 e4m3 [R, K], float32 [R, 1]): one scale per row (what torch._scaled_mm takes on sm_90)."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_mm_case(w, xs):
    """torch._scaled_mm with row-wise scales on weight w [N, K] and activations xs: (one fn per x, the first
    call's row-wise float32 reference). A speed reference, not ladle's block-scaled math (module doc)."""
    w_q, w_s = rowwise_fp8(w)
    scale_b = w_s.t().contiguous()  # [1, N]; w_q.t() is the column-major [K, N] operand cuBLASLt wants
    acts = [rowwise_fp8(x) for x in xs]
    fns = [lambda a=a: torch._scaled_mm(a[0], w_q.t(), scale_a=a[1], scale_b=scale_b, out_dtype=torch.bfloat16)
           for a in acts]
    return fns, (acts[0][0].float() * acts[0][1]) @ (w_q.float() * w_s).T


def run_scaled_mm(timer, m, w, xs):
    n, k = w.shape
    fns, ref = scaled_mm_case(w, xs)
    add_row(timer, "scaled_mm rowwise*", f"M={m} {n}x{k}", fns, n * k * (1 + 4 / k), 2 * m * n * k,
            f"rel {rel_err(fns[0](), ref):.1e} (own math)")


# the dense GEMM's weight formats: (row name, quantizer of a [N, K] weight, scale bytes per weight element)
GEMM_FORMATS = (("fp8 gemm 128", quantize_fp8_rows, 4 / 128), ("fp8 gemm mxfp8", quantize_mxfp8, 1 / 32))


def gemm_inputs(shapes, m, n, k):
    """Weight w [N, K] float32 and bf16 activation sets [M, K] (4 sets at decode sizes, 1 at prefill)."""
    w = torch.randn(n, k, device=shapes.device) / k ** 0.5
    return w, [torch.randn(m, k, device=shapes.device, dtype=torch.bfloat16) for _ in range(4 if m <= 128 else 1)]


def run_gemm(timer, shapes, m):
    for n, k in shapes.gemms:
        w, xs = gemm_inputs(shapes, m, n, k)
        wb = w.to(torch.bfloat16)
        add_row(timer, "bf16 matmul", f"M={m} {n}x{k}", [lambda x=x: x @ wb.T for x in xs], n * k * 2,
                2 * m * n * k, "-")
        for name, quantize, scale_bytes in GEMM_FORMATS:
            w_q, w_s = quantize(w)
            acts = [act_quant_triton(x) for x in xs]
            fns = [lambda a=a: fp8_gemm_triton(a[0], a[1], w_q, w_s, torch.bfloat16) for a in acts]
            err = rel_err(fns[0](), fp8_gemm_ref(acts[0][0], acts[0][1], w_q, w_s, torch.float32))
            add_row(timer, name, f"M={m} {n}x{k}", fns, n * k * (1 + scale_bytes), 2 * m * n * k, f"rel {err:.1e}")
        if m >= 128 or timer.smoke:
            run_scaled_mm(timer, m, w, xs)


def moe_inputs(shapes, m):
    """bf16 activation sets [M, hid] (4 at decode sizes, 1 at prefill), their routes (topk_ids, topk_weights) from
    the router with the shared expert appended, and the number of distinct experts of the first set."""
    dev, hid = shapes.device, shapes.hid
    gate = torch.randn(shapes.e, hid, device=dev) * 0.02
    xs = [torch.randn(m, hid, device=dev, dtype=torch.bfloat16) for _ in range(4 if m <= 128 else 1)]
    routes = [moe_router_triton(x, gate, torch.zeros(shapes.e, device=dev), shapes.k_routed, 2.0, shared_expert=True)
              for x in xs]
    return xs, routes, int(torch.unique(routes[0][0]).numel())


def run_moe(timer, shapes, m, tables):
    hid = shapes.hid
    xs, routes, distinct = moe_inputs(shapes, m)
    flops = 2 * m * (shapes.k_routed + 1) * 3 * shapes.i * hid
    for name, (launch, ref, args, bytes_per_weight) in tables.items():
        fns = [lambda x=x, r=r: launch(x, *args, r[0], r[1]) for x, r in zip(xs, routes)]
        err = rel_err(fns[0]().float(), ref(xs[0], *args, *routes[0], compute_dtype=torch.float32).float())
        nbytes = 0 if m > 256 else distinct * 3 * shapes.i * hid * bytes_per_weight
        add_row(timer, name, f"M={m} experts={distinct}", fns, nbytes, flops, f"rel {err:.1e}")


def moe_tables(shapes):
    dev = shapes.device
    w13 = torch.randn(shapes.e + 1, 2 * shapes.i, shapes.hid, device=dev) * 0.02
    w2 = torch.randn(shapes.e + 1, shapes.hid, shapes.i, device=dev) * 0.02
    b13, b2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    f8 = (*per_expert(quantize_fp8_rows, w13), *per_expert(quantize_fp8_rows, w2))
    mx8 = (*per_expert(quantize_mxfp8, w13), *per_expert(quantize_mxfp8, w2))
    mx4 = (*per_expert(quantize_mxfp4, w13), *per_expert(quantize_mxfp4, w2))

    def bf16_ref(x, a, b, ids, w, compute_dtype):
        return fused_moe_ref(x, a, b, ids, w, compute_dtype=compute_dtype)

    return {"fused_moe bf16": (fused_moe_triton, bf16_ref, (b13, b2), 2),
            "fused_moe fp8": (fused_moe_fp8_triton, fused_moe_fp8_ref, f8, 1 + 4 / 128),
            "fused_moe mxfp8": (fused_moe_fp8_triton, fused_moe_fp8_ref, mx8, 1 + 1 / 32),
            "fused_moe mxfp4": (fused_moe_mxfp4_triton, fused_moe_mxfp4_ref, mx4, 0.5 + 1 / 32),
            "fused_moe w4a8": (functools.partial(fused_moe_mxfp4_triton, fp8_activations=True),
                               functools.partial(fused_moe_mxfp4_ref, fp8_activations=True), mx4, 0.5 + 1 / 32)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="quant_suite.json")
    ap.add_argument("--quick", action="store_true", help="M = 1 and 128 only")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    args = ap.parse_args(argv)
    shapes, timer = (SMOKE if args.smoke else Shapes()), Timer(args.smoke)
    print(f"copy {timer.bw:.0f} GB/s, bf16 GEMM {timer.fl:.0f} TFLOP/s", flush=True)
    sizes = (1, 128) if args.quick or args.smoke else (1, 32, 128, 8192)
    tables = moe_tables(shapes)
    failed = 0
    for m in sizes:
        for fn, extra in ((run_gemm, ()), (run_moe, (tables,))):
            try:
                fn(timer, shapes, m, *extra)
            except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
                failed += 1
                print(f"{fn.__name__} M={m} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"copy_GBps": timer.bw, "bf16_TFps": timer.fl, "rows": ROWS, "smoke": args.smoke}, f, indent=1)
    for r in ROWS:
        print(f"{r['kernel']:<18} {r['shape']:<26} {r['graph_us']:>9.1f} us  "
              f"{(r['%BW'] or 0):>5.1f}%BW  {r['%bf16']:>5.1f}%bf16  {r['error']}")
    print("* speed reference only: row-wise scales, not ladle's block-scaled math (module doc)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
