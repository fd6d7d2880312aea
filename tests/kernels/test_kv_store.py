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
