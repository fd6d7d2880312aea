"""Byte planes and FLOPs of one step from the model's plan, against hand computations on known tiny configs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import tiny_model  # tests/engine/helpers.py

from ladle.observe.plan import (ModelPlan, StepBatch, experts_hit, plan_from_model, plane_totals, roofline_seconds,
                                step_bytes, step_gemm_shapes)


@pytest.fixture(scope="module")
def llama_plan():
    model = tiny_model(seed=1)  # TINY_LLAMA: hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, vocab 512
    return plan_from_model(model, model.kv_cache_specs(), act_bytes=4)


def test_tiny_llama_plan_shapes(llama_plan):
    gemms = {g.name: (g.n, g.k, g.count, g.weight_bytes, g.m_source) for g in llama_plan.gemms}
    # head_dim 64/4 = 16; qkv rows (4 + 2 + 2) * 16 = 128; gate_up rows 2 * 128; float32 = 4 bytes
    assert gemms == {"qkv_proj": (128, 64, 2, 2 * 128 * 64 * 4, "tokens"), "o_proj": (64, 64, 2, 2 * 64 * 64 * 4, "tokens"),
                     "gate_up_proj": (256, 64, 2, 2 * 256 * 64 * 4, "tokens"),
                     "down_proj": (64, 128, 2, 2 * 64 * 128 * 4, "tokens"),
                     "lm_head": (512, 64, 1, 512 * 64 * 4, "sampled")}
    assert llama_plan.moe is None and llama_plan.num_layers == 2 and llama_plan.tp_size == 1
    assert llama_plan.kv_bytes_per_token == 2 * (2 * 2 * 16) * 4 and llama_plan.index_k_bytes_per_token == 0


def test_tiny_llama_step_bytes_by_hand(llama_plan):
    # two requests: a 5-token prompt chunk from position 0 and one decode token at position 9 (seq_lens 5 and 10);
    # both sample, so the LM head runs on M = 2 rows and the others on M = T = 6 tokens.
    planes = step_bytes(llama_plan, StepBatch(num_tokens=6, num_sampled=2, seq_lens=[5, 10]))
    # weights: per layer (128 + 64 + 256) * 64 + 64 * 128 = 36864 elements, 2 layers, + LM head 512 * 64 = 32768
    assert planes["compute"]["weights_read"] == (2 * 36864 + 32768) * 4 == 425984
    # activations (M*K + M*N per GEMM): per layer qkv 6*64+6*128=1152, o 768, gate_up 1920, down 1152 -> 4992;
    # 2 layers 9984, LM head 2*64+2*512=1152, embedding rows 6*64=384 -> 11520 elements
    assert planes["compute"]["activations"] == 11520 * 4
    # KV per token: 2 layers * (K + V) 2 heads * 16 = 128 elements = 512 bytes; written 6 tokens, read 5 + 10
    assert planes["persistent"] == {"kv_written": 6 * 512, "index_k_written": 0, "kv_read": 15 * 512,
                                    "index_k_read": 0, "scales": 0}
    assert planes["communication"] == {"allreduce": 0, "kv_transfer": 0}
    # FLOPs: 2*M*N*K: 2 * 6 * 36864 * 2 layers + 2 * 2 * 512 * 64
    assert planes["flops"]["gemm"] == 884736 + 131072
    assert plane_totals(planes) == {"compute": 425984 + 46080, "persistent": 3072 + 7680, "communication": 0}
    # roofline: bytes / 1e9 B/s vs FLOPs / 1e12 FLOP/s -> the byte term dominates
    assert roofline_seconds(planes, 1e9, 1e12) == pytest.approx((472064 + 10752) / 1e9)
    assert roofline_seconds(planes, None, 1e12) is None


def test_no_sampled_rows_skip_the_lm_head(llama_plan):
    planes = step_bytes(llama_plan, StepBatch(num_tokens=3, num_sampled=0, seq_lens=[3]))
    assert planes["compute"]["weights_read"] == 2 * 36864 * 4
    assert [s[0] for s in step_gemm_shapes(llama_plan, StepBatch(3, 0, [3]))] == ["qkv_proj", "o_proj",
                                                                                     "gate_up_proj", "down_proj"]


class _FakeMoE(nn.Module):
    """A fused-MoE-shaped module: 4 experts, top 2, hidden 16, intermediate 8 (float32)."""

    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k, self.tp_size = 4, 2, 2
        self.w13 = nn.Parameter(torch.randn(4, 16, 16))
        self.w2 = nn.Parameter(torch.randn(4, 16, 8))
        self.gate_weight = nn.Parameter(torch.randn(4, 16))


class _FakeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module() for _ in range(2)])
        for layer in self.layers:
            layer.mlp = _FakeMoE()


class _Spec:
    num_kv_heads, head_dim, index_head_dim = 1, 8, 4


def test_moe_and_tensor_parallel_planes_by_hand():
    plan = plan_from_model(_FakeModel(), [_Spec(), _Spec()], act_bytes=2, kv_bytes=1)
    assert plan.moe is not None and (plan.moe.layers, plan.moe.num_experts, plan.moe.top_k) == (2, 4, 2)
    assert plan.moe.expert_bytes == (16 * 16 + 16 * 8) * 4 and plan.tp_size == 2
    assert experts_hit(1, 4, 2) == pytest.approx(2.0)  # one token reaches exactly its top-2 experts
    assert experts_hit(3, 4, 2) == pytest.approx(4 * (1 - 0.5 ** 3))
    planes = step_bytes(plan, StepBatch(num_tokens=1, num_sampled=0, seq_lens=[7]))
    router = 2 * 4 * 16 * 4  # 2 layers of [4, 16] float32
    assert planes["compute"]["weights_read"] == pytest.approx(router + 2 * 2 * (16 * 16 + 16 * 8) * 4)
    # index-K: 4 elements per token per layer, 1 byte; KV 2 * 1 * 8 per layer
    assert planes["persistent"]["index_k_written"] == 8 and planes["persistent"]["kv_read"] == 7 * 32
    # ring all-reduce: (2 per layer * 2 layers + 1) * 2 * (tp-1)/tp * T * H * 2 bytes, H = 16 from the MoE
    assert planes["communication"]["allreduce"] == pytest.approx(5 * 1.0 * 1 * 16 * 2)
    shapes = {s[0]: s[1:] for s in step_gemm_shapes(plan, StepBatch(8, 0, [8]))}
    assert shapes["moe_w13"] == (4, 16, 16, 2) and shapes["moe_w2"] == (4, 16, 8, 2)  # ceil(8 * 2 / 4) tokens
    assert shapes["moe_router"] == (8, 4, 16, 2)


def test_plan_to_dict_is_json():
    import json

    plan = ModelPlan((), None, 0, 8, 1, 2, 16, 0)
    assert json.loads(json.dumps(plan.to_dict()))["kv_bytes_per_token"] == 16
