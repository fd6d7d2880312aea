"""GPU suite for the dense fast paths (issue 5): builds, checks and times every kernel, prints a table last and
writes JSON to --out.

    PYTHONPATH=. python3 benchmarks/gpu_dense_suite.py --out results/ [--skip-e2e] [--model-dir DIR]

One run: (1) re-measures the ceilings (device copy GB/s counting read+write; bf16 8192^3 GEMM TFLOP/s);
(2) per kernel: error against its torch reference in the same run, eager single-launch time, CUDA-graph replay
time over rotated input sets (>= 4x L2), achieved GB/s or TFLOP/s and the fraction of the ceiling;
(3) the SmolLM2-135M decode step, eager vs CUDA graph; (4) optional end-to-end offline generation
(ladle LLM, eager and with the CUDA-graph hook, vs transformers static-cache generate) at 512 in / 256 out.
Decode benchmarks fill the KV cache with random data and random block tables instead of prefilling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench_common import (L2_BYTES, measure_bf16_gemm_tflops, measure_copy_bandwidth, rel_err,  # noqa: E402
                              time_graph_us, time_single_us)

from ladle.kernels import apply_rope, apply_rope_ref, paged_attention, rms_norm, rms_norm_ref, rope_cos_sin_cache  # noqa: E402
from ladle.kernels import store_kvcache, store_kvcache_ref  # noqa: E402
from ladle.kernels.attention_decode import choose_num_splits, default_decode_config  # noqa: E402
from ladle.kernels.attention_prefill import default_prefill_config, prefill_attention  # noqa: E402
from ladle.kernels.sampling import race, race_ref  # noqa: E402
from ladle.core.outputs import NewRequestData  # noqa: E402
from ladle.core.sampling_params import SamplingParams  # noqa: E402
from ladle.layers.attention.metadata import AttentionMetadata  # noqa: E402
from ladle.observe import dispatch  # noqa: E402
from ladle.runner.request_state import RequestState, build_sampling_tensors, build_static_sampling  # noqa: E402
from ladle.runner.sampler import Sampler  # noqa: E402

BF16 = torch.bfloat16
ROWS: list[dict] = []
RESULT: dict = {"rows": ROWS}
SHAPES = {  # (Hq, Hkv, D, block_size)
    "smollm2": (9, 3, 64, 16),
    "llama8b": (32, 8, 128, 16),
    "m3dense": (16, 1, 128, 128),  # one TP4 rank of MiniMax-M3's dense layers
}


def row(name, shape, graph_us, single_us, amount, unit, ceiling, err, **extra):
    rate = amount / (graph_us * 1e-6) / (1e9 if unit == "GB/s" else 1e12) if graph_us else float("nan")
    r = {"kernel": name, "shape": shape, "graph_us": graph_us, "single_us": single_us, "rate": rate, "unit": unit,
         "frac": rate / ceiling, "err": err, **extra}
    ROWS.append(r)
    print(f"  {name:<16} {shape:<34} graph {graph_us:9.1f} us  single {single_us:9.1f} us  {rate:8.1f} {unit}"
          f"  {100 * r['frac']:5.1f}%  err {err:.2e}", flush=True)


def rotations(per_call_bytes: int, cap: int = 32) -> int:
    return max(1, min(cap, -(-4 * L2_BYTES // max(1, per_call_bytes))))


def make_md(q_lens, seq_lens, block_table, block_size):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    dev = block_table.device
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        context_lens=torch.tensor([s - q for s, q in zip(seq_lens, q_lens)], dtype=torch.int32, device=dev),
        block_table=block_table, slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.int64, device=dev),
        positions=torch.zeros(qsl[-1], dtype=torch.int64, device=dev), block_size=block_size,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens),
        context_lens_cpu=[s - q for s, q in zip(seq_lens, q_lens)], num_actual_tokens=qsl[-1])


def bench_small_kernels(bw):
    print("elementwise / store kernels", flush=True)
    hq, hkv, d, bs = SHAPES["smollm2"]
    t = 32768
    kvw = hkv * d
    per_call = 4 * t * kvw * 2
    r = rotations(per_call)
    nslots = r * t + bs
    kc = torch.randn(nslots // bs + 1, bs, hkv, d, dtype=BF16, device="cuda")
    vc = torch.randn_like(kc)
    ks = [torch.randn(t, hkv, d, dtype=BF16, device="cuda") for _ in range(r)]
    vs = [torch.randn(t, hkv, d, dtype=BF16, device="cuda") for _ in range(r)]
    perm = torch.randperm(nslots - bs, device="cuda") + bs
    slots = [perm[i * t:(i + 1) * t].clone() for i in range(r)]
    slots[0][::97] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    store_kvcache(ks[0], vs[0], kc, vc, slots[0])
    store_kvcache_ref(ks[0], vs[0], kc2, vc2, slots[0])
    err = float((kc != kc2).sum() + (vc != vc2).sum())  # exact copy: count of differing elements
    fns = [lambda i=i: store_kvcache(ks[i], vs[i], kc, vc, slots[i]) for i in range(r)]
    row("kv_store", f"T={t} Hkv={hkv} D={d} x{r}", time_graph_us(fns), time_single_us(fns[0]), per_call, "GB/s", bw,
        err)
    del kc, vc, kc2, vc2, ks, vs

    h = 576
    t = 65536
    per_call = 4 * t * h * 2
    r = rotations(per_call)
    xs = [torch.randn(t, h, dtype=BF16, device="cuda") for _ in range(r)]
    rs = [torch.randn(t, h, dtype=BF16, device="cuda") for _ in range(r)]
    w = torch.randn(h, dtype=BF16, device="cuda")
    out, res = rms_norm(xs[0], w, 1e-5, residual=rs[0])
    ref_out, ref_res = rms_norm_ref(xs[0], w, 1e-5, residual=rs[0])
    err = max(rel_err(out, ref_out), rel_err(res, ref_res))
    fns = [lambda i=i: rms_norm(xs[i], w, 1e-5, residual=rs[i]) for i in range(r)]
    row("rmsnorm+residual", f"T={t} H={h} x{r}", time_graph_us(fns), time_single_us(fns[0]), per_call, "GB/s", bw,
        err)
    del xs, rs

    t = 65536
    per_call = 2 * t * (hq + hkv) * d * 2 + t * d * 4  # q,k read+write + cos/sin rows
    r = rotations(per_call)
    qkvs = [torch.randn(t, (hq + 2 * hkv) * d, dtype=BF16, device="cuda") for _ in range(r)]
    cache = rope_cos_sin_cache(d, 8192, 100000.0, device="cuda")
    pos = torch.randint(0, 8192, (t,), device="cuda")

    def views(x):
        return x[:, : hq * d].view(t, hq, d), x[:, hq * d:(hq + hkv) * d].view(t, hkv, d)

    a, b = qkvs[0].clone(), qkvs[0].clone()
    apply_rope(*views(a), pos, cache)
    apply_rope_ref(*views(b), pos, cache)
    err = rel_err(a, b)
    fns = [lambda i=i: apply_rope(*views(qkvs[i]), pos, cache) for i in range(r)]
    row("rope", f"T={t} Hq={hq} Hk={hkv} D={d} x{r}", time_graph_us(fns), time_single_us(fns[0]), per_call, "GB/s",
        bw, err)
    del qkvs


def decode_case(shape_name, batch, ctx, device="cuda"):
    """Decode inputs rotated over r sets (r from `rotations`, so the sets exceed L2): random bf16 K/V caches, block
    tables that are random permutations of the physical blocks [r, batch, blocks per seq], queries and outputs.
    Returns (shape constants (hq, hkv, d, bs), bytes per call, r, blocks per seq, kc, vc, tables, qs, outs)."""
    hq, hkv, d, bs = SHAPES[shape_name]
    per_call = batch * ctx * hkv * d * 2 * 2
    r = rotations(per_call)
    nblk = -(-ctx // bs)
    total_blocks = r * batch * nblk + 1
    kc = torch.empty(total_blocks, bs, hkv, d, dtype=BF16, device=device).normal_()
    vc = torch.empty_like(kc).normal_()
    tables = (torch.randperm(total_blocks - 1, device=device) + 1).to(torch.int32).view(r, batch, nblk)
    qs = [torch.randn(batch, hq, d, dtype=BF16, device=device) for _ in range(r)]
    outs = [torch.empty_like(q) for q in qs]
    return (hq, hkv, d, bs), per_call, r, nblk, kc, vc, tables, qs, outs


def bench_decode(shape_name, batch, ctx, bw):
    (hq, hkv, d, bs), per_call, r, nblk, kc, vc, perm, qs, outs = decode_case(shape_name, batch, ctx)
    mds = [make_md([1] * batch, [ctx] * batch, perm[i].contiguous(), bs) for i in range(r)]
    scale = d**-0.5
    paged_attention(qs[0], kc, vc, mds[0], scale, out=outs[0])
    n = min(batch, 4)  # float32 reference on a few sequences
    sub = make_md([1] * n, [ctx] * n, mds[0].block_table[:n].contiguous(), bs)
    from ladle.kernels import paged_attention_ref
    err = rel_err(outs[0][:n], paged_attention_ref(qs[0][:n], kc, vc, sub, scale).float())
    fns = [lambda i=i: paged_attention(qs[i], kc, vc, mds[i], scale, out=outs[i]) for i in range(r)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_num_splits(batch, hkv, nblk, bs, default_decode_config(d, bs, False, batch, hkv, sms)["TILE_N"],
                               sms)
    row("attn_decode", f"{shape_name} B={batch} ctx={ctx} x{r}", time_graph_us(fns), time_single_us(fns[0]),
        per_call, "GB/s", bw, err, num_splits=splits)
    del kc, vc


DECODE_CONFIGS = [  # (TILE_N, num_warps, num_stages, split multiplier vs the default rule)
    (128, 4, 3, 1), (64, 4, 3, 1), (64, 4, 3, 2), (128, 4, 3, 2), (128, 8, 3, 1), (128, 4, 4, 1), (64, 4, 4, 4),
    (32, 4, 4, 2),
]


def bench_decode_sweep(shape_name, batch, ctx, bw):
    """Tile / warps / stages / split-count variants of the decode kernel (graph-timed, rotated caches)."""
    from ladle.kernels.attention_decode import decode_attention
    (hq, hkv, d, bs), per_call, r, nblk, kc, vc, bts, qs, outs = decode_case(shape_name, batch, ctx)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = []
    for tile, warps, stages, mult in DECODE_CONFIGS:
        splits = min(64, mult * choose_num_splits(batch, hkv, nblk, bs, tile, sms))
        cfg = {"TILE_N": tile, "num_warps": warps, "num_stages": stages}
        fns = [lambda i=i, cfg=cfg, splits=splits: decode_attention(qs[i], kc, vc, bts[i], qsl, sl, d**-0.5,
                                                                    out=outs[i], num_splits=splits, config=cfg)
               for i in range(r)]
        try:
            us = time_graph_us(fns)
        except Exception as exc:
            res.append({"config": cfg, "splits": splits, "error": str(exc)[:200]})
            continue
        gbps = per_call / (us * 1e-6) / 1e9
        res.append({"config": cfg, "splits": splits, "graph_us": us, "GBps": gbps, "frac": gbps / bw})
        print(f"    sweep {shape_name} B={batch}: {cfg} splits={splits}: {us:.1f} us {gbps:.0f} GB/s "
              f"{100 * gbps / bw:.1f}%", flush=True)
    RESULT.setdefault("decode_sweep", []).append({"shape": shape_name, "batch": batch, "ctx": ctx, "variants": res})
    best = min((x for x in res if "graph_us" in x), key=lambda x: x["graph_us"])
    RESULT.setdefault("summary_lines", []).append(
        f"decode sweep {shape_name} B={batch} ctx={ctx}: best {best['config']} splits={best['splits']} "
        f"{best['GBps']:.0f} GB/s = {100 * best['frac']:.1f}% of copy")
    del kc, vc


def _prefill_ref(q, kc, vc, bt, seq, q_len, scale):
    """float32 causal reference, one KV head at a time (bounded memory)."""
    hq, d = q.shape[1:]
    hkv = kc.shape[2]
    g = hq // hkv
    nb = -(-seq // kc.shape[1])
    k = kc[bt[0, :nb].long()].reshape(-1, hkv, d)[:seq].float()
    v = vc[bt[0, :nb].long()].reshape(-1, hkv, d)[:seq].float()
    out = torch.empty(q_len, hq, d, dtype=torch.float32, device=q.device)
    qpos = torch.arange(seq - q_len, seq, device=q.device)[:, None]
    mask = torch.arange(seq, device=q.device)[None, :] > qpos
    for h in range(hkv):
        qh = q[:, h * g:(h + 1) * g].float().transpose(0, 1)  # [g, q_len, d]
        s = (qh @ k[:, h].T) * scale
        s.masked_fill_(mask, float("-inf"))
        out[:, h * g:(h + 1) * g] = (s.softmax(-1) @ v[:, h]).transpose(0, 1)
    return out


PREFILL_CONFIGS = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
]


def bench_prefill(shape_name, q_len, ctx, tflops_ceiling):
    hq, hkv, d, bs = SHAPES[shape_name]
    seq = q_len + ctx
    nb = -(-seq // bs)
    kc = torch.empty(nb + 1, bs, hkv, d, dtype=BF16, device="cuda").normal_()
    vc = torch.empty_like(kc).normal_()
    bt = (torch.randperm(nb, device="cuda") + 1).to(torch.int32)[None, :].contiguous()
    md = make_md([q_len], [seq], bt, bs)
    q = torch.randn(q_len, hq, d, dtype=BF16, device="cuda")
    out = torch.empty_like(q)
    scale = d**-0.5
    flops = 4 * hq * d * (q_len * ctx + q_len * (q_len + 1) // 2)
    paged_attention(q, kc, vc, md, scale, out=out)
    err = rel_err(out, _prefill_ref(q, kc, vc, bt, seq, q_len, scale))
    default = default_prefill_config(d, False)
    sweep = []
    for cfg in PREFILL_CONFIGS:
        fn = lambda cfg=cfg: prefill_attention(q, kc, vc, md.block_table, md.query_start_loc, md.seq_lens, scale,  # noqa: E731
                                               out=out, config=cfg)
        try:
            single = time_single_us(fn)
            graph = time_graph_us([fn] * 4, replays=10)
        except Exception as exc:  # a config may not fit shared memory
            sweep.append({"config": cfg, "error": str(exc)[:200]})
            continue
        sweep.append({"config": cfg, "graph_us": graph, "single_us": single,
                      "tflops": flops / (graph * 1e-6) / 1e12})
    ok = [s for s in sweep if "graph_us" in s]
    best = min(ok, key=lambda s: s["graph_us"])
    dflt = next((s for s in ok if s["config"] == default), best)
    kind = "prefill" if ctx == 0 else f"chunk(ctx={ctx})"
    row("attn_prefill", f"{shape_name} {kind} q={q_len} default", dflt["graph_us"], dflt["single_us"], flops, "TFLOP/s",
        tflops_ceiling, err, config=dflt["config"])
    row("attn_prefill", f"{shape_name} {kind} q={q_len} best", best["graph_us"], best["single_us"], flops, "TFLOP/s",
        tflops_ceiling, err, config=best["config"], sweep=sweep)
    del kc, vc


def engine_sampling_tensors(b, v, penalties, rng):
    """SamplingTensors for b requests with mixed random SamplingParams (top-k off on a third of them, i.e. 0),
    built as ModelRunner builds them: RequestState.from_new, the cached build_static_sampling, then
    build_sampling_tensors with device positions. penalties: repetition/frequency/presence on every row, with
    512-token prompts and 128 outputs (the penalty pass's count tensors)."""
    states = []
    for i in range(b):
        sp = SamplingParams(temperature=rng.uniform(0.3, 1.3), top_k=rng.choice([0, rng.randint(1, 200)]),
                            top_p=rng.uniform(0.5, 1.0), min_p=rng.uniform(0.0, 0.05), seed=rng.getrandbits(62),
                            repetition_penalty=1.1 if penalties else 1.0, frequency_penalty=0.2 if penalties else 0.0,
                            presence_penalty=0.1 if penalties else 0.0)
        prompt = [rng.randrange(v) for _ in range(512)]
        outputs = [rng.randrange(v) for _ in range(128)]
        states.append(RequestState.from_new(NewRequestData(f"r{i}", prompt, outputs, sp), [0]))
    static = build_static_sampling(states, v, torch.device("cuda"))
    positions = torch.tensor([640] * b, dtype=torch.int64, device="cuda")
    return build_sampling_tensors(states, positions, v, torch.device("cuda"), static)


def bench_sampler(bw):
    """The race alone, then the engine's Sampler.sample (penalties/bans + ladle.kernels.sampling.sample), each
    checked in the same run against the torch reference draw (err = token mismatches)."""
    import random
    b, v = 128, 49152
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = [torch.randn(b, v, device="cuda", generator=g) * 4 for _ in range(8)]
    seeds = torch.randint(0, 2**62, (b,), device="cuda", generator=g)
    steps = torch.randint(0, 1000, (b,), device="cuda", generator=g)
    probs = torch.softmax(logits[0], -1)
    err = float((race(probs, seeds, steps) != race_ref(probs, seeds, steps)).sum())  # token mismatches
    fns = [lambda i=i: race(torch.softmax(logits[i], -1), seeds, steps) for i in range(8)]
    row("sample_race", f"B={b} V={v} x8 (softmax+race)", time_graph_us(fns), time_single_us(fns[0]),
        2 * b * v * 4 + b * v * 4, "GB/s", bw, err)
    sampler, reference = Sampler(torch.device("cuda")), Sampler(torch.device("cuda"), use_triton=False)
    for name, penalties in (("sample_full", False), ("sample_full+pen", True)):
        t = engine_sampling_tensors(b, v, penalties, random.Random(1))
        err = float((sampler.sample(logits[0], t) != reference.sample(logits[0], t)).sum())  # token mismatches
        fns = [lambda i=i, t=t: sampler.sample(logits[i], t) for i in range(8)]
        row(name, f"B={b} V={v} x8 Sampler.sample", time_graph_us(fns), time_single_us(fns[0]), b * v * 4, "GB/s",
            bw, err)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--model-dir", default=".bench_assets/smollm2-135m")
    ap.add_argument("--only", default="", help="comma list of sections: small,decode,sweep,prefill,sampler,step,e2e")
    ap.add_argument("--decode-batches", default="1,32,128")
    ap.add_argument("--decode-shapes", default="smollm2,llama8b,m3dense")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    want = lambda s: not only or s in only  # noqa: E731
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    RESULT["device"] = {"name": props.name, "sms": props.multi_processor_count, "torch": torch.__version__}
    t0 = time.time()
    bw = measure_copy_bandwidth()
    tf = measure_bf16_gemm_tflops()
    RESULT["ceilings"] = {"copy_GBps": bw, "bf16_gemm_TFLOPs": tf}
    print(f"ceilings: copy {bw:.0f} GB/s, bf16 GEMM {tf:.0f} TFLOP/s", flush=True)

    def section(name, fn, *a):
        if not want(name):
            return
        try:
            fn(*a)
        except Exception:
            traceback.print_exc()
            RESULT.setdefault("errors", []).append(f"{name}{a}: {traceback.format_exc()[-600:]}")
        torch.cuda.empty_cache()
        json.dump(RESULT, open(os.path.join(args.out, "gpu_dense_suite.json"), "w"), indent=1, default=str)

    section("small", bench_small_kernels, bw)
    for shape in args.decode_shapes.split(","):
        for batch in map(int, args.decode_batches.split(",")):
            section("decode", bench_decode, shape, batch, 8192, bw)
    section("sweep", bench_decode_sweep, "smollm2", 32, 8192, bw)
    section("sweep", bench_decode_sweep, "m3dense", 32, 8192, bw)
    for shape in ("smollm2", "llama8b"):
        section("prefill", bench_prefill, shape, 8192, 0, tf)
    section("prefill", bench_prefill, "llama8b", 2048, 6144, tf)
    section("sampler", bench_sampler, bw)
    if want("step") or want("e2e"):
        import gpu_e2e
        section("step", gpu_e2e.bench_decode_step, args.model_dir, RESULT)
        if not args.skip_e2e:
            section("e2e", gpu_e2e.bench_e2e, args.model_dir, RESULT)
    RESULT["dispatch"] = dispatch.snapshot()
    RESULT["wall_s"] = time.time() - t0
    json.dump(RESULT, open(os.path.join(args.out, "gpu_dense_suite.json"), "w"), indent=1, default=str)
    print_table(bw, tf)


def print_table(bw, tf):
    print("\n" + dispatch.format_table())
    print(f"\n=== GPU dense suite on {RESULT['device']['name']}: copy {bw:.0f} GB/s, bf16 GEMM {tf:.0f} TFLOP/s ===")
    print(f"{'kernel':<16} {'shape':<40} {'graph us':>9} {'single us':>10} {'rate':>9} {'unit':<7} {'%ceil':>6} "
          f"{'err':>8}")
    for r in ROWS:
        print(f"{r['kernel']:<16} {r['shape']:<40} {r['graph_us']:9.1f} {r['single_us']:10.1f} {r['rate']:9.1f} "
              f"{r['unit']:<7} {100 * r['frac']:6.1f} {r['err']:8.1e}")
    for line in RESULT.get("summary_lines", []):
        print(line)
    for e in RESULT.get("errors", []):
        print("ERROR", e.splitlines()[-1] if e else e)


if __name__ == "__main__":
    main()
