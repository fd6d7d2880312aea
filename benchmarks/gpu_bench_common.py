"""Timing and ceiling helpers for the GPU benchmark scripts (benchmarks/gpu_*.py).

Method (see /work/.library/device/METHOD.md): CUDA events, warm-up first, medians; bandwidth kernels rotate over
input sets totalling >= 4x the L2 so repeated calls do not measure the cache; every kernel is timed both as a
single eager launch (`triton.testing.do_bench`, median) and as a CUDA-graph replay of R back-to-back calls (one
per input set), whose per-call time excludes CPU launch overhead.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import triton

L2_BYTES = 50 * 2**20  # H200: 50 MB (torch reports ~60 MB incl. reserved); rotation targets >= 4x this


def sync() -> None:
    torch.cuda.synchronize()


def time_single_us(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median eager time of one call in microseconds (do_bench flushes L2 between calls)."""
    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_graph_us(fns: list[Callable[[], object]], replays: int = 20) -> float:
    """Per-call time in microseconds of a CUDA graph that runs every fn in `fns` once (R = len(fns) calls per
    replay). Median over `replays` event-timed replays, after warm-up."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    sync()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    del graph
    return statistics.median(times)


def measure_copy_bandwidth(num_bytes: int = 4 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written (METHOD.md ceiling)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    us = time_single_us(lambda: dst.copy_(src), rep_ms=400)
    del src, dst
    return 2 * num_bytes / (us * 1e-6) / 1e9


def measure_bf16_gemm_tflops(n: int = 8192) -> float:
    """bf16 GEMM rate (torch.matmul / cuBLAS) on random data, TFLOP/s."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    us = time_single_us(lambda: a @ b, rep_ms=400)
    return 2 * n**3 / (us * 1e-6) / 1e12


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()
