"""Paged KV store (K, V and MSA index-K) against an explicit per-token loop."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import store_index_kcache, store_kvcache


def _slots(num_tokens: int, num_blocks: int, block_size: int, g: torch.Generator) -> torch.Tensor:
    """Distinct slots outside the null block 0 (real slot mappings never repeat a slot), a few -1 padding entries,
    and the block-boundary slots 2*bs-1 (last offset of block 1) and 2*bs (first offset of block 2) at rows 1, 2."""
    edge = [2 * block_size - 1, 2 * block_size]
    rest = [s for s in (torch.randperm((num_blocks - 1) * block_size, generator=g) + block_size).tolist()
            if s not in edge]
    slots = torch.tensor([rest[0]] + edge + rest[1 : num_tokens - 2])
    slots[::5] = -1
    return slots


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kvcache(device, slot_dtype):
    g = torch.Generator().manual_seed(int(slot_dtype == torch.int32))
    num_blocks, block_size, hkv, d, t = 8, 4, 3, 16, 23
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    qkv = torch.randn(t, (2 + 2 * hkv) * d, generator=g)  # k, v as strided views into a fused projection
    k = qkv[:, 2 * d : (2 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (2 + hkv) * d :].view(t, hkv, d)
    slots = _slots(t, num_blocks, block_size, g).to(slot_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // block_size, s % block_size] = k[i]
            want_v[s // block_size, s % block_size] = v[i]
    kc, vc = kc.to(device), vc.to(device)
    store_kvcache(k.to(device), v.to(device), kc, vc, slots.to(device))
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)


def test_store_index_kcache():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(6, 8, 32, generator=g)
    x = torch.randn(20, 32, generator=g)
    slots = _slots(20, 6, 8, g)
    want = cache.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // 8, s % 8] = x[i]
    cache = cache.to(dev)
    store_index_kcache(x.to(dev), cache, slots.to(dev))
    assert torch.equal(cache.cpu(), want)


def test_reference_path_matches_loop_and_is_recorded():
    """use_triton=False: the torch reference writes the same rows (bf16 inputs cast to a float32 cache), padding
    rows write nothing, and the dispatch record shows Triton not configured."""
    from ladle.observe import dispatch

    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, hkv, d, t = 6, 4, 2, 8, 13
    kc, vc = torch.randn(num_blocks, block_size, hkv, d, generator=g), torch.randn(num_blocks, block_size, hkv, d,
                                                                                    generator=g)
    ic = torch.randn(num_blocks, block_size, 16, generator=g)
    k, v = torch.randn(t, hkv, d, generator=g).bfloat16(), torch.randn(t, hkv, d, generator=g).bfloat16()
    ik = torch.randn(t, 16, generator=g)
    slots = _slots(t, num_blocks, block_size, g)
    want_k, want_v, want_i = kc.clone(), vc.clone(), ic.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // block_size, s % block_size] = k[i].float()
            want_v[s // block_size, s % block_size] = v[i].float()
            want_i[s // block_size, s % block_size] = ik[i]
    dispatch.reset()
    store_kvcache(k, v, kc, vc, slots, use_triton=False)
    store_index_kcache(ik, ic, slots, use_triton=False)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v) and torch.equal(ic, want_i)
    ops = dispatch.snapshot()["ops"]
    for op in ("kv_store", "index_k_store"):
        (row,) = ops[op]["buckets"].values()
        assert row["configured"] == 0 and row["executed"] == 0 and row["calls"] == 1


def test_attention_ops_import_and_fall_back_without_triton():
    """A triton-less install (the package marks Triton Linux-only): the Attention layer and its ops import, the
    Triton backend falls back to the references, and the fallback reason says why."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError
import torch
from ladle.layers.attention.layer import Attention
from ladle.layers.attention.metadata import (AttentionMetadata, ForwardContext, LayerKVCache, OpBackends,
                                             set_forward_context)
from ladle.observe import dispatch
i32 = dict(dtype=torch.int32)
md = AttentionMetadata(query_start_loc=torch.tensor([0, 5], **i32), seq_lens=torch.tensor([5], **i32),
                       context_lens=torch.tensor([0], **i32), block_table=torch.tensor([[3, 1]], **i32),
                       slot_mapping=torch.tensor([12, 13, 14, 15, 4]), positions=torch.arange(5), block_size=4,
                       max_query_len=5, max_seq_len=5)
cache = LayerKVCache(torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))
ctx = ForwardContext(md, [cache], backends=OpBackends.kernels())
g = torch.Generator().manual_seed(0)
q, k, v = torch.randn(5, 32, generator=g), torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
with set_forward_context(ctx):
    out = Attention(4, 2, 8, 8 ** -0.5, 0)(q, k, v)
assert torch.isfinite(out).all() and out.abs().sum() > 0
reasons = dispatch.snapshot()["ops"]["attn_prefill"]["fallback_reasons"]
assert reasons == {"triton not installed": 1}, reasons
assert "triton" not in sys.modules or sys.modules["triton"] is None
print("ok")
"""
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]
