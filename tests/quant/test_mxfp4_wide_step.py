"""The MXFP4 MoE kernels' wide K step (ladle/kernels/fused_moe_mxfp4.py): packed int32 words, 8 dots per step by
nibble position, E2M1 -> float by bit placement, E8M0 scale per word.

1. The in-register dequantisation (float32 arithmetic: the interpreter's bf16 arithmetic is wrong, so the bf16
   variant, the same bits and multiplies, is checked on the GPU: gpu tests, benchmarks/gpu_mxfp4_ab.py) equals
   `dequant_mxfp4` bit for bit, for every byte (all 16 x 16 code pairs) and E8M0 bytes from 0 (the subnormal
   2^-127) through 254 (6 x 2^127 overflows float32 in both).
2. Steps that do not divide K (H = 288: 9 groups, 36 words; BK 256 leaves a 4-word tail, BK 128 a 1-group tail;
   I = 96: 3 groups in one partial step), W4A16 at both BK and W4A8, against the float64 reference on fresh random
   inputs: float32 activations, so W4A16 differs by summation order only (< 1e-5, as tests/quant/test_mxfp4.py);
   W4A8 by that plus rare e4m3 rounding flips of the intermediate (< 1e-3, as tests/quant/test_mxfp4_w4a8.py).
"""

from __future__ import annotations

import pytest
import torch

from ladle.kernels._common import tl, triton
from ladle.kernels.fp8_quant import dequant_mxfp4, quantize_mxfp4
from ladle.kernels.fused_moe import MoETileConfig
from ladle.kernels.fused_moe_mxfp4 import _e2m1_pair, _e8m0_words, fused_moe_mxfp4_ref, fused_moe_mxfp4_triton
from ladle.kernels.moe_router import moe_router_triton


@triton.jit
def _dequant_words_kernel(w_ptr, s_ptr, out_ptr, N, K_WORDS, NW: tl.constexpr, BN: tl.constexpr,
                          BF16: tl.constexpr):
    """out [N, 8 K_WORDS] float32 = the kernels' dequantisation of packed words [N, K_WORDS] (one step)."""
    offs_w = tl.arange(0, NW)
    rows = tl.arange(0, BN).to(tl.int64)
    row_ok = rows < N
    w_ok = offs_w < K_WORDS
    words = tl.load(w_ptr + rows[None, :] * K_WORDS + offs_w[:, None], mask=w_ok[:, None] & row_ok[None, :])
    scale = _e8m0_words(s_ptr, rows, row_ok, offs_w, w_ok, K_WORDS // 4, BF16)
    ok = w_ok[:, None] & row_ok[None, :]
    for q in tl.static_range(4):
        lo, hi = _e2m1_pair(words, scale, q, BF16)
        base = out_ptr + rows[None, :] * (8 * K_WORDS) + 8 * offs_w[:, None]
        tl.store(base + q, lo.to(tl.float32), mask=ok)
        tl.store(base + (q + 4), hi.to(tl.float32), mask=ok)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # scale 254: 6 x 2^127 -> inf, as dequant_mxfp4
def test_dequant_in_registers_is_bit_exact():
    scales = [0, 1, 2, 60, 126, 127, 128, 200, 254]
    packed = torch.arange(256, dtype=torch.uint8).repeat(len(scales), 1)  # row r: every byte, under scale r
    scale = torch.tensor(scales, dtype=torch.uint8)[:, None].repeat(1, 512 // 32)
    packed = packed[torch.randperm(len(scales))]  # rows and scales paired at random (still every byte per row)
    out = torch.empty(len(scales), 512, dtype=torch.float32)
    words = packed.view(torch.int32)
    _dequant_words_kernel[(1,)](words, scale, out, len(scales), words.shape[1], NW=64, BN=16, BF16=False)
    want = dequant_mxfp4(packed, scale, torch.float32)
    assert torch.isinf(want).any() and (want[scale[:, :1].expand(-1, 512) == 0] != 0).any()
    assert torch.equal(out, want)


def _pack(w):
    return (torch.stack(t) for t in zip(*[quantize_mxfp4(x) for x in w]))


@pytest.mark.parametrize("T,fp8,block_k,cfg", [
    (11, False, 256, MoETileConfig(16, 16, 32, 32, 4, 2)),
    (11, False, 128, MoETileConfig(16, 32, 64, 32, 4, 2)),
    (37, True, None, None),
])
def test_partial_steps_against_reference(T, fp8, block_k, cfg):
    H, I, E = 288, 96, 4
    g = torch.Generator().manual_seed(T + int(fp8))
    x = torch.randn(T, H, generator=g)
    ids, wts = moe_router_triton(x, torch.randn(E, H, generator=g), torch.zeros(E), 2, 2.0, shared_expert=True)
    w13 = _pack(torch.randn(E + 1, 2 * I, H, generator=g) / H ** 0.5 * 3)
    w2 = _pack(torch.randn(E + 1, H, I, generator=g) / I ** 0.5)
    args = (x, *w13, *w2, ids, wts)
    out = fused_moe_mxfp4_triton(*args, config=cfg, fp8_activations=fp8, block_k=block_k)
    ref = fused_moe_mxfp4_ref(*args, fp8_activations=fp8)
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < (1e-3 if fp8 else 1e-5), rel
