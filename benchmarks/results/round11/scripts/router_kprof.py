"""Session 11: per-kernel GPU durations of the MoE router at decode sizes (T = 1, 32, 128; H 6144, E 128, top-4 +
shared): torch logits ("today": x.float() copy, cuBLAS fp32 GEMM, split-K reduce, `_router_topk_kernel`) and the Triton
logits kernel (tf32x2w, ieee) with its split-K epilogue, under torch.profiler (50 calls each, W rotated over 16 copies
so it is not L2-resident). Where the ~20 us per call of round 9-11's A/B goes when the W read needs ~1 us.

    PYTHONPATH=. python3 benchmarks/results/round11/scripts/router_kprof.py
"""
import collections
import math

import torch
from torch.profiler import ProfilerActivity, profile

from ladle.kernels.moe_router import moe_router_kernel, route_from_logits, router_logits

H, E, K = 6144, 128, 4
g = torch.Generator(device="cuda").manual_seed(0)
Ws = [torch.randn(E, H, generator=g, device="cuda") / math.sqrt(H) for _ in range(16)]
b = torch.randn(E, generator=g, device="cuda") * 0.1
for T in (1, 32, 128):
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    fns = {"today": lambda w: route_from_logits(router_logits(x, w)[None], b, K, 2.0, shared_expert=True),
           "tf32x2w": lambda w: moe_router_kernel(x, w, b, K, 2.0, shared_expert=True, precision="tf32x2w"),
           "ieee": lambda w: moe_router_kernel(x, w, b, K, 2.0, shared_expert=True, precision="ieee")}
    for name, fn in fns.items():
        for w in Ws:
            fn(w)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(50):
                fn(Ws[i % 16])
            torch.cuda.synchronize()
        acc = collections.defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                a = acc[ev.name[:70]]
                a[0] += 1
                a[1] += ev.device_time
        tot = sum(v[1] for v in acc.values()) / 50
        print(f"T={T:<4} {name:<8} kernel us per call {tot:6.1f}: " +
              "; ".join(f"{k} {v[1] / v[0]:.1f}us x{v[0] // 50}" for k, v in sorted(acc.items(), key=lambda kv: -kv[1][1])))
