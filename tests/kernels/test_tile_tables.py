"""Tile tables of the fused MoE (MOE_TILES, ladle/kernels/fused_moe.py) and the FP8 GEMM (GEMM_TILES,
ladle/kernels/fp8_gemm.py): today's defaults per bucket, each launcher asks for its own kernel family's row, and an
edited row (what benchmarks/gpu_fp8_tiles.py prints) is what the selection returns; the launchers' shared routing
check. Launches run under the Triton interpreter on tiny random inputs."""

from __future__ import annotations

import pytest
import torch

from ladle.kernels import fp8_gemm, fused_moe
from ladle.kernels._common import MAX_TOKENS, tile_row
from ladle.kernels.fp8_gemm import GEMM_TILES, GemmTileConfig, fp8_gemm_triton, select_gemm_config
from ladle.kernels.fp8_quant import act_quant_ref, quantize_fp8_rows, quantize_mxfp4, quantize_mxfp8
from ladle.kernels.fused_moe import MOE_TILES, MoETileConfig, fused_moe_triton, select_config
from ladle.kernels.fused_moe_fp8 import fused_moe_fp8_triton
from ladle.kernels.fused_moe_mxfp4 import fused_moe_mxfp4_triton

SIZES = (1, 16, 17, 64, 65, 256, 257, 8192)


def test_bf16_table_keeps_its_rule_and_every_tile_is_launchable():
    """bf16 keeps the gpu_m3_suite rule (the FP8 sweep did not re-tune it); the swept FP8 / MXFP8 / MXFP4 / W4A8 rows
    hold only tiles the kernels can launch: power-of-two block sizes, at least 16 (tl.dot's minimum)."""
    for n in SIZES:
        moe = MoETileConfig(16, 32, 64, 128, 4, 4) if n <= 256 else MoETileConfig(128, 128, 256, 64, 8, 3)
        assert select_config(n, "bf16") == moe and select_config(n) == moe
    pow2 = lambda v: v >= 16 and v & (v - 1) == 0  # noqa: E731
    for fam, rows in MOE_TILES.items():
        for _, c in rows:
            assert all(pow2(v) for v in (c.block_m, c.block_n1, c.block_n2, c.block_k)), (fam, c)
            assert c.num_warps in (2, 4, 8) and c.num_stages >= 2, (fam, c)
    for fam, rows in GEMM_TILES.items():
        for _, c in rows:
            assert pow2(c.block_m) and pow2(c.block_n) and c.num_warps in (2, 4, 8) and c.num_stages >= 2, (fam, c)


def test_an_edited_row_is_selected_for_its_family_only(monkeypatch):
    small, big = MoETileConfig(32, 64, 64, 128, 4, 3), MoETileConfig(64, 64, 128, 64, 4, 4)
    monkeypatch.setitem(MOE_TILES, "fp8", ((8, small), (MAX_TOKENS, big)))
    assert select_config(8, "fp8") == small and select_config(9, "fp8") == big
    assert select_config(8, "mxfp8") == MOE_TILES["mxfp8"][0][1] != small
    assert select_config(8, "bf16") == MOE_TILES["bf16"][0][1] != small
    g = GemmTileConfig(32, 32, 8, 2)
    monkeypatch.setitem(GEMM_TILES, "mxfp8", ((MAX_TOKENS, g),))
    assert select_gemm_config(3, "mxfp8") == g and select_gemm_config(3, "fp8") != g


# M from 0 (no launch, but a row) through every bucket edge to the last bound; the tables' bounds today.
M_RANGE = (*range(0, 1025), 1500, 4096, 8192, 8193, 16384, 65536, 2 ** 31, 2 ** 40, MAX_TOKENS - 1, MAX_TOKENS)
BOUNDS = (16, 64, 256, MAX_TOKENS)
FAMILY_BOUNDS = {"fp8_block": (16, 64, 256, 8192, MAX_TOKENS)}  # 128-row tiles above 8192 tokens (fused_moe.py)


def _bucket(m: int, bounds: tuple[int, ...]) -> int:
    """The bucket rule as the tables state it, written out: the number of bounds below M (M <= 16 decode, <= 64,
    <= 256, then prefill, split at 8192 where the family's bounds say so)."""
    return sum(m > b for b in bounds)


@pytest.mark.parametrize("select, tables", [(select_config, MOE_TILES), (select_gemm_config, GEMM_TILES)],
                         ids=["moe", "gemm"])
def test_every_m_gets_its_bucket_row(select, tables):
    """Every family's table has the 16 / 64 / 256 / MAX_TOKENS buckets (fp8_block MoE also 8192), and for every M
    the shared lookup (`tile_row`, through each kernel's select function) returns that bucket's row: the tile of the
    bucket rule."""
    for family, rows in tables.items():
        bounds = FAMILY_BOUNDS.get(family, BOUNDS) if tables is MOE_TILES else BOUNDS
        assert tuple(bound for bound, _ in rows) == bounds, family
        for m in M_RANGE:
            want = rows[_bucket(m, bounds)]
            assert tile_row(rows, m) == want and select(m, family) is want[1], (family, m)


def _spy(monkeypatch, module, name):
    """Record the kernel family each launch asks its select function for."""
    asked, real = [], getattr(module, name)

    def spy(num_tokens, kernel):
        asked.append(kernel)
        return real(num_tokens, kernel)

    monkeypatch.setattr(module, name, spy)
    return asked


def _experts(quantize, E=3, H=64, I=32):
    w13 = torch.randn(E, 2 * I, H) / H ** 0.5
    w2 = torch.randn(E, H, I) / I ** 0.5
    q13, s13 = (torch.stack(t) for t in zip(*[quantize(w) for w in w13]))
    q2, s2 = (torch.stack(t) for t in zip(*[quantize(w) for w in w2]))
    return q13, s13, q2, s2


def test_each_launcher_asks_for_its_family(monkeypatch):
    asked = _spy(monkeypatch, fused_moe, "select_config")
    T, H, E = 3, 64, 3
    x = torch.randn(T, H)
    ids = torch.randint(0, E, (T, 2), dtype=torch.int32)
    wts = torch.rand(T, 2)
    out = fused_moe_triton(x, torch.randn(E, 64, H) / 8, torch.randn(E, H, 32) / 6, ids, wts)
    assert torch.isfinite(out).all()
    fused_moe_fp8_triton(x, *_experts(quantize_fp8_rows), ids, wts)
    fused_moe_fp8_triton(x, *_experts(quantize_mxfp8), ids, wts)
    fused_moe_mxfp4_triton(x, *_experts(quantize_mxfp4), ids, wts, path="wide")  # decode path: own DecodeTile
    fused_moe_mxfp4_triton(x, *_experts(quantize_mxfp4), ids, wts, fp8_activations=True)
    assert asked == ["bf16", "fp8", "mxfp8", "mxfp4", "w4a8"]

    asked_gemm = _spy(monkeypatch, fp8_gemm, "select_gemm_config")
    a_q, a_s = act_quant_ref(torch.randn(2, 64))
    for quantize in (quantize_fp8_rows, quantize_mxfp8):
        w_q, w_s = quantize(torch.randn(48, 64))
        fp8_gemm_triton(a_q, a_s, w_q, w_s, torch.float32)
    assert asked_gemm == ["fp8", "mxfp8"]


def test_each_launcher_checks_the_routing_it_is_given():
    """The fused MoE launchers share one routing check (fused_moe.check_routing): topk_weights must have
    topk_ids' [T, k] shape (the MXFP4 launcher did not check it)."""
    T, H, E = 3, 64, 3
    x, ids = torch.randn(T, H), torch.randint(0, E, (T, 2), dtype=torch.int32)
    launches = [lambda w: fused_moe_triton(x, torch.randn(E, 64, H), torch.randn(E, H, 32), ids, w),
                lambda w: fused_moe_fp8_triton(x, *_experts(quantize_fp8_rows), ids, w),
                lambda w: fused_moe_mxfp4_triton(x, *_experts(quantize_mxfp4), ids, w),
                lambda w: fused_moe_mxfp4_triton(x, *_experts(quantize_mxfp4), ids, w, fp8_activations=True)]
    for launch in launches:
        with pytest.raises(AssertionError):
            launch(torch.rand(T, 3))
        with pytest.raises(AssertionError):
            launch(torch.rand(T, 2, dtype=torch.float64))


@pytest.mark.parametrize("family", sorted(MOE_TILES))
def test_tables_are_ordered_and_cover_every_size(family):
    bounds = [b for b, _ in MOE_TILES[family]]
    assert bounds == sorted(bounds) and bounds[-1] == MAX_TOKENS
    assert all(select_config(n, family) is not None for n in SIZES)
