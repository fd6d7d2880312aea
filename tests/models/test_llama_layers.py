"""Layer references: RMSNorm, RoPE (full, partial, GPT-J, llama3 scaling), SiLU-and-mul, paged store/attention.

Oracles are independent: float64 formulas written out here, transformers' own RoPE init for llama3 scaling, and
a dense (unpaged) causal attention computed in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from ladle.kernels.kv_store import store_kvcache_ref
from ladle.kernels.paged_attention import paged_attention_ref
from ladle.layers.activation import silu_and_mul
from ladle.layers.attention.layer import Attention
from ladle.layers.attention.metadata import LayerCacheSpec, OpBackends, set_forward_context
from drivers.paged_test_cache import PagedTestCache
from ladle.layers.norm import RMSNorm
from ladle.layers.rotary import RotaryEmbedding, compute_inv_freq


def test_rmsnorm_and_fused_residual_match_float64():
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(7, 48, generator=g), torch.randn(7, 48, generator=g)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) + 0.5)
    xd, rd, wd = x.double(), res.double(), norm.weight.double()

    def ref(v):
        return wd * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)

    torch.testing.assert_close(norm(x).double(), ref(xd), rtol=1e-5, atol=1e-6)
    y, new_res = norm(x, res)
    torch.testing.assert_close(new_res.double(), xd + rd)
    torch.testing.assert_close(y.double(), ref(xd + rd), rtol=1e-5, atol=1e-6)


def test_silu_and_mul():
    x = torch.randn(5, 2 * 12, dtype=torch.float64)
    gate, up = x[:, :12], x[:, 12:]
    torch.testing.assert_close(silu_and_mul(x), gate / (1 + torch.exp(-gate)) * up)


def _rope_ref(x, pos, rotary_dim, base, neox):
    """float64 RoPE of x [T, H, D] written from the RoFormer formula."""
    out = x.clone()
    half = rotary_dim // 2
    for i in range(half):
        theta = pos.double() * base ** (-2 * i / rotary_dim)
        c, s = torch.cos(theta)[:, None], torch.sin(theta)[:, None]
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


@pytest.mark.parametrize("rotary_dim,neox", [(32, True), (16, True), (32, False)])
def test_rope_matches_float64_formula(rotary_dim, neox):
    head_dim, base = 32, 10000.0
    rope = RotaryEmbedding(head_dim, rotary_dim, max_position=512, base=base, is_neox_style=neox)
    pos = torch.tensor([0, 1, 5, 77, 300, 511])
    q = torch.randn(6, 4 * head_dim)
    k = torch.randn(6, 2 * head_dim)
    q_out, k_out = rope(pos, q, k)
    q_ref = _rope_ref(q.double().view(6, 4, head_dim), pos, rotary_dim, base, neox).view(6, -1)
    k_ref = _rope_ref(k.double().view(6, 2, head_dim), pos, rotary_dim, base, neox).view(6, -1)
    torch.testing.assert_close(q_out.double(), q_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k_out.double(), k_ref, rtol=1e-4, atol=1e-4)
    if rotary_dim < head_dim:  # the pass-through channels are untouched
        assert torch.equal(q_out.view(6, 4, -1)[..., rotary_dim:], q.view(6, 4, -1)[..., rotary_dim:])


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=scaling)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = compute_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(ours, ref)
    assert not torch.allclose(ours, compute_inv_freq(128, 500000.0, None))  # scaling changed something
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        compute_inv_freq(128, 1e4, {"rope_type": "yarn", "factor": 4.0})


def _dense_causal_ref(q, k, v, scale):
    """q [n, Hq, D] (the last n of L positions), k/v [L, Hkv, D] -> [n, Hq, D] float64, no paging."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, 1)
    v = v.double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    mask = torch.arange(L)[None, :] > (torch.arange(n) + L - n)[:, None]
    return torch.einsum("hqk,khd->qhd", s.masked_fill(mask, -math.inf).softmax(-1), v)


def test_paged_attention_ref_against_dense_float64():
    """Mixed step: a fresh prompt, a chunked-prefill continuation and two decodes, plus padding tokens."""
    hq, hkv, d, bs = 6, 2, 16, 4
    cache = PagedTestCache([LayerCacheSpec(hkv, d)], num_blocks=40, block_size=bs)
    g = torch.Generator().manual_seed(1)
    history = {key: (torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g))
               for key, n in {"b": 9, "c": 5, "d": 12}.items()}
    for key, (k, v) in history.items():  # earlier steps: store only
        _, _, ctx = cache.build([(key, [0] * k.shape[0])])
        layer0 = cache.kv_caches[0]
        store_kvcache_ref(k, v, layer0.key_cache, layer0.value_cache, ctx.attn_metadata.slot_mapping)
    new = {"a": 7, "b": 6, "c": 1, "d": 1}
    chunks = [(key, [0] * n) for key, n in new.items()]
    _, _, ctx = cache.build(chunks, num_padding=3)
    md, layer = ctx.attn_metadata, cache.kv_caches[0]
    T = md.slot_mapping.shape[0]
    k_new, v_new, q = torch.randn(T, hkv, d, generator=g), torch.randn(T, hkv, d, generator=g), torch.randn(T, hq, d, generator=g)
    before = layer.key_cache.clone()
    store_kvcache_ref(k_new, v_new, layer.key_cache, layer.value_cache, md.slot_mapping)
    written = set(md.slot_mapping[md.slot_mapping >= 0].tolist())
    changed = (layer.key_cache != before).view(-1, hkv * d).any(-1).nonzero().flatten().tolist()
    assert set(changed) <= written and len(changed) == len(written)  # padding wrote nothing
    out = paged_attention_ref(q, layer.key_cache, layer.value_cache, md, d**-0.5)
    offset = 0
    for key, n in new.items():
        old_k, old_v = history.get(key, (torch.empty(0, hkv, d), torch.empty(0, hkv, d)))
        k_all = torch.cat([old_k, k_new[offset:offset + n]])
        v_all = torch.cat([old_v, v_new[offset:offset + n]])
        ref = _dense_causal_ref(q[offset:offset + n], k_all, v_all, d**-0.5)
        torch.testing.assert_close(out[offset:offset + n].double(), ref, rtol=1e-5, atol=1e-5)
        offset += n
    assert torch.all(out[offset:] == 0)


def test_batched_decode_path_equals_per_request_loop(monkeypatch):
    hq, hkv, d, bs = 4, 2, 8, 4
    cache = PagedTestCache([LayerCacheSpec(hkv, d)], num_blocks=64, block_size=bs)
    layer = cache.kv_caches[0]
    layer.key_cache.normal_()
    layer.value_cache.normal_()
    for key, n in {"a": 3, "b": 17, "c": 8}.items():
        cache.build([(key, [0] * n)])
    _, _, ctx = cache.build([("a", [0]), ("b", [0]), ("c", [0])], num_padding=2)
    q = torch.randn(5, hq, d)
    batched = paged_attention_ref(q, layer.key_cache, layer.value_cache, ctx.attn_metadata, 0.3)
    import importlib

    pr = importlib.import_module("ladle.kernels.paged_attention")  # the module (the package re-exports the function)

    monkeypatch.setattr(pr, "_MAX_BATCHED_GATHER_ELEMS", 0)  # force the loop
    looped = paged_attention_ref(q, layer.key_cache, layer.value_cache, ctx.attn_metadata, 0.3)
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-6)
    assert torch.all(batched[3:] == 0)


def test_attention_layer_triton_seam_calls_kernel_entry_points(monkeypatch):
    """backends=OpBackends.kernels() routes through the kernel entry points the layer calls (faked here), with
    Triton asked for."""
    import ladle.layers.attention.layer as layer_mod

    calls = []

    def fake_store(*args, use_triton, **scales):  # scales: the KV cache's k_scale / v_scale (1.0 here)
        calls.append(("store", use_triton))
        store_kvcache_ref(*args, **scales)

    def fake_attend(*args, use_triton, **scales):
        calls.append(("attend", use_triton))
        return paged_attention_ref(*args, **scales)

    monkeypatch.setattr(layer_mod, "store_kvcache", fake_store)
    monkeypatch.setattr(layer_mod, "paged_attention", fake_attend)
    attn = Attention(4, 2, 8, 8**-0.5, layer_idx=0)
    cache = PagedTestCache([LayerCacheSpec(2, 8)], num_blocks=8, block_size=4, backends=OpBackends.kernels())
    _, _, ctx = cache.build([("a", [0] * 5)])
    q, k, v = torch.randn(5, 32), torch.randn(5, 16), torch.randn(5, 16)
    with set_forward_context(ctx):
        out = attn(q, k, v)
    assert calls == [("store", True), ("attend", True)]
    ref = _dense_causal_ref(q.view(5, 4, 8), k.view(5, 2, 8), v.view(5, 2, 8), 8**-0.5)
    torch.testing.assert_close(out.view(5, 4, 8).double(), ref, rtol=1e-5, atol=1e-5)
