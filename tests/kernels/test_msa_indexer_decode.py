"""MSA indexer decode path (ladle/kernels/msa_indexer.py, issue 11 "the index-score decode kernel"): the split's
page ids loaded up front (`prefetch_pages`, several K tiles per iteration with `pages_per_iter`, ragged last group,
splits that get no blocks), the launch defaults of `score_launch`, and the e4m3 -> bf16 bit-move cast (its PTX text
emulated on the CPU for every code; the kernel itself on a GPU). Tunables change speed only: every variant must
equal the reference slot for slot on exact (small-integer) data."""

from __future__ import annotations

import re

import pytest
import torch

import ladle.kernels.msa_indexer as mod
from ladle.kernels._common import E4M3_TO_BF16_PTX
from ladle.kernels.msa_indexer import msa_indexer_ref, msa_indexer_triton, score_launch
from msa_batch import build

BS, D = 16, 32
# decode depths (max_blocks 8): 1, 2, 2, 4, 7, 8, 8 visible blocks; with 3 or 8 splits several splits get no block
DECODE = [(5, 1), (16, 1), (31, 1), (60, 1), (100, 1), (127, 1), (120, 1)]
# prefill from 0, decode deep in, chunk straddling blocks, decode at a block boundary; 2 padding tokens
RAGGED = [(0, 20), (100, 1), (40, 9), (16, 1)]


def _int_data(num_tokens, num_blocks, heads, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (num_tokens, heads, D), generator=g).float()
    kc = torch.randint(-2, 3, (num_blocks, BS, D), generator=g).float()
    return q, kc


@pytest.mark.parametrize("num_splits,pages_per_iter", [(1, 3), (2, 3), (3, 2), (8, 2), (2, 1)])
@pytest.mark.parametrize("fused", [True, False])
def test_prefetch_pages_ragged_groups_and_empty_splits(num_splits, pages_per_iter, fused):
    """Decode batch: split s visits blocks s, s + num_splits, ... in groups of pages_per_iter (n mod pages_per_iter
    != 0 leaves a masked ragged group; a split past a request's last block visits none). Output equals the
    reference and the block-table walk (prefetch_pages=False) slot for slot, into a poisoned buffer."""
    b = build(DECODE, BS, max_blocks=8, seed=41)
    T, H, topk = b.num_tokens, 2, 3
    q, kc = _int_data(T, b.num_blocks, H, seed=42 + num_splits)
    args = (q, kc, b.block_table, b.positions, b.query_start_loc, topk)
    ref = msa_indexer_ref(*args)
    for prefetch in (True, False):
        out = torch.full((H, T, topk), 55, dtype=torch.int32)
        msa_indexer_triton(*args, out=out, num_splits=num_splits, pages_per_iter=pages_per_iter,
                           prefetch_pages=prefetch, fused_topk=fused)
        assert torch.equal(out, ref), f"prefetch_pages={prefetch}"


def test_prefetch_scores_equal_block_table_walk():
    """The pooled block scores (scratch, two-launch path) of the prefetch path equal the walk's for every visible
    block, with a non-unit index_k_scale."""
    b = build(DECODE, BS, max_blocks=8, seed=43)
    T, H = b.num_tokens, 1
    g = torch.Generator().manual_seed(44)
    q, kc = torch.randn(T, H, D, generator=g), torch.randn(b.num_blocks, BS, D, generator=g)
    got = {}
    for prefetch in (True, False):
        scores = torch.full((H, T, 8), float("nan"))
        msa_indexer_triton(q, kc, b.block_table, b.positions, b.query_start_loc, 2, scores=scores,
                           num_splits=3, pages_per_iter=2, prefetch_pages=prefetch, fused_topk=False,
                           index_k_scale=0.375)
        got[prefetch] = scores
    vis = torch.arange(8)[None, None, :] <= (b.positions // BS)[None, :, None]
    assert torch.isfinite(got[True][vis]).all()
    assert torch.equal(got[True][vis], got[False][vis])


def test_prefetch_forced_on_prefill_tiles_and_walk_forced_on_decode():
    """prefetch_pages=True on a prefill-shaped launch (multi-token tiles, padding) and the walk forced on decode:
    both still equal the reference slot for slot."""
    b = build(RAGGED, BS, max_blocks=8, pad_tokens=2, seed=45)
    T, H, topk = b.num_tokens, 2, 4
    q, kc = _int_data(T, b.num_blocks, H, seed=46)
    args = (q, kc, b.block_table, b.positions, b.query_start_loc, topk)
    out = msa_indexer_triton(*args, num_splits=3, prefetch_pages=True, pages_per_iter=2)
    assert torch.equal(out, msa_indexer_ref(*args))
    d = build(DECODE, BS, max_blocks=8, seed=47)
    q, kc = _int_data(d.num_tokens, d.num_blocks, H, seed=48)
    args = (q, kc, d.block_table, d.positions, d.query_start_loc, topk)
    assert torch.equal(msa_indexer_triton(*args, prefetch_pages=False), msa_indexer_ref(*args))


def test_score_launch_defaults_and_refusals(monkeypatch):
    """Decode (T <= B): page ids up front (vector of next_pow2(cdiv(max_blocks, splits))), 3 stages for a 1-byte
    cache, 2 for wider ones, registers capped at 128 (4 warps; none for 8); prefill: the walk with 3 stages; a
    slice longer than PREFETCH_PAGES_MAX: the walk. Explicit values win. fp8_bit_cast=True where the bit cast
    cannot run (interpreter / CPU, non-e4m3) and pages_per_iter < 1 are refused with the reason."""
    q_dec, q_pre = torch.zeros(4, 1, D), torch.zeros(40, 1, D)
    bt = torch.zeros(4, 8, dtype=torch.int32)
    k32 = torch.zeros(3, BS, D)
    k8 = torch.zeros(3, BS, D, dtype=torch.float8_e4m3fn)
    cfg = score_launch(q_dec, k8, bt, 16, num_splits=3)
    assert (cfg.pages_p2, cfg.num_stages, cfg.pages_per_iter, cfg.fp8_bit_cast, cfg.maxnreg) == (4, 3, 1, False, 128)
    assert score_launch(q_dec, k32, bt, 16, num_splits=3).num_stages == 2
    assert score_launch(q_dec, k32, bt, 16, num_splits=3, num_warps=8).maxnreg is None  # 64 would spill
    assert score_launch(q_dec, k32, bt, 16, num_splits=3, maxnreg=0).maxnreg is None
    cfg = score_launch(q_pre, k32, bt, 16, num_splits=3)
    assert (cfg.pages_p2, cfg.num_stages, cfg.maxnreg) == (0, 3, None)
    cfg = score_launch(q_dec, k32, bt, 16, num_splits=2, num_stages=4, prefetch_pages=False, pages_per_iter=2)
    assert (cfg.pages_p2, cfg.num_stages, cfg.pages_per_iter, cfg.maxnreg) == (0, 4, 2, None)
    assert score_launch(q_pre, k32, bt, 16, num_splits=3, prefetch_pages=True).pages_p2 == 4
    monkeypatch.setattr(mod, "PREFETCH_PAGES_MAX", 3)
    assert score_launch(q_dec, k32, bt, 16, num_splits=2).pages_p2 == 0  # 4 ids per split > 3
    with pytest.raises(ValueError, match="fp8_bit_cast=True needs"):
        score_launch(q_dec.bfloat16(), k8, bt, 16, fp8_bit_cast=True)
    with pytest.raises(ValueError, match="fp8_bit_cast=True needs"):
        score_launch(q_dec, k32, bt, 16, fp8_bit_cast=True)
    with pytest.raises(ValueError, match="pages_per_iter"):
        score_launch(q_dec, k32, bt, 16, pages_per_iter=0)


# ---- the e4m3 -> bf16 PTX, emulated -----------------------------------------------------------------------------
def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 default mode: result byte i = byte (sel nibble i & 7) of {b, a}, or its sign replicated when
    the nibble's bit 3 is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _bf16x2_mul(a: int, b: int) -> int:
    """PTX mul.rn.bf16x2: per 16-bit half, the bf16 product rounded to nearest even (subnormals kept)."""
    out = 0
    for sh in (0, 16):
        xa, xb = (torch.tensor([(v >> sh) & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
                  for v in (a, b))
        prod = (xa.double() * xb.double()).to(torch.bfloat16)
        out |= (int(prod.view(torch.int16).item()) & 0xFFFF) << sh
    return out


def _run_ptx(text: str, word: int) -> tuple[int, int]:
    """Emulate the few PTX instructions of E4M3_TO_BF16_PTX on one 32-bit input word ($2); returns ($0, $1)."""
    regs = {"$2": word}

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        m = re.match(r"\s*([a-z0-9.]+)\s+(.*);\s*$", line)
        if not m or m.group(1).startswith(".reg"):
            continue
        op, args = m.group(1), [x.strip() for x in m.group(2).split(",")]
        dst, srcs = args[0], [val(x) for x in args[1:]]
        if op == "mov.b32":
            regs[dst] = srcs[0]
        elif op == "prmt.b32":
            regs[dst] = _prmt(*srcs)
        elif op == "shl.b32":
            regs[dst] = (srcs[0] << srcs[1]) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[dst] = srcs[0] & srcs[1]
        elif op == "mul.rn.bf16x2":
            regs[dst] = _bf16x2_mul(*srcs)
        else:
            raise AssertionError(f"unemulated PTX op {op}")
    return regs["$0"], regs["$1"]


def test_e4m3_to_bf16_ptx_every_code():
    """The kernel's PTX text, emulated instruction by instruction on every e4m3 code (4 per word, each code in
    every byte slot): bit-identical to torch's float8_e4m3fn -> bf16 conversion for all finite codes (zero,
    subnormals, the largest 448, both signs); the NaN codes come out as +-480 as documented."""
    text = E4M3_TO_BF16_PTX.value
    codes = list(range(256))
    want = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
    want_bits = (want.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    for rot in range(4):
        for base in range(0, 256, 4):
            quad = [codes[(base + (i + rot) % 4) % 256] for i in range(4)]
            lo, hi = _run_ptx(text, quad[0] | quad[1] << 8 | quad[2] << 16 | quad[3] << 24)
            got = [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16]
            for c, bits in zip(quad, got):
                if c & 0x7F == 0x7F:  # NaN codes
                    assert bits == (0xC3F0 if c & 0x80 else 0x43F0), hex(bits)  # -480 / 480
                else:
                    assert bits == want_bits[c], f"code {c:#04x}: {bits:#06x} != {want_bits[c]:#06x}"


@pytest.mark.gpu
def test_gpu_fp8_bit_cast_every_code_in_the_kernel():
    """H200: the score kernel with the bit cast (decode prefetch path) sees every finite e4m3 code as torch does.
    Page p of the cache holds code p at key 0, dim 0 (zeros elsewhere); 32 decode requests of 8 blocks each cover
    all 256 pages; with q = +-e_0 the pooled score of block b is max(+-value, 0) * scale, so the two runs pin
    down every value."""
    bs, d, nreq, nblk, scale = 128, 128, 32, 8, 0.5
    codes = torch.arange(256, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes)  # no NaN in a cache
    kc = torch.zeros(256, bs, d, dtype=torch.uint8)
    kc[:, 0, 0] = codes.to(torch.uint8)
    kc = kc.view(torch.float8_e4m3fn).cuda()
    values = kc[:, 0, 0].float() * scale  # [256] by page id
    bt = torch.arange(256, dtype=torch.int32, device="cuda").view(nreq, nblk)
    pos = torch.full((nreq,), nblk * bs - 1, dtype=torch.int64, device="cuda")
    qsl = torch.arange(nreq + 1, dtype=torch.int32, device="cuda")
    for sign in (1.0, -1.0):
        q = torch.zeros(nreq, 1, d, device="cuda", dtype=torch.bfloat16)
        q[:, 0, 0] = sign
        for bit_cast in (True, False):
            scores = torch.full((1, nreq, nblk), float("nan"), device="cuda")
            msa_indexer_triton(q, kc, bt, pos, qsl, 4, scores=scores, fused_topk=False, index_k_scale=scale,
                               fp8_bit_cast=bit_cast)
            want = (sign * values).clamp(min=0).view(1, nreq, nblk)
            assert torch.equal(scores, want), f"sign {sign} bit_cast {bit_cast}"
