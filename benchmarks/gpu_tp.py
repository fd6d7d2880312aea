"""Multi-GPU runs (issue 13): TP1 / TP2 / TP4 greedy agreement, the all-reduce plane, and the served deployment
shape, all in one call per machine kind. A script, not a test.

Device command (one call on `nvidia-h200-x2` or `nvidia-h200-x4`; every rank gets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 from ladle/distributed, and this script sets them too):

    export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 && set -o pipefail &&
    python3 benchmarks/gpu_tp.py --out $OUT/gpu_tp.json [--serve-model DIR --serve-tp 4] 2>&1 | tee $OUT/gpu_tp.log

CPU smoke (gloo, tiny M3, TP 1 and 2, no serve part): `.venv/bin/python benchmarks/gpu_tp.py --smoke --out
/tmp/gpu_tp_smoke.json`.

Parts (each one's failure is recorded in the JSON and the next part still runs):
1. correctness: for each TP size (default: 1, 2, 4 up to the GPU count) `LLM(..., tensor_parallel_size=tp)` greedy
   on the `small` M3 preset (dummy weights; `--smoke`: `tiny`) and on SmolLM2 shapes (the default GGUF's config with
   dummy weights), against TP1 in the same run: equal, or at the first divergence each side's token is in the
   other's top 5 (bf16 near ties, the rule of the GPU greedy tests); CUDA graphs on (engine default).
2. communication plane: a standalone NCCL (gloo on CPU) all-reduce of [B, hidden] in the model dtype for B = 1, 32,
   128, timed with CUDA events per call over --ar-iters, times the calls per decode step (2 per layer + 1 for the
   embedding; + the LM-head all-gather), and the bus bandwidth of a 256 MiB all-reduce in the same run (nccl-tests'
   busbw = bytes x 2 (n-1)/n / time). The engine's own per-step profile is not taken here (see NOTES).
3. deployment shape (--serve-model DIR, a config-only checkpoint dir, e.g. the 60-layer M3): `ladle serve
   --tensor-parallel-size --serve-tp --load-format dummy` + `ladle bench serve` with the published line (random
   8192 / 1024, range ratio 0.1, c = 32 and 128); output tok/s/GPU against the published MI355X MXFP8 TP4 numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})

PUBLISHED_TP4_PER_GPU = {32: 342.4, 128: 623.7}  # MI355X MXFP8 TP4, output tok/s/GPU (issue 13)
PROMPTS = [[5, 9, 3, 17, 22, 40, 8, 11, 30, 2, 19, 7] * 6, [14, 3, 25, 61, 7, 33, 8], [100, 200, 300, 400] * 10]


def _tp_sizes(requested: list[int], smoke: bool) -> list[int]:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    limit = 2 if smoke or not gpus else gpus
    return [t for t in requested if t <= limit]


def _greedy(model_dir: str, tp: int, max_tokens: int, engine: dict) -> list[dict]:
    """Greedy tokens and top-5 logprobs per prompt at tensor-parallel size tp."""
    from ladle.core.sampling_params import SamplingParams
    from ladle.engine.llm import LLM

    llm = LLM(model_dir, tensor_parallel_size=tp, **engine)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5,
                                                    ignore_eos=True))
        res = []
        for o in outs:
            c = o.outputs[0]
            # per step a dict token id -> Logprob (vLLM's form): the top 5, and the sampled token once
            tops = [[tok for tok, lp in step.items() if lp.rank <= 5] for step in (c.logprobs or [])]
            res.append({"tokens": list(c.token_ids), "top5": [[int(t) for t in s] for s in tops]})
        return res
    finally:
        llm.shutdown()


def _agree(ref: list[dict], got: list[dict]) -> dict:
    """Per prompt: equal, or the first divergence passes the top-5 rule (each side's token in the other's top 5)."""
    rows = []
    for a, b in zip(ref, got):
        div = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        ok = div is None or (a["tokens"][div] in (b["top5"][div] if div < len(b["top5"]) else []) and
                             b["tokens"][div] in (a["top5"][div] if div < len(a["top5"]) else []))
        rows.append({"first_divergence": div, "ok": bool(ok)})
    return {"prompts": rows, "ok": all(r["ok"] for r in rows)}


def part_correctness(args, sizes: list[int], engine: dict) -> dict:
    from ladle.models.loader import default_model_path
    from ladle.tools.checkpoint_m3 import make_checkpoint

    out: dict = {}
    tmp = tempfile.mkdtemp(prefix="gpu_tp_")
    models = {"m3_" + args.m3_preset: make_checkpoint(os.path.join(tmp, "m3"), args.m3_preset, config_only=True)}
    if not args.smoke:
        try:
            models["smollm2"] = default_model_path()
        except FileNotFoundError as e:
            out["smollm2"] = {"skipped": str(e)}
    for name, path in models.items():
        res: dict = {}
        try:
            t0 = time.monotonic()
            ref = _greedy(path, 1, args.max_tokens, engine)
            res["tp1_s"] = time.monotonic() - t0
            for tp in sizes:
                if tp == 1:
                    continue
                t0 = time.monotonic()
                res[f"tp{tp}"] = _agree(ref, _greedy(path, tp, args.max_tokens, engine))
                res[f"tp{tp}"]["seconds"] = time.monotonic() - t0
        except Exception:  # noqa: BLE001 — recorded, the next part runs
            res["error"] = traceback.format_exc()
        out[name] = res
        print(f"[correctness] {name}: {json.dumps(res)[:600]}", flush=True)
    return out


def _allreduce_rank(rank: int, world: int, port: int, hidden: int, batches: list[int], iters: int, q) -> None:
    import torch
    import torch.distributed as dist

    from ladle.distributed import init_tensor_parallel, tensor_model_parallel_all_reduce

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    init_tensor_parallel(rank, world, "127.0.0.1", port, dev.type)
    dtype = torch.bfloat16 if cuda else torch.float32
    res = {}

    def timed(x: torch.Tensor, n: int) -> float:
        for _ in range(3):
            tensor_model_parallel_all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            tensor_model_parallel_all_reduce(x)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    for b in batches:
        x = torch.randn(b, hidden, dtype=dtype, device=dev)
        res[b] = {"bytes": x.numel() * x.element_size(), "seconds": timed(x, iters)}
    big = torch.randn(128 << 20 if cuda else 4 << 20, dtype=dtype, device=dev)
    t = timed(big, 10 if cuda else 2)
    nbytes = big.numel() * big.element_size()
    res["busbw_GBps"] = nbytes * 2 * (world - 1) / world / t / 1e9
    res["big_bytes"] = nbytes
    if rank == 0:
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def part_allreduce(args, sizes: list[int], hidden: int, num_layers: int) -> dict:
    import multiprocessing as mp

    from ladle.distributed import free_port

    out = {}
    for world in [t for t in sizes if t > 1]:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, hidden, args.batches, args.ar_iters, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            res = q.get(timeout=600)
            per_step = 2 * num_layers + 1
            for b in args.batches:
                res[b]["calls_per_decode_step"] = per_step
                res[b]["ms_per_decode_step"] = 1e3 * per_step * res[b]["seconds"]
            out[f"tp{world}"] = {str(k): v for k, v in res.items()}
        except Exception:  # noqa: BLE001
            out[f"tp{world}"] = {"error": traceback.format_exc()}
        for p in procs:
            p.join(60)
        print(f"[all-reduce] tp{world}: {json.dumps(out[f'tp{world}'])[:800]}", flush=True)
    return out


def part_serve(args) -> dict:
    """ladle serve at --serve-tp + ladle bench serve, c = 32 and 128 (published line)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from ladle_serve_process import LadleServeProcess

    log = os.path.join(os.path.dirname(os.path.abspath(args.out)), "gpu_tp_serve.log")
    serve_args = [args.serve_model, "--tensor-parallel-size", str(args.serve_tp), "--load-format", "dummy",
                  "--max-model-len", "10240", "--no-enable-prefix-caching", *args.serve_extra.split()]
    server = LadleServeProcess(serve_args, log).start(timeout=1800)
    out: dict = {"serve_args": serve_args}
    try:
        for c in args.concurrency:
            result = os.path.join(tempfile.mkdtemp(), f"c{c}.json")
            cmd = [sys.executable, "-m", "ladle", "bench", "serve", "--base-url", server.url, "--dataset-name",
                   "random", "--random-input-len", "8192", "--random-output-len", "1024", "--random-range-ratio",
                   "0.1", "--max-concurrency", str(c), "--num-prompts", str(c * args.prompts_per_slot),
                   "--ignore-eos", "--save-result", "--result-filename", result, "--num-gpus", str(args.serve_tp)]
            subprocess.run(cmd, check=True, timeout=3600)
            with open(result) as f:
                r = json.load(f)
            per_gpu = r["output_throughput"] / args.serve_tp
            out[f"c{c}"] = {"output_throughput": r["output_throughput"], "per_gpu": per_gpu,
                            "published_mi355x_mxfp8_tp4_per_gpu": PUBLISHED_TP4_PER_GPU.get(c)}
            print(f"[serve] c={c}: {out[f'c{c}']}", flush=True)
    finally:
        out["exit"] = server.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny M3, TP 1 and 2 (gloo), no serve part")
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--m3-preset", default=None, help="default small (tiny with --smoke)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--ar-iters", type=int, default=200)
    ap.add_argument("--serve-model", default=None, help="config-only checkpoint dir for the deployment-shape run")
    ap.add_argument("--serve-tp", type=int, default=4)
    ap.add_argument("--serve-extra", default="", help="more `ladle serve` flags (e.g. the FP8 issue's)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--prompts-per-slot", type=int, default=4)
    args = ap.parse_args(argv)
    args.m3_preset = args.m3_preset or ("tiny" if args.smoke else "small")
    from ladle.tools.checkpoint_m3 import text_config

    sizes = _tp_sizes(args.tp_sizes, args.smoke)
    engine = dict(load_format="dummy", max_model_len=1024)
    if args.smoke:
        engine.update(kv_cache_memory_bytes=8 << 20)
        args.max_tokens, args.ar_iters = min(args.max_tokens, 8), min(args.ar_iters, 5)
    report: dict = {"tp_sizes": sizes, "argv": sys.argv[1:]}
    report["correctness"] = part_correctness(args, sizes, engine)
    tc = text_config(args.m3_preset)
    report["allreduce"] = part_allreduce(args, sizes, tc["hidden_size"], tc["num_hidden_layers"])
    if args.serve_model and not args.smoke:
        try:
            report["serve"] = part_serve(args)
        except Exception:  # noqa: BLE001
            report["serve"] = {"error": traceback.format_exc()}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1)[:4000])
    ok = all(v.get("ok", True) for m in report["correctness"].values() for k, v in m.items()
             if isinstance(v, dict) and k.startswith("tp"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
