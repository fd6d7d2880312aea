"""Per-head Gemma RMSNorm followed by partial NeoX RoPE, in one pass (MiniMax-M3's q/k and index-q/k prologue).

For each token t and head h of x [T, H, D], with w [D] the stored Gemma offset, r = rotary width, half = r / 2:
    n      = (x * rsqrt(mean(x^2) + eps) * (1 + w)).to(dtype)           float32 math, one rounding
    y[:half]  = rnd(rnd(n[:half]  * cos[:half])  + rnd(-n[half:r] * sin[:half]))
    y[half:r] = rnd(rnd(n[half:r] * cos[half:r]) + rnd( n[:half]  * sin[half:r]))
    y[r:]     = n[r:]                                                      (channels past the rotary width pass)
where rnd() rounds to x's dtype and cos/sin [T, r] are already in x's dtype: exactly the rounding points of the
torch composition `rotate_ref(rms_norm_ref(x, w, eps, weight_offset=1.0), cos, sin)` (`head_norm_rope_ref`; transformers
MiniMaxM3 q/k norm then apply_rotary_pos_emb, design/minimax_m3.md §3.4), whose elementwise bf16 ops compute in
float32 and round each result. Only the sum of squares may differ in order, so outputs agree to the last ulp
almost everywhere. RMSNorm: Zhang & Sennrich 2019; RoPE: Su et al. 2021 (RoFormer), NeoX rotate-half layout.

Why: the torch composition is ~14 kernels per tensor (cast, pow, mean, rsqrt, scale, cast, slice, neg, cat, mul, mul,
add, cat); an M3 MSA layer runs it on four tensors (q, k, index q, index k), which made small launches a large part
of a decode step on the TP4-rank proxy.
"""

from __future__ import annotations

import torch

from ladle.kernels._common import check_cache_pair, decide_triton, is_fp8, round_to, triton_ok, tl, triton
from ladle.kernels.kv_store import _quantize, cache_quant_args, store_index_kcache, store_kvcache
from ladle.kernels.rmsnorm import rms_norm_ref
from ladle.kernels.rope import rotate_ref
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

dispatch.register("head_norm_rope", "triton",
                  "cuda (or interpreter); x [T, H, D] unit last stride; cos/sin [T, r] contiguous, x's dtype; even r <= D")


@triton.jit
def _norm_rope_heads(xrow, w_ptr, cos_row, sin_row, orow, stride_xh, stride_oh, eps, store_ok, scale, limit,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, QUANT: tl.constexpr, MANT: tl.constexpr,
                     MIN_NORMAL: tl.constexpr, QUANTUM: tl.constexpr):
    """One token's NUM_HEADS heads (head h at xrow + h * stride_xh) normed and roped by the module doc's formula,
    rounded to x's dtype, then stored at orow + h * stride_oh in orow's dtype: as is, or (QUANT, an FP8 KV /
    index-K cache row) quantized with `scale` and `limit` by ladle/kernels/kv_store.py's `_quantize`, exactly as
    `store_kvcache` quantizes the rounded values. store_ok False (a padding token's cache slot) stores nothing."""
    HALF: tl.constexpr = ROT // 2
    PASS: tl.constexpr = HEAD_DIM - ROT
    dt = xrow.dtype.element_ty
    od = orow.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    mh = offs_h[:, None] < NUM_HEADS
    mc = offs_c < HALF
    m = mh & mc[None, :]
    xrow = xrow + offs_h[:, None] * stride_xh
    x1 = tl.load(xrow + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + HALF + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)  # [BLOCK_H]
    if PASS > 0:
        offs_p = tl.arange(0, BLOCK_PASS)
        mp = mh & (offs_p[None, :] < PASS)
        x3 = tl.load(xrow + ROT + offs_p[None, :], mask=mp, other=0.0).to(tl.float32)
        ss += tl.sum(x3 * x3, 1)
    inv = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
    w1 = 1.0 + tl.load(w_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
    w2 = 1.0 + tl.load(w_ptr + HALF + offs_c, mask=mc, other=0.0).to(tl.float32)
    n1 = round_to(x1 * inv * w1[None, :], dt)
    n2 = round_to(x2 * inv * w2[None, :], dt)
    c1 = tl.load(cos_row + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + HALF + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + HALF + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    y1 = round_to(round_to(n1 * c1, dt) + round_to(-n2 * s1, dt), dt)
    y2 = round_to(round_to(n2 * c2, dt) + round_to(n1 * s2, dt), dt)
    orow = orow + offs_h[:, None] * stride_oh
    tl.store(orow + offs_c[None, :], _quantize(y1, scale, limit, QUANT, MANT, MIN_NORMAL, QUANTUM).to(od),
             mask=m & store_ok)
    tl.store(orow + HALF + offs_c[None, :], _quantize(y2, scale, limit, QUANT, MANT, MIN_NORMAL, QUANTUM).to(od),
             mask=m & store_ok)
    if PASS > 0:
        w3 = 1.0 + tl.load(w_ptr + ROT + offs_p, mask=offs_p < PASS, other=0.0).to(tl.float32)
        y3 = round_to(x3 * inv * w3[None, :], dt)
        tl.store(orow + ROT + offs_p[None, :], _quantize(y3, scale, limit, QUANT, MANT, MIN_NORMAL, QUANTUM).to(od),
                 mask=mp & store_ok)


@triton.jit
def _head_norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, eps,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    _norm_rope_heads(x_ptr + t * stride_xt, w_ptr, cos_ptr + t * ROT, sin_ptr + t * ROT, out_ptr + t * stride_ot,
                     stride_xh, stride_oh, eps, True, 1.0, 0.0, NUM_HEADS, HEAD_DIM, ROT, BLOCK_H, BLOCK_HALF,
                     BLOCK_PASS, False, 0, 0.0, 0.0)


@triton.jit
def _qk_norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, iq_ptr, ik_ptr, wq_ptr, wk_ptr, wiq_ptr, wik_ptr, cos_ptr, sin_ptr, slot_ptr,
    q_out, iq_out, kc_ptr, vc_ptr, ikc_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_iqt, stride_iqh, stride_ikt,
    eps_q, eps_k, eps_iq, eps_ik, k_scale, v_scale, ik_scale, limit, ik_limit,
    NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, NI: tl.constexpr, DI: tl.constexpr, ROT: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_PASS_I: tl.constexpr, BLOCK_V: tl.constexpr, HAS_INDEX: tl.constexpr,
    QUANT: tl.constexpr, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, QUANTUM: tl.constexpr,
    IK_QUANT: tl.constexpr, IK_MANT: tl.constexpr, IK_MIN_NORMAL: tl.constexpr, IK_QUANTUM: tl.constexpr,
):
    """Program (t, part): part 0 token t's q heads -> q_out [T, NH, D]; part 1 its k heads normed and roped and its v
    row -> cache slot slot[t] of kc / vc ([slots, NKV * D] rows); with HAS_INDEX part 2 its index-q heads -> iq_out
    [T, NI, DI] and part 3 its index-k head -> slot[t] of ikc ([slots, DI] rows). slot < 0: the cache rows are not
    written. The parts are independent programs (not one program's serial phases: at decode each launch has few
    tokens, and a token's four norms one after another made the launch 6.4 us, session 12 call 5)."""
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cos_row, sin_row = cos_ptr + t * ROT, sin_ptr + t * ROT
    if part == 0:
        _norm_rope_heads(q_ptr + t * stride_qt, wq_ptr, cos_row, sin_row, q_out + t * (NH * D), stride_qh, D, eps_q,
                         True, 1.0, 0.0, NH, D, ROT, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS, False, 0, 0.0, 0.0)
    elif part == 1:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        ok = slot >= 0
        _norm_rope_heads(k_ptr + t * stride_kt, wk_ptr, cos_row, sin_row, kc_ptr + slot * (NKV * D), stride_kh, D,
                         eps_k, ok, k_scale, limit, NKV, D, ROT, BLOCK_HK, BLOCK_HALF, BLOCK_PASS, QUANT, MANT,
                         MIN_NORMAL, QUANTUM)
        offs_v = tl.arange(0, BLOCK_V)  # v heads are packed (stride D), as kv_store's rows
        mv = (offs_v < NKV * D) & ok
        v = tl.load(v_ptr + t * stride_vt + offs_v, mask=mv, other=0.0)
        v = _quantize(v, v_scale, limit, QUANT, MANT, MIN_NORMAL, QUANTUM)
        tl.store(vc_ptr + slot * (NKV * D) + offs_v, v.to(vc_ptr.dtype.element_ty), mask=mv)
    elif HAS_INDEX:
        if part == 2:
            _norm_rope_heads(iq_ptr + t * stride_iqt, wiq_ptr, cos_row, sin_row, iq_out + t * (NI * DI), stride_iqh,
                             DI, eps_iq, True, 1.0, 0.0, NI, DI, ROT, BLOCK_HI, BLOCK_HALF, BLOCK_PASS_I, False, 0,
                             0.0, 0.0)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            _norm_rope_heads(ik_ptr + t * stride_ikt, wik_ptr, cos_row, sin_row, ikc_ptr + slot * DI, DI, DI, eps_ik,
                             slot >= 0, ik_scale, ik_limit, 1, DI, ROT, 1, BLOCK_HALF, BLOCK_PASS_I, IK_QUANT,
                             IK_MANT, IK_MIN_NORMAL, IK_QUANTUM)


@timed_op
def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, use_triton: bool = True) -> torch.Tensor:
    """x [T, H, D] (any strides with a unit last stride, e.g. a view of a projection output), weight [D] (Gemma
    offset: the scale is 1 + weight), eps, cos/sin [T, r] in x's dtype with even r <= D.

    Returns a new contiguous [T, H, D] tensor in x's dtype (x is not modified). Triton when asked for (`use_triton`)
    and eligible (recorded as op "head_norm_rope"), else `head_norm_rope_ref`. Raises AssertionError on shape, dtype
    or stride mismatches.
    """
    assert x.dim() == 3 and x.stride(-1) == 1, f"x must be [T, H, D] with unit last stride, got {tuple(x.shape)}"
    T, H, D = x.shape
    r = cos.shape[-1]
    assert weight.shape == (D,), f"weight {tuple(weight.shape)} != [D={D}]"
    assert cos.shape == sin.shape == (T, r), f"cos/sin must be [T={T}, r], got {tuple(cos.shape)}/{tuple(sin.shape)}"
    assert r % 2 == 0 and 0 < r <= D, f"rotary width {r} must be even and in (0, {D}]"
    assert cos.dtype == sin.dtype == x.dtype, "cos/sin must be in x's dtype (the reference multiplies in that dtype)"
    reason = triton_ok(x, weight, cos, sin)
    if reason is None and not (cos.is_contiguous() and sin.is_contiguous()):
        reason = "cos/sin not contiguous"
    if not decide_triton("head_norm_rope", T, use_triton, reason):
        return head_norm_rope_ref(x, weight, eps, cos, sin)
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T > 0:
        _head_norm_rope_kernel[(T,)](
            x, weight, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1), eps,
            NUM_HEADS=H, HEAD_DIM=D, ROT=r, BLOCK_H=triton.next_power_of_2(H),
            BLOCK_HALF=triton.next_power_of_2(r // 2), BLOCK_PASS=triton.next_power_of_2(max(D - r, 1)),
            num_warps=4 if H * D >= 1024 else 1,
        )
    return out


def head_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference with the torch model's rounding points (module docstring); same contract: the Gemma
    RMSNorm reference (float32, one rounding) then THE rotation reference in x's dtype."""
    return rotate_ref(rms_norm_ref(x, weight, eps, weight_offset=1.0), cos, sin).contiguous()


# Largest step (tokens) at which `qk_norm_rope_store` asks for its one launch; above it the separate ops run (a
# choice by speed: both write the same bytes). H200, session 12 (benchmarks/results/round12, calls 5 and 6): at the
# decode CUDA-graph sizes (T <= 128) the one launch saves ~0.6 ms per 60-layer step (B = 32 16.91 vs 17.58 ms, B = 128
# 28.28 vs 29.33); at served prefill sizes it is slower than the separate ops (per layer 110 vs ~82 us at T <= 8192,
# 118 vs ~89 at T <= 16384, 239-385 vs ~241 at T <= 32768; op timings of the served runs, round 11 vs 12). Between
# 128 and 8192 tokens nothing was measured; 256 covers decode batches up to 256 requests.
FUSED_PROLOGUE_MAX_TOKENS = 256

dispatch.register("qk_norm_rope_store", "triton",
                  "asked for up to FUSED_PROLOGUE_MAX_TOKENS tokens; cuda (or interpreter); q/k/v (+ index q/k) "
                  "[T, heads, D] unit last stride, v heads packed; cos/sin [T, r] contiguous in x's dtype; caches "
                  "contiguous, x's dtype or FP8; even r <= D")


def _prologue_ineligible(tensors: list[torch.Tensor], x_dtype: torch.dtype, caches: list[torch.Tensor],
                         cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor) -> "str | None":
    reason = triton_ok(*tensors)
    if reason is None and not (cos.is_contiguous() and sin.is_contiguous()):
        reason = "cos/sin not contiguous"
    if reason is None and any(c.dtype != x_dtype and not is_fp8(c.dtype) for c in caches):
        reason = "a cache in another float dtype than q (the reference casts)"
    if reason is None and v.shape[1] > 1 and v.stride(1) != v.shape[2]:
        reason = "v heads not packed"
    return reason


@timed_op
def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: tuple[float, float], cos: torch.Tensor, sin: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                       k_scale: float = 1.0, v_scale: float = 1.0, index: "tuple | None" = None,
                       use_triton: bool = True) -> "tuple[torch.Tensor, torch.Tensor | None]":
    """The attention prologue of MiniMax-M3 in one launch: `head_norm_rope` on q and k (and on the MSA index q and
    k), then k, v written to their KV-cache slots and the index k to its index-K slot, as `store_kvcache` and
    `store_index_kcache` write them (FP8 caches quantized with the per-tensor scales, the same rounding).

    q [T, Hq, D], k / v [T, Hkv, D] (column views of one projection output are fine: unit last stride, v heads
    packed), q_weight / k_weight [D] Gemma offsets, eps (q's, k's), cos / sin [T, r] in q's dtype; key_cache /
    value_cache [blocks, block_size, Hkv, D] contiguous; slot_mapping [>= T] int32/int64, -1 = not written.
    index: None, or (index_q [T, Hi, Di], index_k [T, Di], index_q_weight [Di], index_k_weight [Di], (eps_iq,
    eps_ik), index_key_cache [blocks, block_size, Di], index_k_scale). Returns (q normed + roped [T, Hq, D],
    index q normed + roped [T, Hi, Di] or None), new contiguous tensors; mutates the caches.
    Why: the unfused prologue is 4 norm + RoPE launches and 2 store launches per MSA layer, about 2 us each at
    decode (session 12 profile of the TP4-rank proxy: 351 such launches per B = 32 step, 0.74 ms of 17.1; one
    launch per layer made the B = 32 step 17.58 -> 16.91 ms, B = 128 29.33 -> 28.28, calls 1 and 5 of
    benchmarks/results/round12). Grid (T, parts): q, k + v, index q, index k as separate programs.
    The one launch when asked for (`use_triton` and T <= FUSED_PROLOGUE_MAX_TOKENS) and eligible (recorded as op
    "qk_norm_rope_store"), else the separate ops it fuses (`head_norm_rope`, `store_kvcache`, `store_index_kcache`
    with the same `use_triton`, each by its own rule: their torch references when use_triton is False)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    r = cos.shape[-1]
    assert k.shape == v.shape == (T, Hkv, D) and q_weight.shape == k_weight.shape == (D,)
    assert cos.shape == sin.shape == (T, r) and r % 2 == 0 and 0 < r <= D and cos.dtype == sin.dtype == q.dtype
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "q, k, v need a unit last stride"
    check_cache_pair(key_cache, value_cache)
    assert key_cache.shape[2:] == (Hkv, D), f"cache heads/dim {tuple(key_cache.shape[2:])} != {(Hkv, D)}"
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] >= T and slot_mapping.dtype in (torch.int32, torch.int64)
    slot_mapping = slot_mapping[:T]
    tensors, caches = [q, k, v, q_weight, k_weight, cos, sin, key_cache, value_cache, slot_mapping], [key_cache]
    if index is not None:
        iq, ik, iq_w, ik_w, (eps_iq, eps_ik), ik_cache, ik_scale = index
        Hi, Di = iq.shape[1], iq.shape[2]
        assert iq.shape == (T, Hi, Di) and ik.shape == (T, Di) and iq_w.shape == ik_w.shape == (Di,) and r <= Di
        assert ik_cache.dim() == 3 and ik_cache.shape[2] == Di and ik_cache.is_contiguous()
        assert iq.stride(-1) == ik.stride(-1) == 1
        tensors, caches = tensors + [iq, ik, iq_w, ik_w, ik_cache], caches + [ik_cache]
    reason = _prologue_ineligible(tensors, q.dtype, caches, cos, sin, v)
    fused = use_triton and T <= FUSED_PROLOGUE_MAX_TOKENS
    if not decide_triton("qk_norm_rope_store", T, fused, reason, key_cache.dtype):
        return _separate_ops(q, k, v, q_weight, k_weight, eps, cos, sin, key_cache, value_cache, slot_mapping,
                             k_scale, v_scale, index, use_triton)
    q_out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    iq_out = None if index is None else torch.empty((T, Hi, Di), dtype=iq.dtype, device=q.device)
    if T == 0:
        return q_out, iq_out
    quant, mant, min_normal, quantum, limit = cache_quant_args(key_cache.dtype)
    if index is None:  # the index arguments take q's tensors and are never read (HAS_INDEX False)
        iq, ik, iq_w, ik_w, ik_cache, ik_scale, eps_iq, eps_ik, Hi, Di = q, q, q_weight, q_weight, key_cache, 1.0, \
            0.0, 0.0, 1, D
        iq_o, ik_stride = q_out, 0
    else:
        iq_o, ik_stride = iq_out, ik.stride(0)
    iquant, imant, imin_normal, iquantum, ilimit = cache_quant_args(ik_cache.dtype)
    half_p2 = triton.next_power_of_2(r // 2)
    _qk_norm_rope_store_kernel[(T, 2 if index is None else 4)](
        q, k, v, iq, ik, q_weight, k_weight, iq_w, ik_w, cos, sin, slot_mapping,
        q_out, iq_o, key_cache, value_cache, ik_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), iq.stride(0), iq.stride(1), ik_stride,
        float(eps[0]), float(eps[1]), float(eps_iq), float(eps_ik), float(k_scale), float(v_scale), float(ik_scale),
        limit, ilimit,
        NH=Hq, NKV=Hkv, D=D, NI=Hi, DI=Di, ROT=r, BLOCK_HQ=triton.next_power_of_2(Hq),
        BLOCK_HK=triton.next_power_of_2(Hkv), BLOCK_HI=triton.next_power_of_2(Hi), BLOCK_HALF=half_p2,
        BLOCK_PASS=triton.next_power_of_2(max(D - r, 1)), BLOCK_PASS_I=triton.next_power_of_2(max(Di - r, 1)),
        BLOCK_V=triton.next_power_of_2(Hkv * D), HAS_INDEX=index is not None,
        QUANT=quant, MANT=mant, MIN_NORMAL=min_normal, QUANTUM=quantum,
        IK_QUANT=iquant, IK_MANT=imant, IK_MIN_NORMAL=imin_normal, IK_QUANTUM=iquantum,
        num_warps=4 if Hq * D >= 1024 else 1,
    )
    return q_out, iq_out


def _separate_ops(q, k, v, q_weight, k_weight, eps, cos, sin, key_cache, value_cache, slot_mapping, k_scale, v_scale,
                  index, use_triton):
    """`qk_norm_rope_store` as the ops it fuses, each asked for with `use_triton` (same contract)."""
    q_out = head_norm_rope(q, q_weight, eps[0], cos, sin, use_triton=use_triton)
    store_kvcache(head_norm_rope(k, k_weight, eps[1], cos, sin, use_triton=use_triton), v, key_cache, value_cache,
                  slot_mapping, k_scale=k_scale, v_scale=v_scale, use_triton=use_triton)
    if index is None:
        return q_out, None
    iq, ik, iq_w, ik_w, (eps_iq, eps_ik), ik_cache, ik_scale = index
    ik_n = head_norm_rope(ik.view(ik.shape[0], 1, -1), ik_w, eps_ik, cos, sin, use_triton=use_triton)
    store_index_kcache(ik_n.view(ik.shape[0], -1), ik_cache, slot_mapping, index_k_scale=ik_scale,
                       use_triton=use_triton)
    return q_out, head_norm_rope(iq, iq_w, eps_iq, cos, sin, use_triton=use_triton)
