"""Session 6, call 8: tile sweep of `_moe_combine_kernel` at the proxy's prefill and decode shapes (k = 5 slots,
H = 6144, fp32 slots -> bf16), each config checked bitwise against the default config's output; median of 20 timed
calls after 3 warm-ups (CUDA events), GB/s over the bytes read + written."""
import itertools, statistics, sys
import torch
from ladle.kernels import fused_moe as fm

H, K = 6144, 5
rows = []
for T in (8192, 32):
    slots = torch.randn(T * K, H, device="cuda", dtype=torch.float32)
    ref = fm.moe_combine_triton(slots, T, K, torch.bfloat16)
    nbytes = slots.numel() * 4 + T * H * 2
    for bt, bh, nw in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (4, 8)):
        def call():
            out = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
            fm._moe_combine_kernel[(-(-T // bt), -(-H // bh))](slots, out, T, H, K=K, BT=bt, BH=bh, num_warps=nw)
            return out
        try:
            out = call()
            ok = torch.equal(out, ref)
            for _ in range(3):
                call()
            times = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); call(); b.record(); b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            us = statistics.median(times)
            rows.append((T, bt, bh, nw, us, nbytes / us / 1e3, ok))
        except Exception as e:  # noqa: BLE001
            rows.append((T, bt, bh, nw, float("nan"), 0.0, f"fail {type(e).__name__}"))
default = {T: (4, 1024) if T > 256 else (1, 1024) for T in (8192, 32)}  # the tiles as run (before the sweep)
for T in (8192, 32):
    sub = sorted((r for r in rows if r[0] == T), key=lambda r: r[4])
    print(f"T={T} default tile {default[T]} x 4 warps")
    for r in sub[:8] + [r for r in sub if (r[1], r[2]) == default[T] and r[3] == 4]:
        print(f"  BT={r[1]} BH={r[2]} warps={r[3]}: {r[4]:8.1f} us {r[5]:7.0f} GB/s exact={r[6]}")
