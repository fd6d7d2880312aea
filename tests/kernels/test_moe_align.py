"""MoE align (ladle/kernels/moe_align.py): both paths vs `moe_align_ref` (the alignment contract), counters zero."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels.moe_align import (MAX_CHUNK, MIN_CHUNK, SINGLE_MAX_NUMEL, align_chunk, max_padded_rows,
                                     moe_align_ref, moe_align_triton)
from ladle.kernels.split_counters import split_counters

PATHS = [0, 16, 64]  # single program; multi-program with 16- and 64-pair chunks (several programs at tiny sizes)


def _counters_zero() -> bool:
    return int(split_counters("moe_align", torch.device("cpu"), 1).abs().sum()) == 0


def _assert_aligned(ids: torch.Tensor, E: int, bm: int, chunk) -> None:
    """The alignment contract against the reference: tile experts and rows in use equal, every row of a tile holds a
    pair routed to the tile's expert (order inside an expert is free, so tiles' row sets are not compared), every
    pair appears exactly once, padding rows hold the sentinel; the counters are back to zero."""
    s, ex, n = moe_align_triton(ids, E, bm, chunk=chunk)
    rs, rex, rn = moe_align_ref(ids, E, bm)
    numel, flat = ids.numel(), ids.reshape(-1).tolist()
    assert s.shape == rs.shape == (max_padded_rows(numel, E, bm),)
    assert torch.equal(ex, rex) and torch.equal(n, rn) and int(n) % bm == 0
    for i, v in enumerate(s.tolist()):
        assert v == numel or (0 <= v < numel and flat[v] == int(ex[i // bm])), f"row {i}: pair {v}"
    assert sorted(s[s < numel].tolist()) == list(range(numel))
    assert _counters_zero()


@pytest.mark.parametrize("chunk", PATHS)
@pytest.mark.parametrize("bm", [4, 16])
def test_align_matches_reference(bm, chunk):
    torch.manual_seed(4)
    E = 9  # not a power of two
    ids = torch.randint(0, E, (23, 3), dtype=torch.int32)
    ids[ids == 4] = 5  # an empty expert in the middle
    _assert_aligned(ids, E, bm, chunk)
    flat = ids.view(-1).long()
    s, ex, _ = moe_align_triton(ids, E, bm, chunk=chunk)
    assert all(ex[i // bm] == flat[v] for i, v in enumerate(s.tolist()) if v < flat.numel())


@pytest.mark.parametrize("chunk", PATHS)
def test_skewed_routing(chunk):
    E, bm = 13, 4
    _assert_aligned(torch.full((37, 2), 7, dtype=torch.int32), E, bm, chunk)  # all pairs to one expert
    _assert_aligned(torch.full((37, 2), E - 1, dtype=torch.int32), E, bm, chunk)  # ... to the last one
    _assert_aligned(torch.randperm(E).int().view(E, 1), E, bm, chunk)  # every expert exactly once
    _assert_aligned(torch.tensor([[2]], dtype=torch.int32), E, bm, chunk)  # one pair


@pytest.mark.parametrize("chunk", PATHS)
def test_shared_expert_column(chunk):
    """Router layout: k routed experts per token plus the shared expert (the last id) in every row."""
    torch.manual_seed(5)
    E, T, k = 11, 29, 3
    routed = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)]).int()
    ids = torch.cat([routed, torch.full((T, 1), E - 1, dtype=torch.int32)], dim=1)
    _assert_aligned(ids, E, 16, chunk)


def test_path_rule_and_default_at_both_sizes():
    """numel <= SINGLE_MAX_NUMEL runs one program, larger numel the multi-program path with about 128 programs
    of 256..512 pairs; the default (chunk None) is valid at both sizes with the M3 expert count (128 routed +
    the shared one = 129)."""
    assert align_chunk(160, 16) == 0 and align_chunk(SINGLE_MAX_NUMEL, 16) == 0
    assert align_chunk(SINGLE_MAX_NUMEL, 4) == MIN_CHUNK  # 256 tiles of one expert: too many for one program
    assert align_chunk(SINGLE_MAX_NUMEL + 1, 16) == MIN_CHUNK == align_chunk(8192 * 5, 64)  # 160 programs
    assert align_chunk(16384 * 5, 64) == 512 and align_chunk(32768 * 5, 64) == MAX_CHUNK == align_chunk(10**7, 64)
    torch.manual_seed(6)
    E, k = 129, 5
    for T, bm in ((32, 16), (SINGLE_MAX_NUMEL // k + 7, 64)):
        ids = torch.cat([torch.randint(0, E - 1, (T, k - 1), dtype=torch.int32),
                         torch.full((T, 1), E - 1, dtype=torch.int32)], dim=1)
        _assert_aligned(ids, E, bm, None)


def test_bad_chunk_refused():
    ids = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(AssertionError, match="power of two"):
        moe_align_triton(ids, 3, 4, chunk=48)
