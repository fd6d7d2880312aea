"""FP8 dense GEMM at decode sizes: split-K A/B on the GPU (issue 11, the decode step's dense GEMMs). A script, not a
test.

    PYTHONPATH=. python3 benchmarks/gpu_fp8_gemm_decode_ab.py --out fp8_gemm_decode_ab.json
    python3 benchmarks/gpu_fp8_gemm_decode_ab.py --smoke      # CPU: Triton interpreter, tiny shapes, checks only

What: `fp8_gemm_triton` (128-group fp32 weight scales) at M = 1, 8, 32, 64 on the TP4-rank dense shapes
(N, K) = (2688, 6144) (q|k|v|index projections) and (6144, 2048) (o_proj), at today's decode tile with split_k = 1
(the kernel before the split), 2, 4, 8 and the launcher's default (`default_split_k`); round 10 adds a few wider or
deeper tiles at the default split ("tile BM,BN,warps,stages") and torch._scaled_mm's block-wise recipe on the same
quantized operands ("scaled_mm": M-major activation scales, rows padded to a multiple of 4 as fp8_linear pads them,
the first M rows kept; GEMM only, the activation quantization is outside every row). Session 11: "scaled_mm nm" and
"default nm" take the weight scales N-minor (strides (1, N)) as the FP8 linears now store them: scaled_mm without
its per-call transpose copy, the Triton kernel reading a column of scales per K step. Each config: one call checked
against `fp8_gemm_ref` in float64 on the same fresh random data (relative error; expected ~1e-6, float32 summation
order), then the CUDA-graph replay time (gpu_bench_common.time_graph_us) over R weight copies totalling >= 4x the L2
(METHOD's rule, so the weight bytes come from HBM), and % of the copy bandwidth measured in this run over the bytes
the call must read (fp8 weight + fp32 scales + activations).
Output: one ROW line per config, then a table; JSON with every row.
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
from ladle.kernels.fp8_gemm import (SCALED_MM_ROW_MULTIPLE, GemmTileConfig, default_split_k, fp8_gemm_ref,  # noqa
                                    fp8_gemm_scaled_mm, fp8_gemm_triton, select_gemm_config)
from ladle.kernels.fp8_quant import act_quant_triton, quantize_fp8_rows  # noqa: E402

SHAPES = ((2688, 6144), (6144, 2048))
SMOKE_SHAPES = ((72, 1024),)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="fp8_gemm_decode_ab.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--time-budget-s", type=float, default=90.0)
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    t0 = time.monotonic()
    bw = float("nan") if args.smoke else measure_copy_bandwidth()
    rows = []
    for n, k in (SMOKE_SHAPES if args.smoke else SHAPES):
        w = torch.randn(n, k, device=dev) / k ** 0.5
        copies = 1 if args.smoke else max(4, math.ceil(4 * L2_BYTES / (n * k)))
        weights = [quantize_fp8_rows(w * (1 + 0.01 * i)) for i in range(copies)]
        weights_nm = [(wq, ws.t().contiguous().t()) for wq, ws in weights]  # the linears' N-minor scales (session 11)
        for m in ((1, 16) if args.smoke else (1, 8, 32, 64)):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16 if not args.smoke else torch.float32)
            a_q, a_s = act_quant_triton(x)
            cfg = select_gemm_config(m, "fp8")
            default = default_split_k(m, n, -(-k // 128), cfg, torch.device(dev))
            base_us = None
            a_qp, a_sp = act_quant_triton(x, m_major_scale=True, pad_rows_to=SCALED_MM_ROW_MULTIPLE)
            extra = [GemmTileConfig(16, 64, 4, 4), GemmTileConfig(16, 32, 4, 6), GemmTileConfig(16, 128, 4, 4),
                     GemmTileConfig(16, 64, 8, 4)]
            nm_rows = ("default nm",) + (("scaled_mm", "scaled_mm nm") if not args.smoke else ())
            for split in (1, 2, 4, 8, None) + tuple(extra) + nm_rows:
                if time.monotonic() - t0 > args.time_budget_s:
                    break
                tile_cfg = split if isinstance(split, GemmTileConfig) else None
                use = tile_cfg or cfg
                if isinstance(split, str):
                    name = split
                elif tile_cfg:
                    name = "tile " + ",".join(map(str, (use.block_m, use.block_n, use.num_warps, use.num_stages)))
                else:
                    name = f"split {split}" if split else f"default ({default})"
                ksplit = split if isinstance(split, int) else None
                row = {"m": m, "n": n, "k": k, "variant": name,
                       "split_k": ksplit or default_split_k(m, n, -(-k // 128), use, torch.device(dev)),
                       "tile": [use.block_m, use.block_n, use.num_warps, use.num_stages]}

                def call(wq, ws, dt, ksplit=ksplit, tile_cfg=tile_cfg, split=split):
                    if split in ("scaled_mm", "scaled_mm nm"):
                        return fp8_gemm_scaled_mm(a_qp, a_sp, wq, ws, dt)[:m]
                    return fp8_gemm_triton(a_q, a_s, wq, ws, dt, config=tile_cfg, split_k=ksplit)
                wset = weights_nm if split in ("default nm", "scaled_mm nm") else weights
                try:
                    w_q, w_s = wset[0]
                    y = call(w_q, w_s, torch.float32)
                    row["rel_err"] = rel_err(y, fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float64, torch.float64))
                    if not args.smoke:
                        fns = [lambda wq=wq, ws=ws, call=call: call(wq, ws, torch.bfloat16) for wq, ws in wset]
                        us = time_graph_us(fns)
                        nbytes = n * k + n * (k // 128) * 4 + m * k
                        row.update(us=us, pct_bw=100 * nbytes / (us * 1e-6) / 1e9 / bw)
                        if split == 1:
                            base_us = us
                        row["speedup"] = base_us / us if base_us else float("nan")
                except Exception as exc:  # noqa: BLE001 - one failing config must not hide the others
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                rows.append(row)
                print("ROW " + json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"copy_gb_s": bw, "rows": rows}, f, indent=1)
    print(f"\ncopy {bw:.0f} GB/s; fp8_gemm_triton (128-group scales), CUDA-graph us per call over weights >= 4x L2")
    print(f"{'M':>4} {'N x K':>11} {'variant':>16} {'tile':>14} {'us':>8} {'%BW':>6} {'vs split 1':>10} {'rel_err':>9}")
    for r in rows:
        print(f"{r['m']:>4} {r['n']:>5}x{r['k']:<5} {r['variant']:>16} {str(tuple(r['tile'])):>14} "
              f"{r.get('us', float('nan')):8.1f} {r.get('pct_bw', float('nan')):6.1f} "
              f"{r.get('speedup', float('nan')):10.2f} {r.get('rel_err', float('nan')):9.1e} {r.get('error', '')}")


if __name__ == "__main__":
    main()
