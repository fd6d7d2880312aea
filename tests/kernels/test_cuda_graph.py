"""Decode CUDA graphs: replay == eager (bitwise on the same padded batch; bf16-close and same greedy tokens
against the unpadded eager step). GPU only; the bucket rule is checked on CPU."""

from __future__ import annotations

import pytest
import torch

from ladle.layers.attention.metadata import AttentionMetadata, ForwardContext, OpBackends, set_forward_context

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}


def _decode_md(ctx_lens, block_size, tables, device):
    b = len(ctx_lens)
    seq = [c + 1 for c in ctx_lens]
    slots = [tables[i][c // block_size] * block_size + c % block_size for i, c in enumerate(ctx_lens)]
    width = max(len(t) for t in tables)
    bt = torch.zeros(b, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    return AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device), block_table=bt.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        positions=torch.tensor(ctx_lens, dtype=torch.int64, device=device), block_size=block_size, max_query_len=1,
        max_seq_len=max(seq), query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=seq,
        context_lens_cpu=list(ctx_lens), num_actual_tokens=b)


def test_bucket_rule_cpu():
    from ladle.runner.cuda_graph import CudaGraphRunner

    runner = CudaGraphRunner.__new__(CudaGraphRunner)  # rule only; no CUDA needed
    runner.buckets, runner.graphs, runner.max_blocks, runner.block_size = [1, 2, 4, 8], {1: None}, 4, 16
    md = _decode_md([3, 17, 40], 16, [[1], [2, 3], [4, 5, 6]], "cpu")
    assert runner.bucket_for(3) == 4 and runner.bucket_for(9) is None
    assert runner.ineligible_reason(md) is None
    md.max_query_len = 2
    assert runner.ineligible_reason(md) == "not decode-only"


@pytest.mark.gpu
def test_graph_replay_equals_eager():
    from ladle.models.llama import LlamaForCausalLM
    from ladle.runner.cuda_graph import CudaGraphRunner
    from ladle.runner.kv_cache import allocate_kv_caches

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY, torch.bfloat16, dev)
    model.init_dummy_weights(0)
    bs, max_blocks = 16, 8
    caches = allocate_kv_caches(model.kv_cache_specs(), 64, bs, torch.bfloat16, dev)
    for c in caches:  # random context, as if prefilled
        c.key_cache.normal_()
        c.value_cache.normal_()
    ctx_lens = [5, 16, 31, 100, 0]
    perm = torch.randperm(63)[:40].add(1).tolist()
    tables = [[perm.pop() for _ in range(c // bs + 1)] for c in ctx_lens]
    md = _decode_md(ctx_lens, bs, tables, dev)
    ids = torch.randint(0, 512, (5,), device=dev)

    def eager(m, input_ids):
        with torch.inference_mode(), set_forward_context(ForwardContext(m, caches, backends=OpBackends.kernels())):
            return model(input_ids, m.positions).clone()

    graphs = CudaGraphRunner(model, caches, sizes=[1, 4, 8], max_blocks_per_seq=max_blocks, block_size=bs,
                             device=dev, backends=OpBackends.kernels())
    graphs.capture()
    assert graphs.can_run(md)
    with torch.inference_mode():
        replay = graphs.run(ids, md.positions, md).clone()
    # The same padded batch eagerly: bitwise equal.
    padded = graphs._metadata(8)
    with torch.inference_mode():
        same = eager(padded, graphs.input_ids[:8])[:5]
    assert torch.equal(replay, same)
    # The unpadded eager step: bf16-close, same greedy tokens.
    plain = eager(md, ids)
    err = ((replay.float() - plain.float()).norm() / plain.float().norm()).item()
    assert err < 1e-2
    assert torch.equal(model.compute_logits(replay).argmax(-1), model.compute_logits(plain).argmax(-1))
