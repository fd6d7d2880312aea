"""FP8 formats: block-scaled FP8 weights (torch, load time) and the per-token-group activation quantizer (op).

Formats (design/kernels_and_limits.md §1.2, §5; design/minimax_m3.md §2.2):
  block FP8 weight   w_q [N, K] float8_e4m3fn + scale [ceil(N/bn), ceil(K/bk)] float32 (bn = bk = 128: the HF
                     block-FP8 format of DeepSeek-V3 / Qwen3-FP8, `weight_scale_inv`, a multiplier despite the
                     name); dequantised w[n, k] = w_q[n, k] * scale[n // bn, k // bk]. Ragged edge blocks allowed.
  MXFP8 weight       the same with bn = 1, bk = 32 and a uint8 E8M0 scale: 2^(byte - 127).
  activation         a_q [M, K] float8_e4m3fn + a_scale [M, ceil(K/128)] float32: one scale per token per
                     128-element K group, scale = max(amax, 1e-10) / 448 (448 = e4m3 max), a_q = a / scale
                     (DeepSeek-V3 fine-grained quantization, arXiv:2412.19437 §3.3.2).

Op "fp8_act_quant": `_act_quant_kernel` one program per (token, ACT_QUANT_GROUPS_PER_PROGRAM groups);
`act_quant_ref` is the torch reference with the same rounding points (fp32 amax, fp32 division, round-to-nearest cast), so both give identical bytes.
Scale layout: a_scale is row-major (strides (G, 1)) by default; `m_major_scale=True` writes the same values M-major
(strides (1, M), "outer-dim-major"), the layout torch._scaled_mm's block-wise 1x128 recipe reads (fp8_gemm.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ladle.kernels._common import decide_triton, interpreting, tl, triton, triton_ok
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "fp8_act_quant"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); x [M, K] contiguous rows")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MX_GROUP = 32  # MXFP8 / MXFP4 weights: one E8M0 scale per 32 K elements (OCP MX)
GROUP = 128  # activation group and weight block edge (the HF block-FP8 `weight_block_size` [128, 128])
SCALE_EPS = 1e-10  # floor on a group's amax, so an all-zero group gets a finite scale


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponent bytes -> float32 multipliers 2^(byte - 127) (OCP MX spec; minimax_m3.md §2.2)."""
    assert scale.dtype == torch.uint8
    return torch.exp2(scale.float() - 127.0)


def _block_edge(size: int, num_blocks: int) -> int:
    """Edge of the blocks that tile `size` in `num_blocks`: 128 when that grid fits (ragged last block allowed),
    else ceil(size / num_blocks) (e.g. MXFP8's 32, or 1 for per-row scales)."""
    return GROUP if math.ceil(size / GROUP) == num_blocks else math.ceil(size / num_blocks)


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Block scale grid [sN, sK] (float, or uint8 E8M0) -> per-element multipliers [N, K] float32; block edges
    from `_block_edge` (128 x 128 when the grid is ceil(N/128) x ceil(K/128), else the even split)."""
    n, k = shape
    sn, sk = scale.shape
    mult = e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale.float()
    bn, bk = _block_edge(n, sn), _block_edge(k, sk)
    return mult.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequant_block_fp8(weight: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-scaled FP8 -> `dtype`. weight [..., N, K] float8 (a leading expert dim allowed); scale
    [..., sN, sK] float32 or uint8 E8M0 (module doc). Exact in float32/float64 (a product of an fp8 value and a
    power of two or an fp32 scale)."""
    if weight.dim() == 3:
        return torch.stack([dequant_block_fp8(w, s, dtype) for w, s in zip(weight, scale)])
    return (weight.to(dtype) * expand_block_scale(scale, tuple(weight.shape)).to(dtype))


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = (GROUP, GROUP)) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8_e4m3fn [N, K], float32 scale [ceil(N/bn), ceil(K/bk)]), scale = block amax / 448
    (floored at 1e-10 / 448), so each block's largest magnitude maps to 448."""
    n, k = w.shape
    bn, bk = block
    sn, sk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(sn * bn, sk * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(sn, bn, sk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=SCALE_EPS) / FP8_MAX  # [sN, sK]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(sn * bn, sk * bk)[:n, :k].contiguous(), scale


def _mx_exponents(w: torch.Tensor, element_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] (K % 32 == 0) -> (float32 blocks [N, K/32, 32], float32 exponents e [N, K/32]): per 32-block
    the smallest e in [-127, 127] with amax / 2^e <= element_max (the element format's max); stored as e + 127."""
    n, k = w.shape
    assert k % MX_GROUP == 0, f"K={k} must be a multiple of 32"
    blocks = w.float().view(n, k // MX_GROUP, MX_GROUP)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -100)
    return blocks, torch.ceil(torch.log2(amax / element_max)).clamp(-127, 127)


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] (K % 32 == 0) -> (float8_e4m3fn [N, K], uint8 E8M0 scale [N, K/32]).

    Exponent per 32-block: the smallest e with amax / 2^e <= 448 (e4m3 max), stored as e + 127.
    """
    blocks, e = _mx_exponents(w, FP8_MAX)
    q = (blocks / torch.exp2(e)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(w.shape)
    return q, (e + 127).to(torch.uint8)

# E2M1 code (bits 0-2) -> magnitude; bit 3 is the sign (OCP MX spec; design/minimax_m3.md §2.3)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] (K % 32 == 0) -> (packed uint8 [N, K/2], uint8 E8M0 scale [N, K/32]), MXFP4 (minimax_m3.md
    §2.3): two E2M1 codes per byte, low nibble = even element k, high nibble = k + 1. Per 32-group exponent e = the
    smallest with amax / 2^e <= 6; each value rounds to the nearest E2M1 magnitude (ties to the lower code)."""
    blocks, e = _mx_exponents(w, E2M1_MAX)
    scaled = (blocks / torch.exp2(e)[..., None]).view(w.shape)
    grid = torch.tensor(E2M1_VALUES, device=w.device)
    code = (scaled.abs()[..., None] - grid).abs().argmin(-1).to(torch.uint8)  # [N, K] in 0..7
    code |= (scaled < 0).to(torch.uint8) << 3
    return code[:, 0::2] | (code[:, 1::2] << 4), (e + 127).to(torch.uint8)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 -> `dtype`: packed uint8 [..., N, K/2] + E8M0 scale [..., N, K/32] -> [..., N, K] (exact)."""
    if packed.dim() == 3:
        return torch.stack([dequant_mxfp4(p, s, dtype) for p, s in zip(packed, scale)])
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()  # [N, K], even element first
    mag = torch.tensor(E2M1_VALUES, dtype=dtype, device=packed.device)[codes & 7]
    vals = torch.where(codes >= 8, -mag, mag)
    return vals * expand_block_scale(scale, tuple(vals.shape)).to(dtype)


def quantize_fp8_rows(w: torch.Tensor, block: tuple[int, int] = (GROUP, GROUP)) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_block_fp8` on [..., N, K] (a leading expert dim allowed), its scales repeated over each block's
    rows: (float8_e4m3fn [..., N, K], float32 [..., N, ceil(K/bk)]) — the kernels' row-expanded layout."""
    if w.dim() == 3:
        pairs = [quantize_fp8_rows(x, block) for x in w]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    q, scale = quantize_block_fp8(w, block)
    return q, scale.repeat_interleave(block[0], dim=0)[: w.shape[0]].contiguous()


def act_quant_ref(x: torch.Tensor, group: int = GROUP, m_major_scale: bool = False,
                  pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (a_q [M', K] float8_e4m3fn, a_scale [M', ceil(K/group)] float32) (module doc): the block
    quantizer with 1 x group blocks; a_scale M-major (strides (1, M')) when `m_major_scale`. M' = M rounded up to a
    multiple of pad_rows_to; the added rows are zeros with scale 1 (a GEMM gives 0 there; callers slice them off)."""
    q, s = quantize_block_fp8(x, (1, group))
    m_pad = -(-x.shape[0] // pad_rows_to) * pad_rows_to
    if m_pad != x.shape[0]:
        q = torch.cat([q, torch.zeros((m_pad - x.shape[0], q.shape[1]), dtype=q.dtype, device=q.device)])
        s = torch.cat([s, torch.ones((m_pad - x.shape[0], s.shape[1]), dtype=s.dtype, device=s.device)])
    return q, (s.t().contiguous().t() if m_major_scale else s)


# Groups per program of `_act_quant_kernel` (power of 2): 8 x 128 elements, so a program moves 2 KiB of bf16 in
# 16-byte vectors instead of 256 bytes (the 8K-token prefill profile of round 5 had one program per group at about 1/7
# of copy bandwidth: 44 ms of 457).
ACT_QUANT_GROUPS_PER_PROGRAM = 8


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_sm, stride_sg, num_groups, eps, fp8_max,
                      GROUP_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """Program (row, chunk): groups chunk * BLOCK_G .. + BLOCK_G - 1 of one row as a [BLOCK_G, GROUP_K] tile; each
    group's amax, scale and quantized values as `act_quant_ref`. Scale (row, g) at row * stride_sm + g * stride_sg."""
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    offs = grp[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]  # [BLOCK_G, GROUP_K]
    ok = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / fp8_max  # [BLOCK_G]
    q = tl.minimum(tl.maximum(x / scale[:, None], -fp8_max), fp8_max)
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=ok)  # fp32 buffer under the interpreter
    tl.store(s_ptr + row * stride_sm + grp * stride_sg, scale, mask=grp < num_groups)


def act_quant_triton(x: torch.Tensor, group: int = GROUP, m_major_scale: bool = False,
                     pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of `act_quant_ref` (same outputs, padding rows and scale layout, byte for byte). x [M, K],
    unit stride on K."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [M, K] with contiguous rows, got {tuple(x.shape)}"
    m, k = x.shape
    m_pad = -(-m // pad_rows_to) * pad_rows_to
    g = triton.cdiv(k, group)
    # The interpreter's fp32 -> fp8 cast drops the carry when rounding crosses a binade (124.3 -> 64, not 128), so
    # under it the kernel stores the scaled fp32 values and torch casts them; on CUDA the kernel casts itself.
    q = torch.empty((m_pad, k), dtype=torch.float32 if interpreting() else FP8_DTYPE, device=x.device)
    if m_major_scale:
        s = torch.empty((g, m_pad), dtype=torch.float32, device=x.device).t()  # [M', G], strides (1, M')
    else:
        s = torch.empty((m_pad, g), dtype=torch.float32, device=x.device)
    if m:
        block_g = min(ACT_QUANT_GROUPS_PER_PROGRAM, triton.next_power_of_2(g))
        _act_quant_kernel[(m, triton.cdiv(g, block_g))](x, q, s, k, x.stride(0), s.stride(0), s.stride(1), g,
                                                        SCALE_EPS, FP8_MAX, GROUP_K=group, BLOCK_G=block_g)
    if m_pad != m:
        q[m:].zero_()
        s[m:].fill_(1.0)
    return q.to(FP8_DTYPE), s


@timed_op
def act_quant(x: torch.Tensor, *, use_triton: bool, group: int = GROUP, m_major_scale: bool = False,
              pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching entry point (records op "fp8_act_quant", bucket = tokens); `m_major_scale`, `pad_rows_to`:
    `act_quant_ref`."""
    reason: Optional[str] = triton_ok(x)
    if reason is None and x.stride(-1) != 1:
        reason = "x rows not contiguous"
    if decide_triton(OP, x.shape[0], use_triton, reason):
        return act_quant_triton(x, group, m_major_scale, pad_rows_to)
    return act_quant_ref(x, group, m_major_scale, pad_rows_to)
