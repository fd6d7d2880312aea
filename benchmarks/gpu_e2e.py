"""SmolLM2-135M-shaped model-level benchmarks for benchmarks/gpu_dense_suite.py (dummy weights, bf16, CUDA).

bench_decode_step: one decode step of ladle's LlamaForCausalLM (Triton backend) at B = 1/32/128, eager vs the
  CUDA-graph runner (copy-in + replay), context 640 tokens, random KV.
bench_e2e: ladle's offline `LLM.generate` (512 prompt tokens, 256 generated, ignore_eos, greedy) at B = 1/32/128,
  as shipped (eager) and with ladle.runner.cuda_graph hooked into the runner (the hook the runner should adopt),
  with CPU/GPU time per decode step; then transformers' static-cache `generate` once per batch size.
"""

from __future__ import annotations

import gc
import json
import os
import time

import torch

from gpu_bench_common import time_single_us

from ladle.layers.attention.metadata import AttentionMetadata, ForwardContext, OpBackends, set_forward_context
from ladle.runner.cuda_graph import CudaGraphRunner

BATCHES = (1, 32, 128)
PROMPT, GEN = 512, 256


def _config(model_dir):
    return json.load(open(os.path.join(model_dir, "config.json")))


def bench_decode_step(model_dir, result):
    from ladle.models.llama import LlamaForCausalLM
    from ladle.runner.kv_cache import allocate_kv_caches

    cfg = _config(model_dir)
    dev = torch.device("cuda")
    model = LlamaForCausalLM(cfg, torch.bfloat16, dev)
    model.init_dummy_weights(0)
    bs, ctx, max_b = 16, 640, max(BATCHES)
    nblk = ctx // bs + 1
    caches = allocate_kv_caches(model.kv_cache_specs(), max_b * nblk + 1, bs, torch.bfloat16, dev)
    for c in caches:
        c.key_cache.normal_()
        c.value_cache.normal_()
    graphs = CudaGraphRunner(model, caches, sizes=list(BATCHES), max_blocks_per_seq=64, block_size=bs, device=dev,
                             backends=OpBackends.kernels())
    graphs.capture()
    out = result.setdefault("decode_step", [])
    for b in BATCHES:
        bt = (torch.arange(b * nblk, device=dev, dtype=torch.int32) + 1).view(b, nblk)
        slots = bt[:, ctx // bs].long() * bs + ctx % bs
        md = AttentionMetadata(
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.full((b,), ctx + 1, dtype=torch.int32, device=dev),
            context_lens=torch.full((b,), ctx, dtype=torch.int32, device=dev), block_table=bt, slot_mapping=slots,
            positions=torch.full((b,), ctx, dtype=torch.int64, device=dev), block_size=bs, max_query_len=1,
            max_seq_len=ctx + 1, query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[ctx + 1] * b,
            context_lens_cpu=[ctx] * b, num_actual_tokens=b)
        ids = torch.randint(0, cfg["vocab_size"], (b,), device=dev)

        def eager():
            with torch.inference_mode(), set_forward_context(ForwardContext(md, caches, backends=OpBackends.kernels())):
                return model(ids, md.positions)

        def graph():
            with torch.inference_mode():
                return graphs.run(ids, md.positions, md)

        e, g = eager(), graph()
        err = ((e.float() - g.float()).norm() / e.float().norm()).item()
        t_e, t_g = time_single_us(eager), time_single_us(graph)
        out.append({"batch": b, "ctx": ctx, "eager_us": t_e, "graph_us": t_g, "rel_err_graph_vs_eager": err})
        line = f"decode step SmolLM2 B={b:<3} ctx={ctx}: eager {t_e / 1e3:.2f} ms, graph {t_g / 1e3:.2f} ms, err {err:.1e}"
        result.setdefault("summary_lines", []).append(line)
        print(line, flush=True)


class _StepTimer:
    """Wraps runner._forward (CUDA events) and core.step (wall clock) to split decode steps into GPU forward
    time and everything else (scheduling, input preparation, sampling, the host copy)."""

    def __init__(self, core):
        self.core, self.runner = core, core.runner
        self.orig_forward, self.orig_step = self.runner._forward, core.step
        self.events, self.walls, self.decode = [], [], False
        self.runner._forward = self._forward
        core.step = self._step

    def _forward(self, batch, kv_caches):
        md = batch.attn_metadata
        self.decode = md.max_query_len == 1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.orig_forward(batch, kv_caches)  # the runner's own forward: its CUDA graphs unless enforce_eager
        end.record()
        self.events.append((start, end, self.decode))
        return out

    def _step(self):
        t = time.perf_counter()
        self.decode = False  # set by _forward: a call that ran no forward (--async-scheduling's last drain) is no step
        res = self.orig_step()
        self.walls.append((time.perf_counter() - t, self.decode))
        return res

    def summary(self):
        torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) for s, e, d in self.events if d]
        wall = [w * 1e3 for w, d in self.walls if d]
        if not gpu or not wall:
            return {}
        n = min(len(gpu), len(wall))
        g, w = sum(gpu[-n:]) / n, sum(wall[-n:]) / n
        return {"decode_steps": n, "step_ms": w, "forward_gpu_ms": g, "other_ms": w - g}

    def restore(self):
        self.runner._forward, self.core.step = self.orig_forward, self.orig_step


def bench_e2e(model_dir, result):
    from ladle.core.sampling_params import SamplingParams
    from ladle.engine.llm import LLM

    cfg = _config(model_dir)
    params = SamplingParams(max_tokens=GEN, ignore_eos=True, temperature=0.0)
    g = torch.Generator().manual_seed(0)
    rows = result.setdefault("e2e", [])
    for variant, enforce_eager in (("ladle eager", True), ("ladle graphs", False)):  # one engine per variant
        llm = LLM(model_dir, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=1024,
                  max_num_seqs=128, max_num_batched_tokens=8192, enable_prefix_caching=False,
                  gpu_memory_utilization=0.4, enforce_eager=enforce_eager,
                  engine_core_process=False)  # the step timer wraps the in-process core
        llm.generate([[5] * 16], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))  # warm-up
        for b in BATCHES:
            prompts = torch.randint(100, cfg["vocab_size"] - 100, (b, PROMPT), generator=g).tolist()
            timer = _StepTimer(llm.core)
            try:
                torch.cuda.synchronize()
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            finally:
                timer.restore()
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
            rec = {"variant": variant, "batch": b, "wall_s": wall, "out_tok_s": ntok / wall, **timer.summary()}
            rows.append(rec)
            _print_e2e(result, rec)
        timer = llm = None  # the timer holds the engine: drop both before the next variant profiles its memory
        gc.collect()
        torch.cuda.empty_cache()
    _bench_transformers(cfg, result)


def _bench_transformers(cfg, result):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaForCausalLM(LlamaConfig(**cfg)).to(device="cuda", dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    for b in BATCHES:
        ids = torch.randint(100, cfg["vocab_size"] - 100, (b, PROMPT), generator=g).cuda()
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, cache_implementation="static", pad_token_id=0)
        hf.generate(ids, max_new_tokens=GEN, min_new_tokens=GEN, **kw)  # warm-up at the timed shape (compiles)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=GEN, min_new_tokens=GEN, **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        ntok = (out.shape[1] - PROMPT) * b
        rec = {"variant": "transformers static", "batch": b, "wall_s": wall, "out_tok_s": ntok / wall}
        result.setdefault("e2e", []).append(rec)
        _print_e2e(result, rec)


def _print_e2e(result, rec):
    extra = ""
    if "step_ms" in rec:
        extra = (f"  decode step {rec['step_ms']:.2f} ms = GPU forward {rec['forward_gpu_ms']:.2f} + other "
                 f"{rec['other_ms']:.2f} ms")
    line = f"e2e {rec['variant']:<20} B={rec['batch']:<3} {rec['out_tok_s']:9.0f} out tok/s  wall {rec['wall_s']:.2f} s{extra}"
    result.setdefault("summary_lines", []).append(line)
    print(line, flush=True)
