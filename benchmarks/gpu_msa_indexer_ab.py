"""MSA indexer decode A/B on the GPU (issue 11 lever "the index-score decode kernel"). A script, not a test.

    PYTHONPATH=. python3 benchmarks/gpu_msa_indexer_ab.py --out msa_indexer_ab.json [--sweep] [--no-prefill]

Shapes: one TP4 rank of MiniMax-M3 (1 index head, index dim 128, block 128, top-k 16). Decode at B = 32 and 128,
every request at position 8191 (64 visible blocks: 8K context), index-K cache bf16 and float8_e4m3fn (scale 0.5);
then (unless --no-prefill) one 8K-token FP8 prefill as the guard that the prefill path did not get slower.

Configs per case, side by side: "old" = the defaults before this lever (block-table walk in the loop, Triton's
e4m3 cast, 2 stages at decode / 3 at prefill), "new" = the launcher's defaults now (`score_launch`); for FP8 also
"new-cvt" (prefetch, old cast) and "old+bits" (walk, bit cast) to split the gain. --sweep adds num_stages 2/3/4,
pages_per_iter 2, no register cap (maxnreg=0) and num_splits x0.5 / x2 around "new". The "cfg" column is what each
resolved to (splits/stages/page-id vector length/pages per iteration/bit cast/register cap).

Data: small integers (every score exact in fp32, many ties), so each config must equal `msa_indexer_ref` slot for
slot: its outputs are poisoned before the timing and the graph replays' results are compared with the reference
(sets 0 and R-1); "exact" is that check. Method (gpu_bench_common): CUDA-graph replay over R input sets totalling
>= 4x the L2, median per-call time; bytes = index-K pages scanned + queries + selections; % of the copy bandwidth
measured in this run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.gpu_bench_common import L2_BYTES, measure_copy_bandwidth, time_graph_us  # noqa: E402
from ladle.kernels.msa_indexer import msa_indexer_ref, msa_indexer_triton, score_launch  # noqa: E402

DI, BS, TOPK, CTX = 128, 128, 16, 8192
FP8 = torch.float8_e4m3fn
FP8_SCALE = 0.5  # a power of two: scaled scores stay exact
ROWS: list[dict] = []


def log(*a):
    print(*a, flush=True)


def index_case(batch: int, kv_dtype: torch.dtype, prefill: bool, min_bytes: int) -> dict:
    """R block-table / query sets over one integer-valued index-K cache. Decode: `batch` requests at CTX - 1;
    prefill: one request of CTX tokens."""
    nblk = CTX // BS
    reqs, T = (1, CTX) if prefill else (batch, batch)
    per_set = reqs * nblk * BS * DI * torch.empty(0, dtype=kv_dtype).element_size()
    R = 1 if prefill else max(1, min(64, math.ceil(min_bytes / per_set)))
    num_blocks = R * reqs * nblk + 1
    kic = torch.randint(-3, 4, (num_blocks, BS, DI), device="cuda", dtype=torch.int8).to(torch.bfloat16).to(kv_dtype)
    perm = (torch.randperm(num_blocks - 1, device="cuda") + 1).int()
    tables = [perm[i * reqs * nblk:(i + 1) * reqs * nblk].view(reqs, nblk).contiguous() for i in range(R)]
    if prefill:
        positions = torch.arange(CTX, device="cuda")
        qsl = torch.tensor([0, CTX], dtype=torch.int32, device="cuda")
    else:
        positions = torch.full((batch,), CTX - 1, device="cuda", dtype=torch.int64)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    qi = [torch.randint(-3, 4, (T, 1, DI), device="cuda", dtype=torch.int8).to(torch.bfloat16) for _ in range(R)]
    scale = FP8_SCALE if kv_dtype == FP8 else 1.0
    scanned = int(((positions // BS) + 1).sum().item()) if not prefill else nblk
    nbytes = scanned * BS * DI * kic.element_size() + T * DI * 2 + T * TOPK * 4
    return dict(kic=kic, tables=tables, positions=positions, qsl=qsl, qi=qi, R=R, T=T, scale=scale, bytes=nbytes)


def configs(kv_dtype: torch.dtype, prefill: bool, sweep: bool, c: dict) -> list[tuple[str, dict]]:
    """(name, msa_indexer_triton keyword arguments) to time for one case."""
    old = dict(prefetch_pages=False, fp8_bit_cast=False, num_stages=3 if prefill else 2)
    out = [("old", old), ("new", {})]
    if kv_dtype == FP8 and not prefill:
        out += [("new-cvt", dict(fp8_bit_cast=False)), ("old+bits", dict(old, fp8_bit_cast=None))]
    if sweep and not prefill:
        dflt = score_launch(c["qi"][0], c["kic"], c["tables"][0], 16)
        out += [(f"new s{st}", dict(num_stages=st)) for st in (2, 3, 4) if st != dflt.num_stages]
        out += [("new p2", dict(pages_per_iter=2)), ("new nocap", dict(maxnreg=0)),
                (f"new splits{dflt.num_splits // 2}", dict(num_splits=max(1, dflt.num_splits // 2))),
                (f"new splits{dflt.num_splits * 2}", dict(num_splits=dflt.num_splits * 2))]
    return out


def run_case(batch: int, kv_dtype: torch.dtype, prefill: bool, bw: float, sweep: bool) -> None:
    c = index_case(batch, kv_dtype, prefill, 4 * L2_BYTES)
    R, T = c["R"], c["T"]
    label = (f"prefill T={CTX}" if prefill else f"decode B={batch} ctx={CTX}") + f" kv={str(kv_dtype)[6:]} R={R}"
    args = [(c["qi"][i], c["kic"], c["tables"][i], c["positions"], c["qsl"], TOPK) for i in range(R)]
    check = sorted({0, R - 1})
    refs = {i: msa_indexer_ref(*args[i], index_k_scale=c["scale"]) for i in check}
    sels = [torch.empty(1, T, TOPK, dtype=torch.int32, device="cuda") for _ in range(R)]
    base_us = None
    for name, kw in configs(kv_dtype, prefill, sweep, c):
        cfg = score_launch(c["qi"][0], c["kic"], c["tables"][0], 16, kw.get("num_splits"), kw.get("num_stages"),
                           kw.get("prefetch_pages"), kw.get("pages_per_iter", 1), kw.get("fp8_bit_cast"),
                           maxnreg=kw.get("maxnreg"))
        fns = [lambda i=i: msa_indexer_triton(*args[i], out=sels[i], index_k_scale=c["scale"], **kw)
               for i in range(R)]
        for s in sels:
            s.fill_(-7)
        us = time_graph_us(fns)
        torch.cuda.synchronize()
        exact = all(torch.equal(sels[i], refs[i]) for i in check)
        base_us = us if name == "old" else base_us
        gbs = c["bytes"] / (us * 1e-6) / 1e9
        row = dict(case=label, config=name, graph_us=us, gbps=gbs, pct_bw=100 * gbs / bw, speedup=base_us / us,
                   exact=exact, cfg=f"{cfg.num_splits}/{cfg.num_stages}/{cfg.pages_p2}/{cfg.pages_per_iter}/"
                                    f"{int(cfg.fp8_bit_cast)}/{cfg.maxnreg or '-'}")
        ROWS.append(row)
        log(json.dumps(row))
    del c, sels, refs
    torch.cuda.empty_cache()


def print_table(bw: float) -> None:
    hdr = (f"{'case':<40} {'config':<14} {'cfg s/st/pv/p/bits/reg':<23} {'graph us':>9} {'GB/s':>7} {'%BW':>5} "
           f"{'x old':>6}  exact")
    log(f"\ncopy ceiling {bw:.0f} GB/s; bytes = index-K pages scanned + queries + selections\n" + hdr)
    log("-" * len(hdr))
    for r in ROWS:
        log(f"{r['case']:<40} {r['config']:<14} {r['cfg']:<23} {r['graph_us']:>9.1f} {r['gbps']:>7.0f} "
            f"{r['pct_bw']:>5.1f} {r['speedup']:>6.2f}  {'yes' if r['exact'] else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="msa_indexer_ab.json")
    ap.add_argument("--sweep", action="store_true", help="also stages / pages_per_iter / reg cap / splits around new")
    ap.add_argument("--no-prefill", action="store_true", help="skip the 8K FP8 prefill guard")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    bw = measure_copy_bandwidth()
    log(f"device {dev}: copy {bw:.0f} GB/s")
    for batch in (32, 128):
        for kv in (torch.bfloat16, FP8):
            run_case(batch, kv, False, bw, args.sweep)
    if not args.no_prefill:
        run_case(1, FP8, True, bw, False)
    log(f"all done {time.time() - t0:.0f}s")
    with open(args.out, "w") as f:
        json.dump(dict(device=dev, copy_gbps=bw, synthetic=True, rows=ROWS), f, indent=1)
    print_table(bw)


if __name__ == "__main__":
    main()
