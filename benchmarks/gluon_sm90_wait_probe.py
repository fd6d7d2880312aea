"""Can a Triton-family kernel keep one wgmma in flight while it promotes the previous K step? The FP8 MoE GEMMs
(ladle/kernels/fused_moe_fp8.py, module doc "K loop") cannot: Triton 3.6 puts `wgmma.wait_group 0` right after every
dot whose result is scaled before the add, also when the source defers the promotion (round 15 README). Gluon
(`triton.experimental.gluon`, in Triton 3.6 here and on the lent H200) exposes the wait count. This script compiles,
for sm_90a on THIS machine (no GPU), a minimal block-scaled FP8 K loop in Gluon that issues step k's wgmma, waits
for at most one outstanding (`warpgroup_mma_wait(1)`: step k-1 done) and promotes step k-1 while step k runs, then
prints the PTX wait counts, ptxas registers and shared memory. A script, not a test:

    PYTHONPATH=. python3 benchmarks/gluon_sm90_wait_probe.py      # CPU, seconds

COMPILE-ONLY: the kernel never ran; its numerics are unchecked and it is no kernel of ladle (synchronous register ->
shared copies, one program, one 64 x 128 tile). Round 15 (2026-12-03): wait_group counts ['1', '0'] (1 in the loop,
0 after it), 8 wgmma instructions, 255 registers with no spills at 4 warps, 48 KiB shared memory.
"""

from __future__ import annotations

import os
import re
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this script compiles for sm_90a")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,  # noqa: E402
                                                              warpgroup_mma_wait)

sys.path.insert(0, ".")
from benchmarks.fp8_moe_sm90_resources import ptxas_usage  # noqa: E402


@gluon.jit
def deferred_promote(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, K, num_kb,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """c [BM, BN] fp32 = sum over K steps kb of (a[:, kb] @ b[:, kb]^T) x as[m, kb] x bs[kb]: a [BM, K], b [BN, K]
    fp8 e4m3 row-major, as [BM, num_kb] and bs [num_kb] fp32 scales (128-wide K steps), one program."""
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    a_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    b_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.float8e4nv)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BM, BK], a_sl)
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BN, BK], b_sl)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, blk))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(1, blk))
    offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, blk))
    rows_m = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    acc = gl.zeros([BM, BN], gl.float32, layout=mma)
    zero = gl.zeros([BM, BN], gl.float32, layout=mma)  # each wgmma's own (unread, use_acc=False) accumulator
    # step 0
    a_smem.index(0).store(gl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :]))
    b_smem.index(0).store(gl.load(b_ptr + offs_n[:, None] * K + offs_k[None, :]))
    fence_async_shared()
    tok = warpgroup_mma(a_smem.index(0), b_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    s_prev = gl.load(as_ptr + rows_m * num_kb) * gl.load(bs_ptr)
    for kb in range(1, num_kb):
        slot = kb % 2
        a_smem.index(slot).store(gl.load(a_ptr + offs_m[:, None] * K + kb * BK + offs_k[None, :]))
        b_smem.index(slot).store(gl.load(b_ptr + offs_n[:, None] * K + kb * BK + offs_k[None, :]))
        fence_async_shared()
        nxt = warpgroup_mma(a_smem.index(slot), b_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                            is_async=True)
        part = warpgroup_mma_wait(1, deps=[tok])  # step kb-1 done, step kb still in flight
        acc = acc + part * s_prev[:, None]
        s_prev = gl.load(as_ptr + rows_m * num_kb + kb) * gl.load(bs_ptr + kb)
        tok = nxt
    part = warpgroup_mma_wait(0, deps=[tok])
    acc = acc + part * s_prev[:, None]
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    gl.store(c_ptr + rows_m[:, None] * BN + cols[None, :], acc)


def main():
    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*fp32",
           "K": "i32", "num_kb": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    src = GluonASTSource(deferred_promote, sig, {"BM": 64, "BN": 128, "BK": 128}, {})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    regs, spill = ptxas_usage(k)
    waits = re.findall(r"wgmma.wait_group.sync.aligned\s+(\d+)", ptx)
    print(f"wgmma.wait_group counts {waits}, {len(re.findall(r'wgmma.mma_async', ptx))} wgmma, {regs} registers, "
          f"{spill} spill bytes, {k.metadata.shared} B shared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
