"""Device rates for the roofline: copy bandwidth (bytes/s) and GEMM rate (FLOP/s).

Given by flags (`--observe-copy-bandwidth` GB/s, `--observe-gemm-rate` TFLOP/s) they are used as is; otherwise on
CUDA they are measured once: a device-to-device copy of 256 MiB (bandwidth = 2 * bytes / time: each byte is read
and written) and a 4096^3 bf16 matmul (2 * n^3 FLOPs), best of 5 each, timed with CUDA events. On CPU, without
flags, both are absent (None).
"""

from __future__ import annotations

from typing import Any, Optional


def resolve_rates(device: str, copy_gbps: Optional[float], gemm_tflops: Optional[float]) -> dict[str, Any]:
    """{"copy_bytes_per_s", "gemm_flop_per_s", "source"}; source is "flags", "measured", "mixed" or "absent"."""
    bw = float(copy_gbps) * 1e9 if copy_gbps else None
    rate = float(gemm_tflops) * 1e12 if gemm_tflops else None
    source = "flags" if (bw and rate) else "absent"
    if (bw is None or rate is None) and device.startswith("cuda"):
        try:
            m_bw, m_rate = measure_cuda(device)
        except RuntimeError as e:  # e.g. out of memory next to a full KV cache: no roofline rather than no server
            return {"copy_bytes_per_s": bw, "gemm_flop_per_s": rate, "source": f"measurement failed: {e}"[:200]}
        source = "measured" if bw is None and rate is None else "mixed"
        bw, rate = bw or m_bw, rate or m_rate
    elif bw or rate:
        source = "flags"
    return {"copy_bytes_per_s": bw, "gemm_flop_per_s": rate, "source": source}


def measure_cuda(device: str, copy_bytes: int = 256 << 20, n: int = 4096, repeats: int = 5) -> tuple[float, float]:
    """(copy bytes/s, bf16 GEMM FLOP/s) measured on `device` (module docstring)."""
    import torch

    dev = torch.device(device)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        return min(times)

    copy_s = best(lambda: dst.copy_(src))
    gemm_s = best(lambda: torch.matmul(a, b))
    del src, dst, a, b
    torch.cuda.empty_cache()
    return 2.0 * copy_bytes / copy_s, 2.0 * n ** 3 / gemm_s
