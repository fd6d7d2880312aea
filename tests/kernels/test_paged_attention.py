"""Paged attention kernels (varlen causal prefill and split-KV decode) against a float64 oracle.

CPU: Triton interpreter, tiny shapes. GPU (marked): real sizes, bf16.
"""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import paged_attention, paged_attention_ref
from ladle.kernels.attention_decode import decode_attention
from ladle.observe import dispatch
from paged_batch import F32_TOL, build, oracle, rel_err


@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([5, 1, 17, 3], [0, 7, 5, 12]),  # ragged, mixed prefill + decode-like rows, prefix-cached context
        ([4, 8], [4, 0]),  # chunk starting exactly on a block boundary; prompt ending on one
        ([1], [0]),  # single-token sequence, no context
        ([20], [11]),  # chunked prefill: a chunk continuing a cached context mid-block
    ],
)
def test_prefill_matches_oracle(q_lens, ctx_lens):
    b = build(q_lens, ctx_lens, pad_tokens=3, seed=sum(q_lens) * 7 + sum(ctx_lens))
    b.md.max_query_len = max(max(q_lens), 2)  # force the varlen kernel even for single-token rows
    out = paged_attention(b.q, b.key_cache, b.value_cache, b.md, 0.3)
    ref = oracle(b, 0.3)
    assert rel_err(out, ref) < F32_TOL
    assert torch.count_nonzero(out[b.md.num_actual_tokens:]) == 0, "padding rows must be zero"


@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_matches_oracle(num_splits):
    ctx = [0, 3, 4, 15, 26, 9]  # block-boundary positions (3 -> the new token is offset 3 of block 0; 4 -> block 1)
    b = build([1] * len(ctx), ctx, num_q_heads=6, num_kv_heads=2, head_dim=16, block_size=4, seed=num_splits)
    out = decode_attention(b.q, b.key_cache, b.value_cache, b.md.block_table, b.md.query_start_loc, b.md.seq_lens,
                           0.25, num_splits=num_splits)
    assert rel_err(out, oracle(b, 0.25)) < F32_TOL


def test_decode_dispatch_and_padding_rows():
    """The public entry picks the decode kernel; a CUDA-graph padding row (seq_len 0) yields zeros."""
    b = build([1, 1, 1], [5, 0, 30], num_q_heads=8, num_kv_heads=1, head_dim=32, block_size=8, seed=3)
    b.md.seq_lens[1] = 0  # padding row: nothing to attend to
    b.md.seq_lens_cpu[1] = 0
    dispatch.reset()
    out = paged_attention(b.q, b.key_cache, b.value_cache, b.md, 0.2)
    snap = dispatch.snapshot()["ops"]["attn_decode"]["buckets"]
    assert snap["T<=4"]["executed"] == 1
    assert torch.count_nonzero(out[1]) == 0
    ref = oracle(b, 0.2)
    ref[1] = 0
    for row in (0, 2):
        assert rel_err(out[row], ref[row]) < F32_TOL


def test_reference_matches_oracle():
    b = build([3, 1, 6], [2, 9, 0], seed=11)
    assert rel_err(paged_attention_ref(b.q, b.key_cache, b.value_cache, b.md, 0.5), oracle(b, 0.5)) < 1e-6


def test_ineligible_falls_back_visibly():
    b = build([2], [1], seed=5)
    b.q = b.q.to(torch.float64)
    b.key_cache, b.value_cache = b.key_cache.double(), b.value_cache.double()
    dispatch.reset()
    out = paged_attention(b.q, b.key_cache, b.value_cache, b.md, 0.5)
    entry = dispatch.snapshot()["ops"]["attn_prefill"]
    assert entry["buckets"]["T<=2"] == {"configured": 1, "eligible": 0, "executed": 0, "calls": 1}
    assert any("dtype" in r for r in entry["fallback_reasons"])
    assert rel_err(out, oracle(b, 0.5)) < 1e-6  # the reference computes in float32


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,hq,hkv,block_size", [(64, 9, 3, 16), (128, 16, 1, 128), (128, 32, 8, 16)])
def test_gpu_prefill_and_decode_bf16(head_dim, hq, hkv, block_size):
    q_lens, ctx = [300, 1, 77, 513], [0, 1000, 129, 40]
    b = build(q_lens, ctx, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size,
              dtype=torch.bfloat16, device="cuda", pad_tokens=5)
    scale = head_dim**-0.5
    assert rel_err(paged_attention(b.q, b.key_cache, b.value_cache, b.md, scale), oracle(b, scale)) < 1e-2
    d = build([1] * 40, [int(x) for x in torch.randint(0, 3000, (40,))], num_q_heads=hq, num_kv_heads=hkv,
              head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16, device="cuda")
    assert rel_err(paged_attention(d.q, d.key_cache, d.value_cache, d.md, scale), oracle(d, scale)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [True, False])
def test_gpu_fp8_bit_cast_equals_triton_cast(decode):
    """H200, float8_e4m3fn caches holding every finite code, bf16 q, scales 0.5 / 2.0: the bit-move cast
    (`_common.cache_tile_to`, default) gives the same output bits as Triton's cast (fp8_bit_cast=False), decode and
    prefill kernels, and both match the float64 reference on the dequantized caches."""
    from ladle.kernels.attention_prefill import prefill_attention
    q_lens, ctx = ([1] * 24, [int(x) for x in torch.randint(0, 3000, (24,))]) if decode else ([300, 77, 513],
                                                                                             [0, 129, 40])
    b = build(q_lens, ctx, num_q_heads=16, num_kv_heads=2, head_dim=128, block_size=16, dtype=torch.bfloat16,
              device="cuda")
    g = torch.Generator().manual_seed(3)
    caches = []
    for c in (b.key_cache, b.value_cache):
        codes = torch.randint(0, 256, c.shape, generator=g, dtype=torch.int32)
        codes = torch.where((codes & 0x7F) == 0x7F, 0, codes)  # no NaN codes: the store saturates
        caches.append(codes.to(torch.uint8).view(torch.float8_e4m3fn).cuda())
    q = (b.q * 0.01).bfloat16()
    md, scale = b.md, 128**-0.5
    kernel = decode_attention if decode else prefill_attention
    outs = []
    for bit_cast in (None, False):
        out = torch.zeros_like(q)
        kernel(q, *caches, md.block_table, md.query_start_loc, md.seq_lens, scale, out=out, k_scale=0.5,
               v_scale=2.0, fp8_bit_cast=bit_cast)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = paged_attention_ref(q.double(), *caches, md, scale, k_scale=0.5, v_scale=2.0)
    n = md.num_actual_tokens
    assert rel_err(outs[0][:n], ref[:n]) < 2e-2
