"""Round 10 probe (a script, not product code): why the MXFP4 W4A16 decode kernel reads at 28-30% of copy
bandwidth. Two changes, each alone and together, on the decode kernel's structure (swap AB, the dequantised weight
tile as the wgmma A operand in registers, one K = 32 dot per 32-group, G = 2 groups per iteration, BN 64, BT 16):
  TILED  the packed tables re-laid so that one 32-group of a BN-row tile is one contiguous BN x 16-byte chunk
         ([E, N/BN, K/32, BN, 16]; scales [E, N/BN, K/32, BN]): an iteration streams 2 KB contiguous instead of
         64 rows x 32 bytes 3 KB (GEMM 1) / 384 B (GEMM 2) apart;
  FP8    W4A8: nibble -> e4m3 bits with two 32-bit ops per four elements (bits (s, e1 e0 m) -> e4m3 s.0e1e0.m00:
         E2M1 x 2^-6 exactly, subnormal 0.5 -> 2^-7 included; x 2^6 folded into the group scale), activations
         quantized per token per 128-group (act_quant), QGMMA 64x16x32 e4m3 with A in registers.
Each row checked against fused_moe_mxfp4_ref (W4A16 or W4A8 reference math) in float32; times are CUDA-graph
replays over 4 input sets (gpu_bench_common.time_graph_us), the FP8 fused MoE on the same routes as yardstick.

    PYTHONPATH=. python3 benchmarks/results/round10/scripts/mx_probe.py [--sweep]   # H200, ~1 min
    (--sweep: M = 32 and 128, the TILED layout over BN / warps / groups per iteration / stages)
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import measure_copy_bandwidth, rel_err, time_graph_us  # noqa: E402
from benchmarks.gpu_mxfp4_ab import FULL, build_weights, inputs  # noqa: E402
from benchmarks.gpu_mxfp4_decode_ab import fp8_tables  # noqa: E402
from ladle.kernels._common import tl, triton  # noqa: E402
from ladle.kernels.fp8_quant import act_quant  # noqa: E402
from ladle.kernels.fused_moe import (SWIGLU_ALPHA, SWIGLU_LIMIT, moe_combine, moe_launch_plan, moe_tile_cols,  # noqa
                                     moe_tile_rows, store_slot_rows, store_swigluoai, MoETileConfig)
from ladle.kernels.fused_moe_fp8 import fused_moe_fp8_triton  # noqa: E402
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_ref  # noqa: E402
from ladle.kernels.fused_moe_mxfp4_decode import _e2m1_nibble, deinterleave_groups, fused_moe_mxfp4_decode  # noqa

_LO: tl.constexpr = tl.constexpr("{ .reg .b32 a, c; and.b32 a, $1, 0x07070707; shl.b32 a, a, 2; "
                                 "and.b32 c, $1, 0x08080808; shl.b32 c, c, 4; or.b32 $0, a, c; }")
_HI: tl.constexpr = tl.constexpr("{ .reg .b32 a, c; shr.b32 a, $1, 2; and.b32 a, a, 0x1C1C1C1C; "
                                 "and.b32 c, $1, 0x80808080; or.b32 $0, a, c; }")


@triton.jit
def _nib8(b, J: tl.constexpr):
    if J == 0:
        v = tl.inline_asm_elementwise(asm=_LO, constraints="=r,r", args=[b], dtype=tl.float8e4nv, is_pure=True,
                                      pack=4)
    else:
        v = tl.inline_asm_elementwise(asm=_HI, constraints="=r,r", args=[b], dtype=tl.float8e4nv, is_pure=True,
                                      pack=4)
    return v


@triton.jit
def _gdot(acc, w_ptrs, s_ptrs, n_ok, x, xs, FP8: tl.constexpr):
    b = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
    s = tl.load(s_ptrs, mask=n_ok, other=127).to(tl.int32)
    if FP8:
        lo = _nib8(b, 0)
        v = tl.reshape(tl.permute(tl.join(lo, _nib8(b, 1)), (0, 2, 1)), (lo.shape[0], 32))
        part = tl.dot(v, x)
        scale = tl.maximum((s + 6) << 23, 0x400000).to(tl.float32, bitcast=True)
        return acc + part * (scale[:, None] * xs[None, :])
    else:
        lo = _e2m1_nibble(b, 0, True)
        v = tl.reshape(tl.permute(tl.join(lo, _e2m1_nibble(b, 1, True)), (0, 2, 1)), (lo.shape[0], 32))
        part = tl.dot(v, x)
        scale = tl.maximum(s << 23, 0x400000).to(tl.float32, bitcast=True)
        return acc + part * scale[:, None]


@triton.jit
def _w_ptrs(w_ptr, ws_ptr, e, stride_we, stride_wse, tile_n, r, c, K_BYTES, BN: tl.constexpr, TILED: tl.constexpr):
    """Bytes [BN, 16] of group 0 and scales [BN] of rows tile_n * BN + r; per group: + 16 bytes / + 1 scale (rows)
    or + BN * 16 / + BN (TILED)."""
    if TILED:
        ng = K_BYTES // 16
        w = w_ptr + e * stride_we + (tile_n * ng).to(tl.int64) * (BN * 16) + r[:, None] * 16 + c[None, :]
        s = ws_ptr + e * stride_wse + (tile_n * ng).to(tl.int64) * BN + r
    else:
        rows = (tile_n * BN + r).to(tl.int64)
        w = w_ptr + e * stride_we + rows[:, None] * K_BYTES + c[None, :]
        s = ws_ptr + e * stride_wse + rows * (K_BYTES // 16)
    return w, s


@triton.jit
def _g1(x_ptr, xs_ptr, w_ptr, ws_ptr, inter_ptr, sorted_ptr, expert_ptr, npp_ptr,
        numel, topk_cols, N_HALF, K_BYTES, stride_xm, stride_we, stride_wse, alpha, limit,
        BT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, TILED: tl.constexpr, FP8: tl.constexpr):
    pid_t, offs_n, n_ok = moe_tile_cols(N_HALF, BN)
    if pid_t * BT >= tl.load(npp_ptr):
        return
    e, offs_t, slot, t_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_t, numel, BT)
    tok = (slot // topk_cols).to(tl.int64)
    r = tl.arange(0, BN)
    c = tl.arange(0, 16)
    tile_n = offs_n // BN
    tn = tl.max(tile_n, 0)
    g_ptrs, sg_ptrs = _w_ptrs(w_ptr, ws_ptr, e, stride_we, stride_wse, tn, r, c, K_BYTES, BN, TILED)
    u_ptrs, su_ptrs = _w_ptrs(w_ptr, ws_ptr, e, stride_we, stride_wse, tn + N_HALF // BN, r, c, K_BYTES, BN, TILED)
    step_w = BN * 16 if TILED else 16
    step_s = BN if TILED else 1
    x_ptrs = x_ptr + tok[None, :] * stride_xm + tl.arange(0, 32)[:, None]
    xs_ptrs = xs_ptr + tok * (K_BYTES // 64)
    acc_g = tl.zeros([BN, BT], tl.float32)
    acc_u = tl.zeros([BN, BT], tl.float32)
    for kb in range(0, K_BYTES // (16 * G)):
        for g in tl.static_range(G):
            xg = tl.load(x_ptrs + 32 * g, mask=t_ok[None, :], other=0.0)
            xs = 0.0
            if FP8:
                xs = tl.load(xs_ptrs + (kb * G + g) // 4, mask=t_ok, other=0.0)
            acc_g = _gdot(acc_g, g_ptrs + step_w * g, sg_ptrs + step_s * g, n_ok, xg, xs, FP8)
            acc_u = _gdot(acc_u, u_ptrs + step_w * g, su_ptrs + step_s * g, n_ok, xg, xs, FP8)
        g_ptrs += step_w * G
        u_ptrs += step_w * G
        sg_ptrs += step_s * G
        su_ptrs += step_s * G
        x_ptrs += 32 * G
    perm = (offs_n // 32) * 32 + (offs_n % 2) * 16 + (offs_n % 32) // 2
    store_swigluoai(inter_ptr, offs_t, perm, n_ok, N_HALF, tl.trans(acc_g), tl.trans(acc_u), alpha, limit)


@triton.jit
def _g2(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, sorted_ptr, expert_ptr, npp_ptr, topk_w_ptr,
        numel, N, K_BYTES, stride_we, stride_wse,
        BT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, TILED: tl.constexpr, FP8: tl.constexpr):
    pid_t, offs_n, n_ok = moe_tile_cols(N, BN)
    if pid_t * BT >= tl.load(npp_ptr):
        return
    e, offs_t, slot, t_ok = moe_tile_rows(sorted_ptr, expert_ptr, pid_t, numel, BT)
    r = tl.arange(0, BN)
    c = tl.arange(0, 16)
    tn = tl.max(offs_n // BN, 0)
    w_ptrs, s_ptrs = _w_ptrs(w_ptr, ws_ptr, e, stride_we, stride_wse, tn, r, c, K_BYTES, BN, TILED)
    step_w = BN * 16 if TILED else 16
    step_s = BN if TILED else 1
    a_ptrs = a_ptr + offs_t[None, :].to(tl.int64) * (2 * K_BYTES) + tl.arange(0, 32)[:, None]
    as_ptrs = as_ptr + offs_t.to(tl.int64) * (K_BYTES // 64)
    acc = tl.zeros([BN, BT], tl.float32)
    for kb in range(0, K_BYTES // (16 * G)):
        for g in tl.static_range(G):
            xs = 0.0
            if FP8:
                xs = tl.load(as_ptrs + (kb * G + g) // 4)
            acc = _gdot(acc, w_ptrs + step_w * g, s_ptrs + step_s * g, n_ok, tl.load(a_ptrs + 32 * g), xs, FP8)
        w_ptrs += step_w * G
        s_ptrs += step_s * G
        a_ptrs += 32 * G
    wt = tl.load(topk_w_ptr + slot, mask=t_ok, other=0.0)
    out = out_ptr + slot[None, :].to(tl.int64) * N + offs_n[:, None]
    store_slot_rows(out, acc * wt[None, :], t_ok[None, :] & n_ok[:, None])


def relay(tabs, bn):
    """[E, N, KB] bytes / [E, N, KB/16] scales -> the TILED layout (module doc)."""
    out = []
    for w, s in ((tabs[0], tabs[1]), (tabs[2], tabs[3])):
        E, N, KB = w.shape
        out.append(w.view(E, N // bn, bn, KB // 16, 16).permute(0, 1, 3, 2, 4).contiguous())
        out.append(s.view(E, N // bn, bn, KB // 16).permute(0, 1, 3, 2).contiguous())
    return out


def probe_moe(x, tabs, ids, wts, tiled, fp8, bn=64, bt=16, g=2, warps=4, stages=3):
    T, H = x.shape
    k = ids.shape[1]
    E, I = tabs[0].shape[0], tabs[0].shape[1] * (tabs[0].shape[3] if tiled else 1) // 2
    cfg = MoETileConfig(bt, bn, bn, 32 * g, warps, stages)
    _, _, (sorted_ids, expert_ids, npp) = moe_launch_plan(ids, E, H, I, cfg, 32, "mxfp4")
    P = sorted_ids.numel()
    x_de = deinterleave_groups(x)
    if fp8:
        xq, xsc = act_quant(x_de, use_triton=True)
    else:
        xq, xsc = x_de, x_de  # xsc unused
    inter = torch.empty((P, I), dtype=x.dtype, device=x.device)
    launch = dict(BT=bt, BN=bn, G=g, TILED=tiled, FP8=fp8, num_warps=warps, num_stages=stages)
    _g1[((P // bt) * (I // bn),)](xq, xsc, tabs[0], tabs[1], inter, sorted_ids, expert_ids, npp, T * k, k, I, H // 2,
                                  xq.stride(0), tabs[0].stride(0), tabs[1].stride(0), SWIGLU_ALPHA, SWIGLU_LIMIT,
                                  **launch)
    if fp8:
        aq, asc = act_quant(inter, use_triton=True)
    else:
        aq, asc = inter, inter
    out_slots = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    _g2[((P // bt) * (H // bn),)](aq, asc, tabs[2], tabs[3], out_slots, sorted_ids, expert_ids, npp,
                                  wts.contiguous(), T * k, H, I // 2, tabs[2].stride(0), tabs[3].stride(0), **launch)
    return moe_combine(out_slots, T, k, x.dtype, use_triton=True)


def sweep_variants(tabs, tiled_by_bn):
    """--sweep: the TILED layout over groups per iteration, stages, BN / warps (bf16 and fp8)."""
    out = {}
    for fp8 in (False, True):
        for bn, warps, g, stages in ((64, 4, 2, 3), (64, 4, 2, 5), (64, 4, 4, 3), (64, 4, 4, 4), (64, 4, 8, 3),
                                     (128, 8, 2, 4), (128, 8, 4, 3), (32, 4, 4, 4)):
            if fp8 and stages != 3:
                continue  # the fp8 rows' weight bytes are register loads (not pipelined): stages do not matter
            name = f"{'fp8' if fp8 else 'bf16'} tiled BN{bn} w{warps} G{g} s{stages}"
            out[name] = (lambda x, i, w, bn=bn, warps=warps, g=g, stages=stages, fp8=fp8: probe_moe(
                x, tiled_by_bn[bn], i, w, True, fp8, bn=bn, g=g, warps=warps, stages=stages), fp8, 0.5 + 1 / 32)
    return out


def main():
    sweep = "--sweep" in sys.argv
    s = FULL
    torch.manual_seed(0)
    bw = measure_copy_bandwidth()
    tabs, bf16 = build_weights(s, torch.bfloat16)
    f8 = fp8_tables(bf16)
    del bf16
    tiled, tiled128 = relay(tabs, 64), relay(tabs, 128)
    tiled_by_bn = {32: relay(tabs, 32), 64: tiled, 128: tiled128}
    rows = []
    for m in ((32, 128) if sweep else (1, 32, 128)):
        xs, routes, distinct = inputs(s, m, torch.bfloat16)
        refs = {fp: fused_moe_mxfp4_ref(xs[0], *tabs, *routes[0], compute_dtype=torch.float32, fp8_activations=fp)
                for fp in (False, True)}
        variants = {
            "today (decode path)": (lambda x, i, w: fused_moe_mxfp4_decode(x, *tabs, i, w, i.shape[1], SWIGLU_ALPHA,
                                                                           SWIGLU_LIMIT), False, 0.5 + 1 / 32),
            "probe bf16 rows": (lambda x, i, w: probe_moe(x, tabs, i, w, False, False), False, 0.5 + 1 / 32),
            "probe bf16 tiled": (lambda x, i, w: probe_moe(x, tiled, i, w, True, False), False, 0.5 + 1 / 32),
            "probe fp8 rows": (lambda x, i, w: probe_moe(x, tabs, i, w, False, True), True, 0.5 + 1 / 32),
            "probe fp8 tiled": (lambda x, i, w: probe_moe(x, tiled, i, w, True, True), True, 0.5 + 1 / 32),
            "probe fp8 tiled BN128 w8": (lambda x, i, w: probe_moe(x, tiled128, i, w, True, True, bn=128, warps=8),
                                         True, 0.5 + 1 / 32),
            "FP8 MoE (yardstick)": (lambda x, i, w: fused_moe_fp8_triton(x, *f8, i, w), None, 1 + 4 / 128),
        }
        if sweep:
            variants = {k: v for k, v in variants.items() if k in ("today (decode path)", "FP8 MoE (yardstick)")}
            variants.update(sweep_variants(tabs, tiled_by_bn))
        for name, (fn, fp, bpw) in variants.items():
            row = {"variant": name, "M": m, "experts": distinct}
            try:
                out = fn(xs[0], *routes[0])
                row["rel_err"] = rel_err(out.float(), refs[fp]) if fp is not None else float("nan")
                us = time_graph_us([lambda x=x, r=r: fn(x, *r) for x, r in zip(xs, routes)])
                row["us"] = us
                row["%BW"] = 100 * distinct * 3 * s["i"] * s["hid"] * bpw / (us * 1e-6) / 1e9 / bw
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            print("ROW", row, flush=True)
            rows.append(row)
    print(f"\ncopy {bw:.0f} GB/s; TP4-rank shapes; us per MoE call (CUDA graph); %BW over the touched experts' bytes")
    print(f"{'variant':<30} {'M':>4} {'exp':>4} {'us':>8} {'%BW':>6} {'rel_err':>9}")
    for r in rows:
        print(f"{r['variant']:<30} {r['M']:>4} {r['experts']:>4} {r.get('us', float('nan')):8.1f} "
              f"{r.get('%BW', float('nan')):6.1f} {r.get('rel_err', float('nan')):9.2e} {r.get('error', '')}")


if __name__ == "__main__":
    main()
