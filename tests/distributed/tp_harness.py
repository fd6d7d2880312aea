"""Run the same tiny models at TP = 1 (in process) and TP = N (N spawned gloo ranks) and collect what must match.

`rank_results(rank, world, port, cases)` builds each case's model shard (`TPShard(rank, world, expert_parallel)`,
dummy weights from one seed, float32, CPU), runs one batched prefill of two prompts with MSA selections recorded,
then greedy decode steps through tests/drivers' PagedDriver. It returns, per case, the prefill logits [T, V]
float32, the greedy tokens, and the MSA selections this rank computed {layer: (kv heads held, [heads, T, k])}.
`spawn_ranks(world, cases)` runs it on `world` spawned processes and returns rank 0's logits/tokens with every
rank's selections.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback

import torch

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             tie_word_embeddings=True)
PROMPTS = {0: [5, 9, 3, 17, 22, 40, 8, 11, 30, 2, 19, 7, 60, 41, 33, 12, 9, 4, 28, 50, 6, 13, 70, 3, 44, 21, 15,
               36, 18, 27, 39, 10, 47, 52],  # 34 tokens: 3 blocks of 16, so MSA selects among several blocks
           1: [14, 3, 25, 61, 7, 33, 8]}
DECODE_STEPS = 3


def _m3_config() -> dict:
    from ladle.tools.checkpoint_m3 import text_config

    return text_config("tiny")  # 8 heads, 2 KV heads, 2 index heads, 8 experts: TP 4 replicates KV/index heads


def build(case: str, rank: int, world: int):
    from ladle.models.llama import LlamaForCausalLM
    from ladle.models.minimax_m3 import MiniMaxM3ForCausalLM
    from ladle.models.weights import TPShard

    tp = TPShard(rank, world, expert_parallel=case.endswith("-ep"))
    if case == "llama":
        model = LlamaForCausalLM(LLAMA, torch.float32, "cpu", tp=tp)
    else:
        model = MiniMaxM3ForCausalLM(_m3_config(), torch.float32, "cpu", tp=tp)
    model.init_dummy_weights(1234)
    return model.eval()


@torch.inference_mode()
def run_case(case: str, rank: int, world: int) -> dict:
    from drivers.minimax_m3_paged import PagedDriver
    from ladle.layers.linear import head_shard

    model = build(case, rank, world)
    driver = PagedDriver(model, num_blocks=32, block_size=16)
    for sid in PROMPTS:
        driver.add(sid)
    logits, extras = driver.step(list(PROMPTS.items()), record_selection=True)
    ends = torch.tensor([len(p) for p in PROMPTS.values()]).cumsum(0) - 1
    tokens = {sid: [t] for sid, t in zip(PROMPTS, logits[ends].argmax(-1).tolist())}
    for _ in range(DECODE_STEPS - 1):
        step_logits, _ = driver.step([(sid, [tokens[sid][-1]]) for sid in PROMPTS])
        for sid, t in zip(PROMPTS, step_logits.argmax(-1).tolist()):
            tokens[sid].append(t)
    selections = {}
    if case != "llama":
        nkv = model.config.num_key_value_heads
        first, n = head_shard(nkv, rank, world)
        for layer, sel in extras.get("msa_selected_block_ids", {}).items():
            selections[layer] = (list(range(first, first + n)), sel.cpu().clone())
    return {"logits": logits.cpu().clone(), "tokens": tokens, "selections": selections}


def rank_results(rank: int, world: int, port: int, cases: list[str], out) -> None:
    """Process target: join the gloo group, run every case, put (rank, results or traceback) on `out`."""
    from ladle.distributed import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    try:
        init_tensor_parallel(rank, world, "127.0.0.1", port, "cpu")
        results = {case: run_case(case, rank, world) for case in cases}
        if rank > 0:  # only rank 0's logits and tokens are compared: keep the pipe light
            results = {c: {"selections": r["selections"]} for c, r in results.items()}
        out.put((rank, pickle.dumps(results)))  # plain bytes: no shared-memory tensor handles to outlive us
    except BaseException:  # noqa: BLE001 — the test shows this rank's traceback
        out.put((rank, traceback.format_exc()))
    finally:
        destroy_tensor_parallel()
        out.close()
        out.join_thread()
        os._exit(0)  # skip the interpreter's slow teardown: the result is already flushed


def spawn_ranks(world: int, cases: list[str], timeout_s: float = 120.0) -> list[dict]:
    """Results of every rank (list index = rank). Raises AssertionError with a rank's traceback."""
    from ladle.distributed import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_results, args=(r, world, port, cases, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        for _ in range(world):
            rank, res = out.get(timeout=timeout_s)
            assert not isinstance(res, str), f"rank {rank} failed:\n{res}"
            results[rank] = pickle.loads(res)
    except queue.Empty:
        raise AssertionError(f"ranks did not answer within {timeout_s} s") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
