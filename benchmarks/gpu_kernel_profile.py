"""Per-kernel GPU time of a callable (e.g. one engine step), from the torch profiler's CUDA activity records.

`profile_kernels(fn, steps)` runs `fn` once untraced, then `steps` times under torch.profiler (CPU + CUDA activities)
and sums each kernel's device time by name. Kernels launched from a CUDA-graph replay are reported by CUPTI like
eager ones, so a graph-replayed decode step shows its kernels too. Returns the table rows (per step: calls, us,
share of the summed kernel time) and the totals; `format_profile` prints them. A helper for the GPU benchmark
scripts, not a test.
"""

from __future__ import annotations

from collections import defaultdict

import torch

# ladle's own Triton kernels, by exact name (substrings collide: torch's `StoreWithCast` copies contain "store", the
# dense decode's `_decode_merge_kernel` contains "_merge_kernel")
LADLE_KERNELS = {
    "fused_moe (ladle)": ("_gemm1_kernel", "_gemm2_kernel", "_fp8_gemm1_kernel", "_fp8_gemm2_kernel",
                          "_fp8_gemm2_gluon_kernel",
                          "_mxfp4_gemm1_kernel", "_mxfp4_gemm2_kernel", "_decode_gemm1_kernel", "_decode_gemm2_kernel",
                          "_moe_align_single_kernel", "_moe_align_count_kernel", "_moe_align_scatter_kernel",
                          "_router_logits_kernel", "_router_topk_kernel", "_router_small_t_kernel",
                          "_moe_combine_kernel"),
    "fp8 dense gemm + act quant (ladle)": ("_fp8_gemm_kernel", "_act_quant_kernel"),
    "msa attention/indexer": ("_sparse_attn_kernel", "_sparse_attn_tile_kernel", "_merge_kernel", "_index_score_kernel",
                              "_index_topk_kernel"),
    "dense attention": ("_prefill_kernel", "_decode_split_kernel", "_decode_merge_kernel"),
    "norm / rope": ("_rmsnorm_kernel", "_head_norm_rope_kernel", "_rope_kernel", "_qk_norm_rope_store_kernel"),
    "kv store": ("_store_kernel",),
    "sampling": ("_race_kernel",),
}
# everything else by substring of the lower-cased symbol; first match wins
GROUPS = [
    ("gemm (cuBLAS/CUTLASS)", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk")),
    ("torch elementwise/reduce/copy", ("elementwise", "reduce", "copy", "cat", "index", "fill", "gather", "scatter",
                                       "sort", "unique", "arange", "store")),
]


def kernel_group(name: str) -> str:
    """Group of a kernel symbol: ladle's kernels by exact name, then cuBLAS/CUTLASS and torch by substring."""
    for group, names in LADLE_KERNELS.items():
        if name in names:
            return group
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def _device_time_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        v = getattr(evt, attr, None)
        if v:
            return float(v)
    return 0.0


def profile_kernels(fn, steps: int = 3) -> dict:
    """Run fn() once (warm), then `steps` times under the profiler. Returns {"steps", "kernels_per_step",
    "kernel_us_per_step", "rows": [{name, group, calls, us, share}], "groups": {group: us}} (per step, microseconds,
    sorted by time). Raises RuntimeError when no CUDA kernel was recorded (e.g. CUPTI unavailable)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    us, calls = defaultdict(float), defaultdict(int)
    for evt in prof.key_averages():
        if "cuda" not in str(getattr(evt, "device_type", "")).lower():
            continue
        t = _device_time_us(evt)
        if t > 0:
            us[evt.key] += t
            calls[evt.key] += int(evt.count)
    if not us:
        raise RuntimeError("the profiler recorded no CUDA kernel")
    total = sum(us.values())
    rows = [dict(name=k, group=kernel_group(k), calls=calls[k] / steps, us=v / steps, share=100 * v / total)
            for k, v in sorted(us.items(), key=lambda kv: -kv[1])]
    groups: dict[str, float] = defaultdict(float)
    for r in rows:
        groups[r["group"]] += r["us"]
    return dict(steps=steps, kernels_per_step=sum(calls.values()) / steps, kernel_us_per_step=total / steps,
                rows=rows, groups=dict(sorted(groups.items(), key=lambda kv: -kv[1])))


def format_profile(p: dict, top: int = 20, label: str = "") -> str:
    """The profile as text: the group totals, then the `top` kernels by time."""
    lines = [f"kernel profile {label}: {p['kernels_per_step']:.0f} kernels, {p['kernel_us_per_step'] / 1e3:.2f} ms of "
             f"kernel time per step (sum of durations; {p['steps']} steps)"]
    for g, v in p["groups"].items():
        lines.append(f"  {g:<32} {v / 1e3:>7.2f} ms  {100 * v / p['kernel_us_per_step']:>5.1f}%")
    lines.append(f"  {'kernel':<70} {'calls':>6} {'us':>9} {'%':>5}")
    for r in p["rows"][:top]:
        lines.append(f"  {r['name'][:70]:<70} {r['calls']:>6.0f} {r['us']:>9.1f} {r['share']:>5.1f}")
    return "\n".join(lines)
