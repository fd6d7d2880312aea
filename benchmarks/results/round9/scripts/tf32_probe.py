"""Session 9 probe: where does the router's "tf32x2w" logit error (1.4e-5 against tf32x3's 2.7e-7, call 2) come from?
Logits of x bf16 [8192, 6144] against W fp32 [128, 6144] by `moe_router_logits_triton` (fused launch, 1 split) at
each precision, relative error against float64, for W as drawn, W rounded to TF32 (its low part zero) and W's TF32
residual alone. Run on the H200: PYTHONPATH=. python3 benchmarks/results/round9/scripts/tf32_probe.py"""
import math

import torch

from ladle.kernels.moe_router import moe_router_logits_triton

g = torch.Generator(device="cuda").manual_seed(0)
T, H, E = 8192, 6144, 128
x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
w = torch.randn(E, H, generator=g, device="cuda") / math.sqrt(H)
w_hi = (w.view(torch.int32) & -8192).view(torch.float32)
cases = {"W": w, "W tf32-exact": w_hi, "W residual only": w - w_hi}
for name, wt in cases.items():
    ref = x.double() @ wt.double().T
    for prec in ("tf32x3", "tf32x2w", "ieee"):
        for splits in (1, 8):
            out = moe_router_logits_triton(x, wt, splits=splits, precision=prec)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"{name:16s} {prec:8s} splits {splits}: rel err {err:.2e}", flush=True)
