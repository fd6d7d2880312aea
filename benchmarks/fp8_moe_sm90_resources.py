"""Registers, spill bytes, shared memory and CTAs per SM of the FP8 fused-MoE kernels (ladle/kernels/fused_moe_fp8.py)
for each variant of benchmarks/gpu_fp8_moe_prefill_ab.py at M = 8192, compiled for sm_90a on THIS machine: no GPU
needed (Triton's own ptxas; `ptxas -v` reports registers and spills). A script, not a test:

    PYTHONPATH=. python3 benchmarks/fp8_moe_sm90_resources.py      # CPU, about 1-2 min (about 15 kernels)

The Gluon GEMM 2 rows (Fp8MoEOptions.gemm2_gluon) compile through `compile_gemm2_gluon_sm90` (4 warps per 64 rows,
whatever the tile's num_warps).

Arguments are specialized as the JIT launcher does on the GPU for one TP4 rank of MiniMax-M3 (H 6144, I 768, 5 slots
per token; GEMM 2 writes bf16 slot rows, as at prefill since round 10): pointers 16-byte aligned, integers typed and
marked divisible by 16 from their values. CTAs per SM = min(65536 registers / (threads x registers), 232448 bytes /
(shared + 1 KiB reserved)): the occupancy that lets one CTA's scale-and-add run while another's wgmma does (module
doc of fused_moe_fp8.py, "K loop").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: this script compiles for sm_90a")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

sys.path.insert(0, ".")
from benchmarks.gpu_fp8_moe_prefill_ab import PREFILL  # noqa: E402
from ladle.kernels import fused_moe_fp8 as moe8  # noqa: E402
from ladle.kernels.fused_moe import select_config  # noqa: E402

M, H, I, SLOTS = 8192, 6144, 768, 5
POINTERS = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "inter_ptr": "*bf16", "out_ptr": "*bf16", "as_ptr": "*fp32",
            "ws_ptr": "*fp32", "topk_w_ptr": "*fp32", "sorted_ptr": "*i32", "expert_ptr": "*i32", "npp_ptr": "*i32"}
VALUES = {  # the integer / float arguments of each kernel at the M3 shapes
    1: dict(numel=M * SLOTS, topk_cols=SLOTS, N_HALF=I, K=H, num_kb=H // 128, num_akb=H // 128,
            stride_we=2 * I * H, stride_wse=2 * I * H // 128, alpha=1.702, limit=7.0),
    2: dict(numel=M * SLOTS, N=H, K=I, num_kb=I // 128, num_akb=I // 128, stride_we=H * I, stride_wse=H * I // 128,
            P=M * SLOTS + 129 * 63)}


def compile_sm90(fn, values, consts, warps, stages, maxnreg):
    """The kernel compiled for sm_90a with the JIT's specialization of `values` (module doc)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        v = values.get(name)
        sig[name] = POINTERS.get(name) or ("fp32" if isinstance(v, float) else "i32" if abs(v) < 2**31 else "i64")
        if name in POINTERS or (isinstance(v, int) and v % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def ptxas_usage(kernel) -> tuple[int, int]:
    """(registers per thread, spill store bytes) from `ptxas -v` on the kernel's PTX (which carries its .maxnreg)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"], capture_output=True,
                             text=True, check=True).stderr
    spill = re.search(r"(\d+) bytes spill stores", log)
    return int(re.search(r"Used (\d+) registers", log).group(1)), int(spill.group(1)) if spill else 0


def main():
    print(f"{'variant':<20} {'kernel':<6} {'BM,BN,warps,stages':<20} {'regs':>5} {'spill B':>8} {'smem B':>8} "
          f"{'CTAs/SM':>8} {'warps/SM':>9}")
    for row in PREFILL:  # (name, tile, options[, slot dtype])
        name, cfg, opt = row[:3]
        cfg, opt = cfg or select_config(M, "fp8"), opt or moe8.select_options(M)
        for which, bn in ((1, cfg.block_n1), (2, cfg.block_n2)):
            bm = cfg.block_m
            consts = dict(BM=bm, BN=bn, BK=128, E8M0=False, F32_DOT=False, K_UNROLL=opt.k_unroll,
                          EVEN_K=True, BLOCK_SCALES=opt.block_scales,
                          **({"GU_DOT": opt.gu_dot} if which == 1 else
                             {"N_TILES": opt.gemm2_n_tiles, "ALIGNED": opt.gemm2_aligned,
                              "EVEN_N": H % (bn * opt.gemm2_n_tiles) == 0}))
            fn = moe8._fp8_gemm1_kernel if which == 1 else moe8._fp8_gemm2_kernel
            gluon = which == 2 and opt.gemm2_gluon  # the Gluon GEMM 2: 4 warps per 64 rows
            warps = bm // 16 if gluon else cfg.num_warps
            tile = f"{bm},{bn},w{warps},s{cfg.num_stages}" + (" gluon" if gluon else "")
            try:
                if gluon:
                    k = moe8.compile_gemm2_gluon_sm90(bm, bn, opt.gemm2_n_tiles, cfg.num_stages)
                else:
                    k = compile_sm90(fn, VALUES[which], consts, cfg.num_warps, cfg.num_stages, opt.max_regs)
                regs, spill = ptxas_usage(k)
                smem = k.metadata.shared
                ctas = min(65536 // (warps * 32 * regs), 232448 // (smem + 1024))
                print(f"{name:<20} gemm{which:<2} {tile:<20} {regs:>5} {spill:>8} {smem:>8} {ctas:>8} "
                      f"{ctas * warps:>9}", flush=True)
            except Exception as exc:  # noqa: BLE001 - one failing kernel must not hide the others
                print(f"{name:<20} gemm{which:<2} {tile:<20} failed: {type(exc).__name__}: {str(exc)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
