"""GPU suite for the MiniMax-M3 kernels at one TP4 rank's shapes (issue 6). A script, not a test.

    PYTHONPATH=. python3 benchmarks/gpu_m3_suite.py --out m3_suite.json [--quick]

Shapes (design/kernels_and_limits.md §6.1): 16 q heads, 1 KV head, head_dim 128, 1 index head, index dim 128,
block 128, top-k 16; 128 routed experts + 1 shared packed as expert #128, intermediate 768, hidden 6144, top-4.
All weights, KV and index-K are bf16 (FP8 is a later issue). Decode: batch 1/32/128 at 8K contexts (each request
decodes at position 8191: 64 visible blocks); prefill: one 8K-token request (positions 0..8191).

SYNTHETIC DATA: K, V, index-K caches and index queries are filled with random normals, block tables are random
permutations of the physical blocks, router weights are random (so routing is roughly uniform). Bytes and
FLOPs are counted from the actual selections / routings of the run.

Method (benchmarks/gpu_bench_common.py, METHOD.md): ceilings (copy bandwidth, bf16 GEMM) re-measured in this run;
each kernel timed as a single eager launch (do_bench median, L2 flushed) and as a CUDA-graph replay over R input
sets totalling >= 4x the 50 MB L2; error against a torch reference computed in the same run. The table is printed
last; everything goes to --out as JSON.

Variants (decode B=1/32/128): besides the default-settings rows, the indexer and the sparse attention are timed in
each of {2-launch, fused} x {bsearch, vec} (rows tagged "[...]" with target "variant"): 2-launch = separate
top-k / split-merge launch, fused = the last-arriving split program does it (arrival counters, see
ladle/kernels/split_counters.py); bsearch / vec = binary-search / vector request lookup. Each variant writes into
poisoned outputs and is checked against the same reference three times: after one eager call, after the eager
timing loop, after the CUDA-graph replays ("a/b/c" in the error column; a counter that failed to reset would leave
poison behind).

MoE combine: `_moe_combine_kernel` (op "moe_combine", the fused MoE launchers' last step) timed alone at M = 32 and
8192 against the torch expression it replaces (fp32 sum over the slots + cast; row "  combine torch").

The indexer's decode A/B (defaults before / after the issue-11 decode lever, bf16 and FP8 index-K, exact check
against msa_indexer_ref) is benchmarks/gpu_msa_indexer_ab.py.

The TP4-rank proxy (whole decode step and 8K prefill through the engine, against the byte / FLOP rooflines) is
benchmarks/gpu_m3_proxy.py (run separately: it holds ~120 GiB of the GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import (L2_BYTES, measure_bf16_gemm_tflops, measure_copy_bandwidth, rel_err,  # noqa: E402
                                         time_graph_us, time_single_us)
from ladle.kernels.fused_moe import (MoETileConfig, fused_moe_ref, fused_moe_triton, moe_combine_ref,  # noqa: E402
                                     moe_combine_triton, select_config)
from ladle.kernels.moe_router import moe_router_ref, moe_router_triton  # noqa: E402
from ladle.kernels.msa_indexer import msa_indexer_triton  # noqa: E402
from ladle.kernels.msa_sparse_attention import msa_sparse_attention_triton  # noqa: E402

HQ, HKV, D, DI, BS, TOPK = 16, 1, 128, 128, 128, 16
E, I, HID, K_ROUTED = 128, 768, 6144, 4
CTX = 8192
DT = torch.bfloat16
ROWS: list[dict] = []
QUICK = False  # --quick: no sweeps, no breakdowns


def log(*a):
    print(*a, flush=True)


def add_row(kernel, shape, single_us, graph_us, nbytes, flops, err, target, ceil_bw, ceil_fl, extra=None):
    t = graph_us if graph_us else single_us
    gbs = nbytes / (t * 1e-6) / 1e9 if nbytes else 0.0
    tfs = flops / (t * 1e-6) / 1e12 if flops else 0.0
    row = dict(kernel=kernel, shape=shape, single_us=single_us, graph_us=graph_us, bytes=nbytes, flops=flops,
               gbps=gbs, pct_bw=100 * gbs / ceil_bw, tflops=tfs, pct_bf16=100 * tfs / ceil_fl, err=err,
               target=target)
    row.update(extra or {})
    ROWS.append(row)
    log(json.dumps(row))


# ----------------------------------------------------------------------------------------------------- MSA setup
def msa_case(batch: int, prefill: bool, min_bytes: int):
    """Caches + R block-table sets. Decode: `batch` requests at position CTX-1; prefill: 1 request, CTX tokens."""
    nblk = CTX // BS
    reqs = 1 if prefill else batch
    T = CTX if prefill else batch
    per_set = reqs * TOPK * BS * 2 * HKV * D * 2  # sparse-attention bytes per call (the smallest stream)
    R = 1 if prefill else max(1, min(128, math.ceil(min_bytes / per_set)))
    num_blocks = R * reqs * nblk + 1
    kc = torch.randn(num_blocks, BS, HKV, D, device="cuda", dtype=DT)
    vc = torch.randn(num_blocks, BS, HKV, D, device="cuda", dtype=DT)
    kic = torch.randn(num_blocks, BS, DI, device="cuda", dtype=DT)
    perm = (torch.randperm(num_blocks - 1, device="cuda") + 1).int()
    tables = [perm[i * reqs * nblk:(i + 1) * reqs * nblk].view(reqs, nblk).contiguous() for i in range(R)]
    if prefill:
        positions = torch.arange(CTX, device="cuda")
        qsl = torch.tensor([0, CTX], dtype=torch.int32, device="cuda")
    else:
        positions = torch.full((batch,), CTX - 1, device="cuda", dtype=torch.int64)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    qi = [torch.randn(T, HKV, DI, device="cuda", dtype=DT) for _ in range(R)]
    q = [torch.randn(T, HQ, D, device="cuda", dtype=DT) for _ in range(R)]
    return dict(kc=kc, vc=vc, kic=kic, tables=tables, positions=positions, qsl=qsl, qi=qi, q=q, R=R, T=T)


def indexer_ref_sets(c, i, chunk=1024):
    """Vectorised torch reference on the GPU (fp32 scores): list of sets per (group 0, token)."""
    bt, kic, qi, pos = c["tables"][i], c["kic"], c["qi"][i], c["positions"]
    qsl = c["qsl"].tolist()
    T = qi.shape[0]
    ref = torch.empty(T, TOPK, dtype=torch.int64, device="cuda")
    for r in range(len(qsl) - 1):
        keys = kic[bt[r].long()].reshape(-1, DI).float()  # [CTX, DI]
        for s in range(qsl[r], qsl[r + 1], chunk):
            e = min(s + chunk, qsl[r + 1])
            sc = qi[s:e, 0].float() @ keys.T  # [n, CTX]
            j = torch.arange(keys.shape[0], device="cuda")
            p = pos[s:e]
            sc = sc.masked_fill(j[None, :] > p[:, None], float("-inf")).view(e - s, -1, BS).amax(-1)
            local = (p // BS)
            sc.scatter_(1, local[:, None], float("inf"))
            nvis = local + 1
            top = torch.topk(sc, TOPK, dim=1).indices
            top = torch.where(torch.arange(TOPK, device="cuda")[None, :] < nvis[:, None], top, -1)
            ref[s:e] = top
    return ref


def set_match(sel, ref):
    a = torch.sort(sel[0].long(), dim=1).values
    b = torch.sort(ref, dim=1).values
    return (a == b).all(dim=1).float().mean().item()


def attn_ref(c, i, sel, chunk=512):
    """fp32 torch reference of the sparse attention (gathers the selected blocks), chunked over tokens."""
    bt, q, pos, qsl = c["tables"][i], c["q"][i], c["positions"], c["qsl"].tolist()
    T = q.shape[0]
    req = torch.searchsorted(c["qsl"][1:], torch.arange(T, device="cuda"), right=True)
    out = torch.empty(T, HQ, D, device="cuda", dtype=torch.float32)
    for s in range(0, T, chunk):
        e = min(s + chunk, T)
        sb = sel[0, s:e].long()  # [n, TOPK]
        valid = sb >= 0
        pages = bt[req[s:e, None], sb.clamp(min=0)].long()  # [n, TOPK]
        k = c["kc"][pages][:, :, :, 0].float().reshape(e - s, TOPK * BS, D)
        v = c["vc"][pages][:, :, :, 0].float().reshape(e - s, TOPK * BS, D)
        j = (sb.clamp(min=0)[:, :, None] * BS + torch.arange(BS, device="cuda")).reshape(e - s, -1)
        ok = (j <= pos[s:e, None]) & valid.repeat_interleave(BS, dim=1)
        sc = torch.einsum("nhd,nkd->nhk", q[s:e].float(), k) / math.sqrt(D)
        sc = sc.masked_fill(~ok[:, None, :], float("-inf"))
        out[s:e] = torch.einsum("nhk,nkd->nhd", torch.softmax(sc, dim=-1), v)
    return out


def visible_keys(c, sel):
    """Sum over tokens of keys attended (for FLOP and byte counts)."""
    pos = c["positions"]
    sb = sel[0].long()
    full = ((sb >= 0) & (sb < (pos // BS)[:, None])).sum()
    local = (pos % BS + 1).sum()
    return int(full.item()) * BS + int(local.item())


def run_msa(batch, prefill, bw, fl):
    label = f"prefill T={CTX}" if prefill else f"decode B={batch} ctx={CTX}"
    c = msa_case(batch, prefill, 4 * L2_BYTES)
    R, T = c["R"], c["T"]
    sels = [torch.empty(HKV, T, TOPK, dtype=torch.int32, device="cuda") for _ in range(R)]
    idx_fns = [lambda i=i: msa_indexer_triton(c["qi"][i], c["kic"], c["tables"][i], c["positions"], c["qsl"],
                                                TOPK, out=sels[i]) for i in range(R)]
    for f in idx_fns:
        f()
    torch.cuda.synchronize()
    match = set_match(sels[0], indexer_ref_sets(c, 0))
    nblk_scanned = int(((c["positions"] // BS) + 1).sum().item())
    idx_bytes = nblk_scanned * BS * DI * 2 + T * HKV * DI * 2 + T * HKV * TOPK * 4
    idx_flops = 2 * HKV * DI * int((c["positions"] + 1).sum().item())  # useful (causal) q.k FLOPs
    single = time_single_us(idx_fns[0])
    graph = time_graph_us(idx_fns)
    add_row("msa_indexer", label + f" R={R}", single, graph, idx_bytes if not prefill else 0,
            idx_flops if prefill else 0, f"set-match {match:.4f}",
            ">=70% copy BW" if (not prefill and batch >= 32) else "-", bw, fl)

    outs = [torch.empty(T, HQ, D, device="cuda", dtype=DT) for _ in range(R)]
    attn_fns = [lambda i=i: msa_sparse_attention_triton(c["q"][i], c["kc"], c["vc"], c["tables"][i], sels[i],
                                                          c["positions"], c["qsl"], out=outs[i]) for i in range(R)]
    for f in attn_fns:
        f()
    torch.cuda.synchronize()
    err = rel_err(outs[0].float(), attn_ref(c, 0, sels[0]))
    nkeys = visible_keys(c, sels[0])
    nsel_blocks = int((sels[0] >= 0).sum().item())
    attn_bytes = nsel_blocks * BS * 2 * HKV * D * 2 + 2 * T * HQ * D * 2 + T * TOPK * 4
    attn_flops = 4 * HQ * D * nkeys
    single = time_single_us(attn_fns[0])
    graph = time_graph_us(attn_fns)
    add_row("msa_sparse_attn", label + f" R={R}", single, graph, attn_bytes if not prefill else 0,
            attn_flops if prefill else 0, f"rel {err:.2e}",
            ">=70% copy BW" if (not prefill and batch >= 32) else "-", bw, fl)
    if not prefill:
        msa_variant_rows(c, sels, label + f" R={R}", indexer_ref_sets(c, 0), attn_ref(c, 0, sels[0]), idx_bytes,
                         attn_bytes, ">=70% copy BW" if batch >= 32 else "-", bw, fl)
    if not prefill and batch >= 32 and not QUICK:
        stage_breakdown(c, sels, outs, label, idx_bytes, attn_bytes, bw, fl)
    if not prefill and batch >= 32 and not QUICK:  # split-count sweep (shape constants only; reported, not auto-applied)
        ref_sets, ref_out = indexer_ref_sets(c, 0), attn_ref(c, 0, sels[0])
        for ns, nw, st in [(ns, nw, st) for ns in (2, 4, 8, 16) for st in (1, 2) for nw in (4, 8)]:
            fns = [lambda i=i: msa_sparse_attention_triton(c["q"][i], c["kc"], c["vc"], c["tables"][i], sels[i],
                                                             c["positions"], c["qsl"], num_splits=ns, out=outs[i],
                                                             num_warps=nw, num_stages=st) for i in range(R)]
            t1, t2 = time_single_us(fns[0]), time_graph_us(fns)
            outs[0].fill_(float("nan"))  # poison, then one more call: the row's error is this config's own output
            fns[0]()
            add_row("msa_sparse_attn", label + f" splits={ns} w{nw} s{st}", t1, t2, attn_bytes, 0,
                    f"rel {rel_err(outs[0].float(), ref_out):.2e}", "sweep", bw, fl)
        for ns, nw, st in [(ns, nw, st) for ns in (None, 8, 16, 32, 64) for st in (2, 3, 4) for nw in (4,)] + \
                [(ns, 8, 3) for ns in (None, 16, 32)]:
            fns = [lambda i=i: msa_indexer_triton(c["qi"][i], c["kic"], c["tables"][i], c["positions"], c["qsl"],
                                                    TOPK, out=sels[i], num_splits=ns, num_warps=nw, num_stages=st)
                   for i in range(R)]
            t1, t2 = time_single_us(fns[0]), time_graph_us(fns)
            sels[0].fill_(-7)
            fns[0]()
            add_row("msa_indexer", label + f" splits={ns or 'dflt'} w{nw} s{st}", t1, t2, idx_bytes, 0,
                    f"set {set_match(sels[0], ref_sets):.4f}", "sweep", bw, fl)
    del c
    torch.cuda.empty_cache()


MSA_VARIANTS = [(fused, vec) for fused in (False, True) for vec in (False, True)]  # (fused, vector lookup)


def msa_variant_rows(c, sels, label, idx_ref, attn_ref_out, idx_bytes, attn_bytes, target, bw, fl):
    """Old two-launch vs fused (x binary search vs vector request lookup) side by side at one decode shape. Every
    attention variant reads the same selections `sels`, so both ops have one reference each (idx_ref: sets of
    `indexer_ref_sets`; attn_ref_out: `attn_ref` of sels[0]). Error column: check after the first eager call /
    after the eager timing loop / after the graph replays, outputs re-poisoned before each."""
    R, T = c["R"], c["T"]
    vsels = [torch.empty(HKV, T, TOPK, dtype=torch.int32, device="cuda") for _ in range(R)]
    vouts = [torch.empty(T, HQ, D, device="cuda", dtype=DT) for _ in range(R)]
    for fused, vec in MSA_VARIANTS:
        tag = f" [{'fused' if fused else '2-launch'} {'vec' if vec else 'bsearch'}]"
        ifns = [lambda i=i: msa_indexer_triton(c["qi"][i], c["kic"], c["tables"][i], c["positions"], c["qsl"], TOPK,
                                               out=vsels[i], fused_topk=fused, vec_search=vec) for i in range(R)]
        afns = [lambda i=i: msa_sparse_attention_triton(c["q"][i], c["kc"], c["vc"], c["tables"][i], sels[i],
                                                        c["positions"], c["qsl"], out=vouts[i], fused_merge=fused,
                                                        vec_search=vec) for i in range(R)]
        for kernel, fns, outs, poison, check, nbytes in (
                ("msa_indexer", ifns, vsels, -7, lambda: f"{set_match(vsels[0], idx_ref):.3f}", idx_bytes),
                ("msa_sparse_attn", afns, vouts, float("nan"),
                 lambda: f"{rel_err(vouts[0].float(), attn_ref_out):.1e}", attn_bytes)):
            checks, times = [], []
            for timer in (lambda: fns[0](), lambda: time_single_us(fns[0]), lambda: time_graph_us(fns)):
                for o in outs:
                    o.fill_(poison)
                times.append(timer())  # the first timer is the eager call that also grows the counter buffer
                torch.cuda.synchronize()
                checks.append(check())
            add_row(kernel, label + tag, times[1], times[2], nbytes, 0,
                    ("set " if kernel == "msa_indexer" else "rel ") + "/".join(checks), "variant " + target, bw, fl)


def stage_breakdown(c, sels, outs, label, idx_bytes, attn_bytes, bw, fl):
    """Time the second stage of each two-kernel op alone (indexer top-k; attention split merge), to name how much
    of the call is the extra launch rather than the byte stream."""
    import triton
    from ladle.kernels.msa_indexer import _index_topk_kernel
    from ladle.kernels.msa_sparse_attention import _merge_kernel, default_num_splits
    R, T = c["R"], c["T"]
    B, nb = c["tables"][0].shape
    scores = torch.randn(HKV, T, nb, device="cuda")
    fns = [lambda i=i: _index_topk_kernel[(T, HKV)](scores, c["positions"], c["qsl"], sels[i], B, T, nb,
                                                    BLOCK_SIZE=BS, TOPK=TOPK, TOPK_P2=TOPK, NB_P2=nb, RANK_SELECT=nb <= 128,
                                                    num_warps=4)
           for i in range(R)]
    add_row("  idx topk only", label, time_single_us(fns[0]), time_graph_us(fns), 0, 0, "-", "breakdown", bw, fl)
    ns = default_num_splits(T, HKV, TOPK, torch.device("cuda"))
    pacc = torch.randn(T, HQ, ns, D, device="cuda")
    pml = torch.rand(T, HQ, ns, 2, device="cuda")
    fns = [lambda i=i: _merge_kernel[(T, HQ)](pacc, pml, outs[i], HQ, outs[i].stride(0), outs[i].stride(1),
                                              HEAD_DIM=D, NUM_SPLITS=ns, num_warps=4) for i in range(R)]
    add_row("  attn merge only", label + f" splits={ns}", time_single_us(fns[0]), time_graph_us(fns), 0, 0, "-",
            "breakdown", bw, fl)


# --------------------------------------------------------------------------------------------------------- MoE
def moe_weights():
    w13 = torch.randn(E + 1, 2 * I, HID, device="cuda", dtype=DT) * 0.02
    w2 = torch.randn(E + 1, HID, I, device="cuda", dtype=DT) * 0.02
    gate = torch.randn(E, HID, device="cuda", dtype=torch.float32) * 0.02
    bias = torch.randn(E, device="cuda", dtype=torch.float32) * 0.01
    return w13, w2, gate, bias


def run_moe(M, W, bw, fl, configs):
    w13, w2, gate, bias = W
    expert_bytes = (2 * I * HID + HID * I) * 2
    R = 1 if M >= 32 else 4
    xs = [torch.randn(M, HID, device="cuda", dtype=DT) for _ in range(R)]
    routes = [moe_router_triton(x, gate, bias, K_ROUTED, 2.0, shared_expert=True) for x in xs]
    ids0, w0 = routes[0]
    rids, rw = moe_router_ref(xs[0], gate, bias, K_ROUTED, 2.0, shared_expert=True)
    id_match = (ids0.sort(1).values == rids.sort(1).values).all(1).float().mean().item()
    werr = (w0 - rw).abs().max().item()
    label = f"M={M}"
    rbytes = E * HID * 4 + M * HID * 2
    rfns = [lambda x=x: moe_router_triton(x, gate, bias, K_ROUTED, 2.0, shared_expert=True) for x in xs]
    add_row("moe_router", label, time_single_us(rfns[0]), time_graph_us(rfns), rbytes, 2 * M * HID * E,
            f"ids {id_match:.4f} w {werr:.1e}", "-", bw, fl)
    distinct = int(torch.unique(ids0).numel())
    nbytes = distinct * expert_bytes + 2 * M * HID * 2
    flops = 2 * M * (K_ROUTED + 1) * (2 * I * HID + HID * I)
    ref = fused_moe_ref(xs[0], w13, w2, ids0, w0, compute_dtype=torch.float32)
    prefill = M > 256
    target = ">=50% bf16" if prefill else ">=60% copy BW"
    for cfg in configs:
        try:
            moe_config_row(cfg, M, xs, routes, w13, w2, ref, label, distinct, prefill, nbytes, flops, target, bw, fl)
        except Exception as exc:  # noqa: BLE001 - e.g. a sweep config out of shared memory
            log(f"config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")


def moe_config_row(cfg, M, xs, routes, w13, w2, ref, label, distinct, prefill, nbytes, flops, target, bw, fl):
    """Time one tile config of the fused MoE and add its row."""
    fns = [lambda x=x, r=r: fused_moe_triton(x, w13, w2, r[0], r[1], config=cfg) for x, r in zip(xs, routes)]
    out = fns[0]()
    torch.cuda.synchronize()
    err = rel_err(out.float(), ref.float())
    tag = "default" if cfg == select_config(M) else "sweep"
    add_row("fused_moe", f"{label} experts={distinct} {tag} {cfg.block_m}/{cfg.block_n1}/{cfg.block_n2}/"
            f"{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}", time_single_us(fns[0]), time_graph_us(fns),
            0 if prefill else nbytes, flops, f"rel {err:.2e}", target, bw, fl)


def run_moe_combine(M, bw, fl):
    """The combine over k = K_ROUTED + 1 slots, Triton vs the torch expression it replaced (fp32 sum, then a cast).
    Both rows count the kernel's bytes (M*k*HID fp32 in, M*HID bf16 out), so their %BW compare the same work."""
    k = K_ROUTED + 1
    R = max(1, math.ceil(4 * L2_BYTES / (M * k * HID * 4)))
    slots = [torch.randn(M * k, HID, device="cuda") for _ in range(R)]
    ref = moe_combine_ref(slots[0], M, k, DT)
    err = rel_err(moe_combine_triton(slots[0], M, k, DT).float(), ref.float())
    nbytes = M * k * HID * 4 + M * HID * 2
    for name, fn in (("moe_combine", moe_combine_triton), ("  combine torch", moe_combine_ref)):
        fns = [lambda s=s, fn=fn: fn(s, M, k, DT) for s in slots]
        add_row(name, f"M={M} k={k} H={HID} bf16", time_single_us(fns[0]), time_graph_us(fns), nbytes, 0,
                f"rel {err:.2e}" if name == "moe_combine" else "reference", ">=80% copy BW", bw, fl)


def guarded(fn, *args):
    """Run one case; a failure is logged and recorded, the rest of the suite still runs."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - a benchmark script reports and moves on
        traceback.print_exc()
        ROWS.append(dict(kernel=fn.__name__, shape=str(args[:2]), single_us=0.0, graph_us=0.0, gbps=0.0, pct_bw=0.0,
                         tflops=0.0, pct_bf16=0.0, err=f"FAILED {type(exc).__name__}", target="-"))
        torch.cuda.empty_cache()


def print_table():
    hdr = f"{'kernel':<16} {'shape':<52} {'single us':>9} {'graph us':>9} {'GB/s':>7} {'%BW':>5} {'TF/s':>6} {'%bf16':>5}  {'error':<27} target"
    log("\n" + hdr)
    log("-" * len(hdr))
    for r in ROWS:
        log(f"{r['kernel']:<16} {r['shape']:<52} {r['single_us']:>9.1f} {r['graph_us']:>9.1f} {r['gbps']:>7.0f} "
            f"{r['pct_bw']:>5.1f} {r['tflops']:>6.1f} {r['pct_bf16']:>5.1f}  {r['err']:<27} {r['target']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="m3_suite.json")
    ap.add_argument("--quick", action="store_true", help="skip config sweeps")
    ap.add_argument("--only", choices=["msa", "moe"], default=None, help="run one family of kernels")
    args = ap.parse_args()
    global QUICK
    QUICK = args.quick
    torch.manual_seed(0)
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    bw = measure_copy_bandwidth()
    fl = measure_bf16_gemm_tflops()
    log(f"device {dev}: copy {bw:.0f} GB/s, bf16 GEMM {fl:.0f} TFLOP/s")
    for b, pre in ((1, False), (32, False), (128, False), (1, True)) if args.only != "moe" else ():
        guarded(run_msa, b, pre, bw, fl)
    log(f"msa done {time.time() - t0:.0f}s")
    if args.only == "msa":
        return finish(args, dev, bw, fl, t0)
    W = moe_weights()
    small = [MoETileConfig(16, 32, 64, 128, 4, 4), MoETileConfig(16, 64, 128, 128, 4, 4),
             MoETileConfig(16, 32, 128, 128, 4, 5), MoETileConfig(16, 32, 64, 128, 8, 4)]
    large = [MoETileConfig(128, 128, 128, 64, 8, 3), MoETileConfig(128, 128, 256, 64, 8, 3),
             MoETileConfig(128, 128, 256, 64, 8, 4), MoETileConfig(64, 128, 256, 64, 8, 3)]
    for M in (1, 32, 128):
        guarded(run_moe, M, W, bw, fl, [select_config(M)] + ([] if args.quick else [c for c in small if c != select_config(M)]))
    guarded(run_moe, 8192, W, bw, fl, [select_config(8192)] + ([] if args.quick else [c for c in large if c != select_config(8192)]))
    for M in (32, 8192):
        guarded(run_moe_combine, M, bw, fl)
    finish(args, dev, bw, fl, t0)


def finish(args, dev, bw, fl, t0):
    log(f"all done {time.time() - t0:.0f}s")
    with open(args.out, "w") as f:
        json.dump(dict(device=dev, copy_gbps=bw, bf16_tflops=fl, synthetic=True, rows=ROWS), f, indent=1)
    log(f"device {dev}: copy {bw:.0f} GB/s (ceiling), bf16 GEMM {fl:.0f} TFLOP/s (ceiling); synthetic KV/index-K/"
        f"block tables/router weights")
    print_table()


if __name__ == "__main__":
    main()
