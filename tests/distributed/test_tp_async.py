"""Asynchronous scheduling with tensor parallelism end to end (CPU, gloo, float32, dummy weights): `LLM` at TP = 2
(tiny Llama) and TP = 2 / 4 (tiny MiniMax-M3) with --async-scheduling gives the greedy tokens of TP = 1 and TP = 2
synchronous runs, for a mixed batch (prompt lengths, max_tokens, a stop token id, a seeded random request) with
preemption forced by a small pool (checked to happen), and for a batch with a repetition penalty (the pipeline
drains: dispatch record); the dispatch record shows overlapped steps."""

from __future__ import annotations

import json
import os
import random

import pytest

from ladle.core.sampling_params import SamplingParams
from ladle.engine.llm import LLM
from ladle.observe import dispatch
from ladle.tools.checkpoint_m3 import make_checkpoint
from ladle.tools.minimax_m3_tokenizer import write_tokenizer

from distributed.tp_harness import LLAMA

ENGINE = dict(load_format="dummy", max_model_len=64, dtype="float32", max_num_batched_tokens=32)
POOL_BLOCKS = 7  # blocks per rank (block 0 is the null block): the mixed batch needs more, so requests are preempted


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("llama-tp-async"))
    config = {**LLAMA, "vocab_size": 512, "tie_word_embeddings": False, "model_type": "llama",
              "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    write_tokenizer(out, 512, 0, 1, 256)
    return out


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("m3-tp-async") / "tiny"), "tiny", config_only=True)


def _prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _finishes(outs) -> list[tuple]:
    return [(tuple(c.token_ids), c.finish_reason) for o in outs for c in o.outputs]


def _mixed_params(base: list[tuple]) -> list[SamplingParams]:
    """Length limits, a stop token id seen in the output (from the synchronous TP = 1 greedy run `base`), a seeded
    random request (each rank fills its placeholders from its own sampled ids: they must agree)."""
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(len(base))]
    params[1] = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[base[1][0][7]])
    params[4] = SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=20, ignore_eos=True)
    return params


def _pool_bytes(family: str, tp: int, block_size: int) -> int:
    """--kv-cache-memory-bytes giving each rank of a TP = `tp` group POOL_BLOCKS blocks (its shard's cache specs)."""
    import torch

    from ladle.models.llama import LlamaForCausalLM
    from ladle.models.minimax_m3 import MiniMaxM3ForCausalLM
    from ladle.models.weights import TPShard
    from ladle.runner.kv_cache import bytes_per_block
    from ladle.tools.checkpoint_m3 import text_config

    shard = TPShard(0, tp, False)
    if family == "llama":
        model = LlamaForCausalLM(LLAMA, torch.float32, "meta", tp=shard)
    else:
        model = MiniMaxM3ForCausalLM(text_config("tiny"), torch.float32, "meta", tp=shard)
    return POOL_BLOCKS * bytes_per_block(model.kv_cache_specs(), block_size, torch.float32)


def _run(path: str, tp: int, async_scheduling: bool, kv_bytes: int, prompts, params, penalty_params):
    """(mixed batch finishes, penalty batch finishes, preemptions, overlap record) of one engine."""
    llm = LLM(path, tensor_parallel_size=tp, async_scheduling=async_scheduling, kv_cache_memory_bytes=kv_bytes,
              **ENGINE)
    try:
        assert llm.core.async_scheduling is async_scheduling
        assert llm.core.get_stats().num_total_blocks == POOL_BLOCKS - 1, (tp, llm.core.get_stats())
        dispatch.reset()
        mixed = _finishes(llm.generate(prompts, params))
        overlap = dict(dispatch.snapshot()["ops"].get("async_scheduling", {}).get("buckets", {}))
        executed = sum(b["executed"] for b in overlap.values())
        preemptions = llm.core.get_stats().num_preemptions_total
        dispatch.reset()
        penalty = _finishes(llm.generate(prompts[:3], penalty_params))
        record = dispatch.snapshot()["ops"].get("async_scheduling", {})
        stats = llm.core.get_stats()
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
        return mixed, penalty, preemptions, executed, record.get("fallback_reasons", {})
    finally:
        llm.core.shutdown()


@pytest.mark.parametrize("family,sizes", [("llama", (2,)), ("m3", (2, 4))])
def test_tp_async_matches_tp1_and_tp2_sync(family, sizes, llama_dir, m3_dir):
    path = llama_dir if family == "llama" else m3_dir
    prompts = _prompts(8, seed=3, lo=8, hi=30)
    roomy = LLM(path, kv_cache_memory_bytes=4 << 20, **ENGINE)
    block_size = roomy.core.runner.block_size
    base = _finishes(roomy.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))
    params = _mixed_params(base)
    penalty_params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                      SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
                      SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    runs = {(tp, a): _run(path, tp, a, _pool_bytes(family, tp, block_size), prompts, params, penalty_params)
            for tp, a in [(1, False), (2, False)] + [(tp, True) for tp in sizes]}
    ref_mixed, ref_penalty = runs[1, False][:2]
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert [ref_mixed[i][1] for i in greedy].count("stop") == 1  # the stop token id ended its request
    for (tp, a), (mixed, penalty, preemptions, executed, reasons) in runs.items():
        assert preemptions > 0, (tp, a)  # the small pool forced preemption (not vacuous)
        assert [mixed[i] for i in greedy] == [ref_mixed[i] for i in greedy], (tp, a)
        assert penalty == ref_penalty, (tp, a)
        if a:
            assert executed > 0, (tp, reasons)  # steps were launched while the previous one was in flight
            assert reasons.get("penalties read the previous step's tokens", 0) > 0, reasons  # drained
    # the seeded random request: each rank filled its placeholders from its own sampled ids, so they agreed (the
    # same ranks' numerics as TP = 2 synchronous, where only rank 0's ids are used)
    assert runs[2, True][0][4] == runs[2, False][0][4]
