"""MSA block-sparse attention A/B on the GPU: the per-token kernel (today's prefill path) against the query-tile
kernel (TQ tokens x G heads per program over the union of the tile's selected blocks; ladle/kernels/
msa_sparse_attention.py). A script, not a test:

    PYTHONPATH=. python3 benchmarks/gpu_msa_sparse_ab.py --out msa_sparse_ab.json [--time-budget-s 90]  # H200
    python3 benchmarks/gpu_msa_sparse_ab.py --smoke     # CPU: Triton interpreter, tiny shapes, errors only
    PYTHONPATH=. python3 benchmarks/gpu_msa_sparse_ab.py --bit-cast --out msa_bitcast_ab.json  # the FP8 cast A/B

Shapes: one TP4 rank of MiniMax-M3 (16 query heads on 1 KV head, head_dim 128, block 128, top-k 16), bf16
queries, float8_e4m3fn K/V caches with scales 1, one layer call per timed call:
  (a) one 8192-token prefill of one request (context 8K) with "random" selections, made like the indexer would for a
      random model: every token's own block forced, the rest of its top-16 drawn at random among its causally
      visible blocks (all of them when <= 16 are visible);
  (b) the same with "local" selections: own block plus the 15 visible blocks with the highest fixed random score
      per (position // 64, block), so nearby tokens mostly agree, as a trained model's would;
  (c) a decode batch, B = 32 requests at position 8191, random selections (guard: the auto choice stays "token");
  (d) a mixed batch: 4 requests x 2048 prefill tokens (the last chunk of an 8K prompt: positions 6144..8191 over
      6K cached tokens) + 32 decode tokens at position 8191, random selections (the tile kernel's worst case).
Variants: "token (today)" = query_tile 0 with the launcher's defaults (the prefill path before the tile kernel);
"tile4 w4 s2" ... = query_tile 4 / 8 with num_warps / num_stages as named; (c) runs "token (today)" and "auto".

Method: each variant's first call writes into a NaN-poisoned output and is compared with
`msa_sparse_attention_ref` (float32 math on the same bf16 q and fp8 caches; relative Frobenius error, printed per
row, bound 2e-2 for bf16 p/V products); then CUDA-graph replay median per call (gpu_bench_common.time_graph_us)
over R input sets (prefill and mixed: R = 1, a layer call right after its KV was written; decode: R sets with their
own block tables so the pages touched total >= 4x the L2). TFLOP/s counts the useful FLOPs, 4 * Hq * D per
(query, visible selected key); %BW (decode) counts the selected K/V tiles once per token + q + out. "x today" is the
speed-up against "token (today)" of the same case. "blk/t" is the mean number of distinct blocks per tile of the
variant's TQ tokens (1 for the per-token kernel), i.e. the tile kernel's loop trips: the per-token kernel makes
TQ * 16 trips of M = 16 for the same tokens, the tile kernel blk/t trips of M = TQ * 16, so the case's locality
decides the win. SYNTHETIC DATA (randn caches and queries).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported: the CPU interpreter runs the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import L2_BYTES, measure_copy_bandwidth, rel_err, time_graph_us  # noqa: E402
from ladle.kernels._common import quantize_fp8_ref  # noqa: E402
from ladle.kernels.msa_sparse_attention import (launch_path, launch_plan, msa_sparse_attention_ref,  # noqa: E402
                                                msa_sparse_attention_triton)

FP8 = torch.float8_e4m3fn
FULL = dict(hq=16, hkv=1, d=128, bs=128, topk=16, ctx=8192, local=64, dtype=torch.bfloat16, device="cuda",
            bound=2e-2)
SMOKE = dict(hq=4, hkv=1, d=32, bs=16, topk=4, ctx=128, local=8, dtype=torch.float32, device="cpu", bound=1e-4)
TODAY = "token (today)"
PREFILL_VARIANTS = [
    (TODAY, dict(query_tile=0)),
    ("tile4 w4 s2", dict(query_tile=4, num_warps=4, num_stages=2)),
    ("tile4 w4 s3", dict(query_tile=4, num_warps=4, num_stages=3)),
    ("tile4 w8 s2", dict(query_tile=4, num_warps=8, num_stages=2)),
    ("tile4 w8 s3", dict(query_tile=4, num_warps=8, num_stages=3)),
    ("tile8 w8 s2", dict(query_tile=8, num_warps=8, num_stages=2)),
]
DECODE_VARIANTS = [(TODAY, dict(query_tile=0)), ("auto", {})]
# --bit-cast: Triton's e4m3 -> bf16 cast (fp8_bit_cast=False, the kernels before round 13) against the bit-move cast
# (`_common.cache_tile_to`, the default since), with a few launch shapes that the cheaper cast may favour
BITCAST_PREFILL = [
    ("tile4 cvt", dict(query_tile=4, fp8_bit_cast=False)),
    ("tile4 bits", dict(query_tile=4)),
    ("tile4 bits s2", dict(query_tile=4, num_stages=2)),
    ("tile4 bits w8", dict(query_tile=4, num_warps=8)),
    ("tile8 bits w8", dict(query_tile=8, num_warps=8)),
    ("token cvt", dict(query_tile=0, fp8_bit_cast=False)),
    ("token bits", dict(query_tile=0)),
]
BITCAST_DECODE = [
    ("token cvt", dict(query_tile=0, fp8_bit_cast=False)),
    ("token bits", dict(query_tile=0)),
    ("bits splits4", dict(query_tile=0, num_splits=4)),
    ("bits splits16", dict(query_tile=0, num_splits=16)),
]
SMOKE_VARIANTS = [PREFILL_VARIANTS[0], PREFILL_VARIANTS[1], PREFILL_VARIANTS[5], ("auto", {})]


def cases(s: dict, smoke: bool, bit_cast: bool = False) -> list[tuple[str, list, str, list]]:
    """(label, [(context, new tokens)] per request, selection mode, variants) of the four cases (with bit_cast the
    --bit-cast variants and a second decode case, B = 128)."""
    ctx = s["ctx"]
    chunk, nd = (ctx // 4, 32) if not smoke else (ctx // 8, 4)
    prefill = PREFILL_VARIANTS if not smoke else SMOKE_VARIANTS
    decode = DECODE_VARIANTS if not smoke else SMOKE_VARIANTS
    if bit_cast and not smoke:
        prefill, decode = BITCAST_PREFILL, BITCAST_DECODE
    out = [
        (f"(a) prefill T={ctx} random", [(0, ctx)], "random", prefill),
        (f"(b) prefill T={ctx} local", [(0, ctx)], "local", prefill),
        (f"(c) decode B={nd} ctx={ctx}", [(ctx - 1, 1)] * nd, "random", decode),
        (f"(d) mixed 4x{chunk}+{nd}", [(ctx - chunk, chunk)] * 4 + [(ctx - 1, 1)] * nd, "random", prefill),
    ]
    if bit_cast and not smoke:
        out.insert(3, (f"(c) decode B=128 ctx={ctx}", [(ctx - 1, 1)] * 128, "random", decode))
    return out


def selections(s: dict, positions: torch.Tensor, mode: str, gen: torch.Generator) -> torch.Tensor:
    """[Hkv, T, topk] int32 logical block ids, left-packed, -1 after: own block forced, then the highest scores
    among the visible blocks ("random": a fresh score per (token, block); "local": per (position // local, block))."""
    nb = s["ctx"] // s["bs"]
    own = positions // s["bs"]
    blk = torch.arange(nb, device=positions.device)
    out = []
    for _ in range(s["hkv"]):
        if mode == "random":
            score = torch.rand(positions.shape[0], nb, generator=gen, device=positions.device)
        else:
            table = torch.rand(s["ctx"] // s["local"] + 1, nb, generator=gen, device=positions.device)
            score = table[positions // s["local"]]
        score = score.masked_fill(blk[None] > own[:, None], float("-inf")).masked_fill(blk[None] == own[:, None],
                                                                                       float("inf"))
        vals, ids = score.topk(s["topk"], dim=1)
        out.append(torch.where(vals == float("-inf"), -1, ids).int())
    return torch.stack(out).contiguous()


def build_case(s: dict, reqs: list, mode: str, decode: bool) -> dict:
    """Caches (fp8, randn quantized with scale 1), R block-table / query / selection sets, float32 reference of set
    0, and the FLOP / byte counts of set 0."""
    dev, bs, hkv, d = s["device"], s["bs"], s["hkv"], s["d"]
    gen = torch.Generator(device=dev).manual_seed(len(reqs) * 7 + len(mode))
    mb, B = s["ctx"] // bs, len(reqs)
    per_set = B * mb * bs * hkv * d * 2  # K + V bytes of one set's pages (1 byte per fp8 value)
    R = max(1, min(16, -(-4 * L2_BYTES // per_set))) if decode and dev == "cuda" else 1
    num_blocks = R * B * mb + 1
    kc = quantize_fp8_ref(torch.randn(num_blocks, bs, hkv, d, generator=gen, device=dev), 1.0, FP8)
    vc = quantize_fp8_ref(torch.randn(num_blocks, bs, hkv, d, generator=gen, device=dev), 1.0, FP8)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=dev) + 1
    tables = [perm[i * B * mb:(i + 1) * B * mb].view(B, mb).int().contiguous() for i in range(R)]
    positions = torch.cat([torch.arange(c, c + n, device=dev) for c, n in reqs])
    qsl = torch.tensor([0] + [n for _, n in reqs], device=dev).cumsum(0).int()
    T = positions.shape[0]
    qs = [torch.randn(T, s["hq"], d, generator=gen, device=dev).to(s["dtype"]) for _ in range(R)]
    sels = [selections(s, positions, mode, gen) for _ in range(R)]
    ref = msa_sparse_attention_ref(qs[0], kc, vc, tables[0], sels[0], positions, qsl).float()
    sel0 = sels[0].long()
    keys = (positions[None, :, None] - sel0 * bs + 1).clamp(0, bs).masked_fill(sel0 < 0, 0)
    nsel = int((sel0 >= 0).sum())
    return dict(kc=kc, vc=vc, tables=tables, positions=positions, qsl=qsl, qs=qs, sels=sels, ref=ref, R=R, T=T, B=B,
                flops=4 * s["hq"] * d * int(keys.sum()) // hkv,
                bytes=nsel * bs * 2 * d + 2 * T * s["hq"] * d * qs[0].element_size() + sel0.numel() * 4)


def mean_union(sel: torch.Tensor, qsl: torch.Tensor, tq: int) -> float:
    """Mean number of distinct (request, block) keys per tile of tq consecutive tokens (the tile kernel's loop
    trips; the per-token kernel makes tq * top-k of them). sel [Hkv, T, topk]; the last partial tile is dropped."""
    T = sel.shape[1] // tq * tq
    if T == 0:
        return float("nan")
    req = torch.searchsorted(qsl[1:].long(), torch.arange(T, device=sel.device), right=True)
    keys = torch.where(sel[:, :T] >= 0, req[None, :, None] * (1 << 20) + sel[:, :T].long(), -1)
    keys = keys.reshape(sel.shape[0], T // tq, -1).sort(dim=-1).values
    distinct = (keys[..., 1:] != keys[..., :-1]) & (keys[..., 1:] >= 0)
    return float((distinct.sum(-1) + (keys[..., 0] >= 0).long()).float().mean())


def run_variant(s: dict, c: dict, label: str, name: str, kw: dict, bw: float, smoke: bool) -> dict:
    row = dict(case=label, variant=name, R=c["R"])
    t0 = time.time()
    try:
        splits, tq = launch_plan(c["T"], c["B"], s["hkv"], s["topk"], torch.device(s["device"]), None,
                                 kw.get("query_tile"))
        row["path"] = launch_path(tq) + (f" splits={splits}" if splits > 1 else "")
        outs = [torch.full_like(q, float("nan")) for q in c["qs"]]
        fns = [lambda i=i: msa_sparse_attention_triton(c["qs"][i], c["kc"], c["vc"], c["tables"][i], c["sels"][i],
                                                       c["positions"], c["qsl"], out=outs[i], **kw)
               for i in range(c["R"])]
        fns[0]()
        row["rel_err"] = rel_err(outs[0].float(), c["ref"])
        row["ok"] = bool(row["rel_err"] < s["bound"])
        if not smoke:
            us = time_graph_us(fns)
            row.update(us=us, tflops=c["flops"] / (us * 1e-6) / 1e12,
                       pct_bw=100 * c["bytes"] / (us * 1e-6) / 1e9 / bw)
    except Exception as exc:  # noqa: BLE001 - one failing variant must not hide the others
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    row["wall_s"] = round(time.time() - t0, 1)
    print("ROW", json.dumps(row), flush=True)
    return row


def fmt(r: dict) -> str:
    def num(key, spec):
        return format(r[key], spec) if isinstance(r.get(key), (int, float)) else "-"

    ok = {True: "ok", False: "WRONG"}.get(r.get("ok"), "-")
    return (f"{r['variant']:<14} {r['case']:<28} {r.get('path', '-'):<16} {num('blocks_per_tile', '5.1f'):>5} "
            f"{num('us', '9.1f'):>9} "
            f"{num('tflops', '7.1f'):>7} {num('pct_bw', '6.1f'):>6} {num('rel_err', '9.2e'):>9} "
            f"{num('speedup', '6.2f'):>6} {ok:<5} {r.get('error', '')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "msa_sparse_ab.json"))
    ap.add_argument("--time-budget-s", type=float, default=90.0, help="skip the variants left after this")
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    ap.add_argument("--bit-cast", action="store_true",
                    help="A/B of the FP8 cast: Triton's (fp8_bit_cast=False) against the bit-move cast; x base = "
                         "speed-up against each case's first variant")
    args = ap.parse_args(argv)
    s = SMOKE if args.smoke else FULL
    t_start = time.time()
    torch.manual_seed(0)
    bw = float("nan") if args.smoke else measure_copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    rows: list[dict] = []
    for label, reqs, mode, variants in cases(s, args.smoke, args.bit_cast):
        try:
            c = build_case(s, reqs, mode, decode=label.startswith("(c)"))
        except Exception as exc:  # noqa: BLE001
            rows.append(dict(case=label, variant="-", error=f"inputs: {type(exc).__name__}: {str(exc)[:300]}"))
            continue
        auto = launch_plan(c["T"], c["B"], s["hkv"], s["topk"], torch.device(s["device"]))
        unions = {tq: mean_union(c["sels"][0], c["qsl"], tq) for tq in (1, 4, 8)}
        print(f"case {label}: T={c['T']} B={c['B']} R={c['R']} auto path {launch_path(auto[1])} splits={auto[0]}; "
              f"mean distinct blocks per tile of 1 / 4 / 8 tokens: "
              f"{unions[1]:.1f} / {unions[4]:.1f} / {unions[8]:.1f}", flush=True)
        base = None
        for name, kw in variants:
            if time.time() - t_start > args.time_budget_s:
                rows.append(dict(case=label, variant=name, error="skipped: time budget"))
                continue
            row = run_variant(s, c, label, name, kw, bw, args.smoke)
            tq = launch_plan(c["T"], c["B"], s["hkv"], s["topk"], torch.device(s["device"]), None,
                             kw.get("query_tile"))[1]
            row["blocks_per_tile"] = unions.get(tq or 1)
            base = row.get("us") if name == variants[0][0] else base
            if base and row.get("us"):
                row["speedup"] = base / row["us"]
            rows.append(row)
            save(args.out, bw, rows)
        del c
        if not args.smoke:
            torch.cuda.empty_cache()
    save(args.out, bw, rows)
    print(f"\ncopy {bw:.0f} GB/s; Hq {s['hq']} Hkv {s['hkv']} D {s['d']} block {s['bs']} top-{s['topk']}, fp8 KV; "
          f"CUDA-graph us per layer call; x today = speed-up vs the case's first variant; {time.time() - t_start:.0f}s")
    print(f"{'variant':<14} {'case':<28} {'path':<16} {'blk/t':>5} {'us':>9} {'TF/s':>7} {'%BW':>6} {'rel_err':>9} "
          f"{'x today':>6} check")
    for r in rows:
        print(fmt(r))
    bad = [f"{r['variant']} / {r['case']}" for r in rows if not r.get("ok") and "skipped" not in r.get("error", "")]
    print("all variants correct" if not bad else f"NOT CORRECT OR FAILED: {'; '.join(bad)}")
    return 0


def save(path: str, bw: float, rows: list) -> None:
    try:
        with open(path, "w") as f:
            json.dump({"copy_GBps": bw, "shapes": {k: str(v) for k, v in FULL.items()}, "rows": rows}, f, indent=1)
    except OSError as exc:
        print(f"could not write {path}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
