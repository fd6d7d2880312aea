"""Offline sm_90 inspection of the MXFP4 fused-MoE kernels (no GPU): compile with the launches' constexprs for
target cuda:90 (Triton -> ptxas), then per kernel: registers / stack (cuobjdump -res-usage), shared memory, the
TTGIR's shared-memory ops (local_alloc / local_load: a dequantised tile's round trip) and wgmma count, the inner
loop's HGMMA and wgmma waits (WARPGROUP.DEPBAR) and its SASS (the longest backward branch of cuobjdump -sass)
as instructions per weight element (loop SASS x threads / weight elements per iteration). Source of the numbers
in the docstring of ladle/kernels/fused_moe_mxfp4_decode.py:

    PYTHONPATH=. python3 benchmarks/offline_sass_mxfp4.py [--show NAME]   # CPU, ~1 min
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ladle.kernels import fused_moe_mxfp4 as wide
from ladle.kernels import fused_moe_mxfp4_decode as dec

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = dict(w_ptr="*u8", ws_ptr="*u8", sorted_ptr="*i32", expert_ptr="*i32", npp_ptr="*i32", topk_w_ptr="*fp32")
INTS = ("numel", "topk_cols", "N", "N_HALF", "K_WORDS", "K_BYTES", "stride_xm", "num_akb", "stride_we", "stride_wse")
DIV16 = ("x_ptr", "a_ptr", "w_ptr", "ws_ptr", "out_ptr", "inter_ptr", "N", "N_HALF", "K_WORDS", "K_BYTES",
         "stride_xm", "stride_we", "stride_wse")


def compile_sm90(fn, constexprs, num_warps, num_stages, words=False):
    """triton.compile for cuda:90 with every argument typed as the launcher passes it (bf16 activations)."""
    names = list(fn.arg_names)
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in INTS:
            sig[n] = "i32"
        elif n in ("alpha", "limit"):
            sig[n] = "fp32"
        elif n == "out_ptr":
            sig[n] = "*fp32"
        elif n == "w_ptr" and words:
            sig[n] = "*i32"
        else:
            sig[n] = PTRS.get(n, "*bf16")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIV16 if n in names}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              num_stages=num_stages))


def _cuobjdump(kernel, flag):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(BIN, "cuobjdump"), flag, f.name], capture_output=True, text=True).stdout


def inner_loop(sass):
    """Instructions of the longest backward branch's body (the K loop)."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in lines]
    best = (0, -1)
    for i, ln in enumerate(lines):
        m = re.search(r"BRA[^;]*?(0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            j = addr.index(int(m.group(1), 16))
            best = max(best, (j, i), key=lambda b: b[1] - b[0])
    body = [re.sub(r"\s*/\*[0-9a-f]+\*/\s*", "", ln).strip() for ln in lines[best[0]:best[1] + 1]]
    return [ln for ln in body if not ln.startswith("@!PT")]  # ptxas padding


def report(name, kernel, elems, num_warps, show=False):
    res = _cuobjdump(kernel, "-res-usage")
    loop = inner_loop(_cuobjdump(kernel, "-sass"))
    ops = collections.Counter(re.findall(r"ttg\.(local_alloc|local_load|convert_layout)", kernel.asm["ttgir"]))
    dots = len(re.findall(r"ttng\.warp_group_dot |tt\.dot ", kernel.asm["ttgir"]))
    opc = collections.Counter(ln.split()[1 if ln.startswith("@") else 0].split(".")[0] for ln in loop)
    regs, stack = (re.search(key + r":(\d+)", res).group(1) for key in ("REG", "STACK"))
    print(f"{name:<34} regs {regs:>3} stack {stack} "
          f"smem {kernel.metadata.shared:>6}  ttgir {dict(ops)} dots {dots}  loop HGMMA "
          f"{sum('HGMMA' in ln for ln in loop)} wgmma waits {sum('WARPGROUP.DEPBAR' in ln for ln in loop)}  "
          f"loop {len(loop)} SASS = "
          f"{len(loop) * num_warps * 32 / elems:.2f} per element  {dict(opc.most_common(8))}")
    if show:
        print("\n".join(loop))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--show", default="", help="print the inner loop of the rows whose name contains this")
    args = ap.parse_args(argv)
    rows = []
    for dq in ("f32", "bf16"):  # today's wide kernels, W4A16 decode tiles (GEMM 1 16 x 32, GEMM 2 16 x 64, BK 128)
        c = dict(BM=16, BK=128, FP8_ACT=False, F32_DOT=False, BF16=dq == "bf16")
        rows.append((f"wide gemm1 16x32 {dq}", wide._mxfp4_gemm1_kernel, dict(c, BN=32), 4, 3, 128 * 32 * 2, True))
        rows.append((f"wide gemm2 16x64 {dq}", wide._mxfp4_gemm2_kernel, dict(c, BN=64), 4, 3, 128 * 64, True))
    for bn, g, w in ((64, 2, 4), (64, 4, 4), (64, 8, 4), (128, 4, 8), (128, 2, 4)):  # one K = 32 dot per group
        c = dict(BT=16, BN=bn, G=g, ASM=True, F32_DOT=False)
        tag = f"BN{bn} G{g} w{w}"
        rows.append((f"decode gemm1 {tag}", dec._decode_gemm1_kernel, c, w, 3, 32 * g * bn * 2, False))
        rows.append((f"decode gemm2 {tag}", dec._decode_gemm2_kernel, c, w, 3, 32 * g * bn, False))
    for name, fn, c, warps, stages, elems, words in rows:
        try:
            report(name, compile_sm90(fn, c, warps, stages, words), elems, warps, bool(args.show) and args.show in name)
        except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
            print(f"{name:<34} failed: {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
