"""Decode path of the W4A16 MXFP4 fused MoE (ladle/kernels/fused_moe_mxfp4_decode.py) on fresh random inputs.

1. The PTX nibble conversion, replayed step by step in Python (PRMT 0x4140, mask, multiply, keep, x 2^126 in
   bf16), equals `dequant_mxfp4` for every byte and both nibbles: the interpreter cannot run inline asm, so this
   checks the constants the GPU runs (benchmarks/gpu_mxfp4_decode_ab.py checks the result on the H200).
2. The kernels (interpreter: the same bit placement in Triton ops, fp32 dots) against `fused_moe_mxfp4_ref` in
   float64: T = 1 .. 64 tokens, top-2 + the shared expert row (every token), ragged expert loads (a skewed router:
   a few experts take most slots, some none), every E2M1 code in every table and E8M0 scales spread from 2^-127
   (byte 0) to 2^6; float32 activations, so kernel and reference differ by summation order only: < 1e-5.
3. Dispatch: the launcher takes the decode path at <= 64 tokens (W4A16, no wide-kernel option) and records it as
   op "fused_moe_mxfp4_decode"; above, or with FP8 activations, the record shows why not.
4. (gpu) The real TP4-rank shapes in bf16: the decode path as close to the reference as the wide kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ladle.kernels.fp8_quant import dequant_mxfp4, quantize_mxfp4
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_ref, fused_moe_mxfp4_triton
from ladle.kernels.fused_moe import SWIGLU_ALPHA, SWIGLU_LIMIT
from ladle.kernels.fused_moe_mxfp4_decode import (NIBBLE_KEEP, NIBBLE_MASK_MUL, OP_DECODE, DecodeTile,
                                                  deinterleave_groups, fused_moe_mxfp4_decode, nibble_asm)
from ladle.kernels.moe_router import moe_router_triton
from ladle.observe import dispatch


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _ptx_replay(b0: int, b1: int, j: int) -> tuple[float, float]:
    """The steps of nibble_asm(j) on two bytes, in Python: returns the two bf16 halves as floats."""
    t = b0 | (b1 << 16)  # prmt 0x4140 of (b0 | b1 << 8): byte 0 -> byte 0, byte 1 -> byte 2, bytes 1, 3 zero
    mask, mul = NIBBLE_MASK_MUL[j]
    a = (((t & mask) * mul) & 0xFFFFFFFF) & NIBBLE_KEEP
    halves = np.array([a & 0xFFFF, a >> 16], dtype=np.uint32) << 16  # bf16 bits -> float32 bits
    vals = halves.view(np.float32).astype(np.float64) * 2.0 ** 126  # mul.rn.bf16x2 by 2^126: exact
    return float(vals[0]), float(vals[1])


def test_ptx_nibble_steps_match_dequant_for_every_byte():
    for j in (0, 1):
        asm = nibble_asm(j)
        mask, mul = NIBBLE_MASK_MUL[j]
        assert f"{mask:#010x}" in asm and f"{mul:#x}" in asm and f"{NIBBLE_KEEP:#010x}" in asm
        assert "prmt.b32 t, t, 0, 0x4140" in asm and "0x7E807E80" in asm
    packed = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    want = dequant_mxfp4(packed, torch.full((8, 2), 127, dtype=torch.uint8), torch.float64).flatten()
    for byte in range(256):
        other = 255 - byte  # the high half sees a different byte in the same word
        lo0, hi0 = _ptx_replay(byte, other, 0)
        lo1, hi1 = _ptx_replay(byte, other, 1)
        assert (lo0, lo1) == (want[2 * byte].item(), want[2 * byte + 1].item()), byte
        assert (hi0, hi1) == (want[2 * other].item(), want[2 * other + 1].item()), byte


def test_deinterleave_groups():
    x = torch.arange(2 * 64).reshape(2, 64)
    got = deinterleave_groups(x)
    assert got[0, :32].tolist() == list(range(0, 32, 2)) + list(range(1, 32, 2))
    assert got[1, 32:].tolist() == [64 + 32 + i for i in list(range(0, 32, 2)) + list(range(1, 32, 2))]


def _tables(e_rows, rows, cols, gen):
    """Random MXFP4 tables with every E2M1 code present and E8M0 scales forced across 0 .. 133."""
    packed, scale = (torch.stack(t) for t in zip(*[quantize_mxfp4(torch.randn(rows, cols, generator=gen))
                                                  for _ in range(e_rows)]))
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every code pair in expert 0's first rows
    spread = torch.tensor([0, 1, 60, 110, 120, 127, 130, 133], dtype=torch.uint8)
    scale.copy_(spread[torch.randint(0, len(spread), scale.shape, generator=gen)])
    return packed, scale


@pytest.mark.parametrize("T", [1, 3, 16, 33, 64])
def test_decode_path_against_reference(T):
    H, I, E, k = 96, 64, 6, 2
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen)
    bias = torch.tensor([3.0, 2.0, 0.0, -4.0, -4.0, 0.5])  # ragged: experts 0, 1 crowded, 3 and 4 mostly idle
    ids, wts = moe_router_triton(x, torch.randn(E, H, generator=gen) * 0.1, bias, k, 2.0, shared_expert=True)
    w13_p, w13_s = _tables(E + 1, 2 * I, H, gen)
    w2_p, w2_s = _tables(E + 1, H, I, gen)
    w2_s.clamp_(max=120)  # keep the output finite for the norm (GEMM 2 sums intermediates of up to 7 x 2^6 scales)
    dispatch.reset()
    out = fused_moe_mxfp4_triton(x, w13_p, w13_s, w2_p, w2_s, ids, wts)
    assert dispatch.snapshot()["ops"][OP_DECODE]["buckets"][dispatch.tokens_bucket(T)]["executed"] == 1
    ref = fused_moe_mxfp4_ref(x, w13_p, w13_s, w2_p, w2_s, ids, wts)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    assert _rel(out, ref) < 1e-5
    wide = fused_moe_mxfp4_triton(x, w13_p, w13_s, w2_p, w2_s, ids, wts, path="wide")
    assert _rel(out, wide) < 1e-5
    for tile in (DecodeTile(groups=4), DecodeTile(groups=8)):  # more groups per iteration: same math
        alt = fused_moe_mxfp4_decode(x, w13_p, w13_s, w2_p, w2_s, ids, wts, ids.shape[1], SWIGLU_ALPHA, SWIGLU_LIMIT,
                                     tile=tile)
        assert _rel(alt, ref) < 1e-5, tile


def test_dispatch_records_why_not_decode():
    H, I, E = 64, 32, 3
    gen = torch.Generator().manual_seed(1)
    w13_p, w13_s = _tables(E + 1, 2 * I, H, gen)
    w2_p, w2_s = _tables(E + 1, H, I, gen)
    w13_s.clamp_(112, 127)
    w2_s.clamp_(112, 127)
    dispatch.reset()
    for T, fp8 in ((65, False), (4, True)):
        x = torch.randn(T, H, generator=gen)
        ids, wts = moe_router_triton(x, torch.randn(E, H, generator=gen), torch.zeros(E), 2, 2.0, shared_expert=True)
        fused_moe_mxfp4_triton(x, w13_p, w13_s, w2_p, w2_s, ids, wts, fp8_activations=fp8)
    reasons = dispatch.snapshot()["ops"][OP_DECODE]["fallback_reasons"]
    assert set(reasons) == {"65 tokens > 64", "W4A8 (fp8 activations)"}
    with pytest.raises(AssertionError, match="not eligible"):
        fused_moe_mxfp4_triton(x, w13_p, w13_s, w2_p, w2_s, ids, wts, fp8_activations=True, path="decode")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 17, 64])
def test_decode_path_gpu_real_shapes(T):
    """TP4 rank of M3 (H 6144, I_r 768, 128 experts + shared row, top-4), bf16: the PTX dequant on the GPU equals
    the reference as closely as the wide kernel does (bf16 intermediate and output: ~3e-3)."""
    H, I, E = 6144, 768, 128
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids, wts = moe_router_triton(x, torch.randn(E, H, device="cuda", generator=gen), torch.zeros(E, device="cuda"),
                                 4, 2.0, shared_expert=True)
    tabs = [t for rows, cols in ((2 * I, H), (H, I))
            for t in (torch.stack(p) for p in zip(*[quantize_mxfp4(torch.randn(rows, cols, device="cuda",
                                                                               generator=gen) / cols ** 0.5)
                                                    for _ in range(E + 1)]))]
    out = fused_moe_mxfp4_triton(x, *tabs, ids, wts)
    ref = fused_moe_mxfp4_ref(x, *tabs, ids, wts)
    wide = fused_moe_mxfp4_triton(x, *tabs, ids, wts, path="wide")
    assert _rel(out, ref) < 2e-2 and _rel(out, ref) < 1.5 * _rel(wide, ref) + 1e-4
