"""MiniMax-M3 invariants that need no oracle: paged paths agree with each other, MSA selections have the
documented layout, MoE routing and MXFP8 match hand/float64 references."""

from __future__ import annotations

import pytest
import torch

from m3_helpers import prompt

from ladle.kernels.fused_moe import swigluoai_ref
from ladle.layers.moe import FusedMoE
from drivers.minimax_m3_paged import PagedDriver
from ladle.kernels.fp8_quant import dequant_block_fp8, quantize_mxfp8

BLOCK, TOPK = 16, 4


pytestmark = pytest.mark.usefixtures("one_thread")




def full(lm, ids: list[int]) -> torch.Tensor:
    return PagedDriver(lm, num_blocks=len(ids) // BLOCK + 4).prefill("x", ids)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [40, 64])
def test_no_more_blocks_than_topk_equals_dense_causal(lm, n):
    ids = prompt(n, n)
    sparse = full(lm, ids)
    saved = [layer.self_attn.attn.msa for layer in lm.layers]
    try:
        for layer in lm.layers:
            layer.self_attn.attn.msa = None  # dense causal attention on every layer, same weights
        dense = full(lm, ids)
        longer_dense = full(lm, prompt(80, 1))
    finally:
        for layer, msa in zip(lm.layers, saved):
            layer.self_attn.attn.msa = msa
    assert close(sparse, dense)
    assert not close(full(lm, prompt(80, 1)), longer_dense)  # 5 blocks > top-k 4: selection bites


@pytest.mark.parametrize("chunk", [48, 23, 16, 100])
def test_chunked_prefill_equals_one_shot(lm, chunk):
    ids = prompt(200, 3)
    one = full(lm, ids)
    chunked = PagedDriver(lm, num_blocks=20, seed=chunk).prefill("x", ids, chunk_size=chunk)
    assert close(chunked, one)


def test_decode_across_block_boundary_equals_prefill(lm):
    ids = prompt(170, 4)
    ref = full(lm, ids)
    drv = PagedDriver(lm, num_blocks=20, seed=1)
    got = [drv.prefill("x", ids[:150])[-1:]]
    for t in ids[150:]:
        got.append(drv.step([("x", [t])])[0])
    assert close(torch.cat(got), ref[149:])


def test_prefix_hit_equals_miss(lm):
    a = prompt(100, 5)
    b = a[:70] + prompt(60, 6)
    miss = full(lm, b)
    drv = PagedDriver(lm, num_blocks=30, seed=2)
    drv.prefill("a", a)
    cached = drv.share_prefix("b", "a", 70)
    assert cached == 64 and drv.seqs["b"].block_ids == drv.seqs["a"].block_ids[:4]  # whole blocks only
    hit = drv.prefill("b", b[cached:])
    assert close(hit, miss[cached:])


def test_mixed_batch_equals_separate(lm):
    """Prefill chunk of one request + decodes of others in one step."""
    a, b, c = prompt(90, 7), prompt(130, 8), prompt(40, 9)
    drv = PagedDriver(lm, num_blocks=40, seed=3)
    drv.step([("b", b[:-1]), ("c", c[:-1])])
    logits, _ = drv.step([("a", a[:50]), ("b", b[-1:]), ("c", c[-1:])])
    assert close(logits[:50], full(lm, a[:50]))
    assert close(logits[50], full(lm, b)[-1])
    assert close(logits[51], full(lm, c)[-1])


def test_selection_layout_and_counts(lm):
    n = 160
    drv = PagedDriver(lm, num_blocks=16)
    _, extras = drv.step([("x", prompt(n, 10))], record_selection=True)
    sels = extras["msa_selected_block_ids"]
    assert sorted(sels) == [1, 2, 3]
    for sel in sels.values():
        assert sel.dtype == torch.int32 and sel.shape == (2, n, TOPK)
        for t in range(n):
            own = t // BLOCK
            for g in range(2):
                row = sel[g, t].tolist()
                valid = [b for b in row if b >= 0]
                assert len(valid) == min(TOPK, own + 1), (t, g, row)
                assert row == valid + [-1] * (TOPK - len(valid))  # left-packed
                assert valid == sorted(set(valid)) and valid[-1] == own  # distinct, local block last
        assert not torch.equal(sel[0], sel[1])  # groups select independently


def _moe(seed: int, folded: bool = True) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    m = FusedMoE(32, 6, 2, 16, 16 if folded else 24, 2.0, 1.702, 7.0, dtype=torch.float32, device="cpu")
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 else 0.3))
    return m


def _moe_reference(m: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """float64 hand reference: choose by σ + bias, weight by renormalised σ × 2, shared expert × 1."""
    x = x.double()
    sig = torch.sigmoid(x @ m.gate_weight.double().T)
    out = torch.zeros_like(x)

    def expert(w13, w2, v):
        gate, up = (v @ w13.double().T).chunk(2, -1)
        return swigluoai_ref(gate, up, 1.702, 7.0) @ w2.double().T

    for t in range(x.shape[0]):
        chosen = torch.topk(sig[t] + m.e_score_correction_bias.double(), 2).indices
        w = sig[t, chosen] / sig[t, chosen].sum() * 2.0
        for e, we in zip(chosen.tolist(), w):
            out[t] += we * expert(m.w13[e], m.w2[e], x[t])
        sh = ((m.w13[6], m.w2[6]) if m.shared_folded
              else (m.shared_experts.gate_up_proj.weight, m.shared_experts.down_proj.weight))
        out[t] += expert(*sh, x[t])
    return out


def test_routed_weights_sum_to_scaling_factor_and_bias_only_chooses():
    m = _moe(0)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(1))
    ids, w = m.route(x)
    ids = ids.long()
    assert torch.allclose(w.sum(-1), torch.full((50,), 2.0), atol=1e-6)
    sig = torch.sigmoid(x @ m.gate_weight.T)
    assert torch.allclose(w, sig.gather(1, ids) / sig.gather(1, ids).sum(-1, keepdim=True) * 2.0, atol=1e-6)
    unbiased = torch.topk(sig, 2).indices.sort(-1).values
    assert (ids.sort(-1).values != unbiased).any()  # the bias really changes the choice


@pytest.mark.parametrize("folded", [True, False])
def test_fused_shared_equals_unfused_and_reference(folded):
    m = _moe(2, folded)
    assert m.shared_folded == folded
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3)) * 3
    ref = _moe_reference(m, x).float()
    fused, unfused = m(x, fuse_shared=True), m(x, fuse_shared=False)
    assert torch.allclose(fused, unfused, atol=1e-5)
    assert torch.allclose(fused, ref, atol=1e-4)
    if folded:  # a shared expert scaled by 2.0 (a classic mistake) must be caught
        bad = m(x, fuse_shared=False) + m.shared_expert(x)
        assert not torch.allclose(bad, ref, atol=1e-2)


def test_model_fused_and_unfused_shared_expert_agree(lm):
    ids = prompt(60, 11)
    fused = full(lm, ids)
    lm.fuse_shared_expert = False
    try:
        unfused = full(lm, ids)
    finally:
        lm.fuse_shared_expert = True
    assert close(fused, unfused)


def test_swigluoai_hand_values():
    gate = torch.tensor([1.0, 9.0, -9.0])
    up = torch.tensor([0.5, 8.0, -8.0])
    got = swigluoai_ref(gate, up, 1.702, 7.0)
    sig = lambda v: 1 / (1 + torch.exp(torch.tensor(-1.702 * v)))  # noqa: E731
    want = torch.tensor([(0.5 + 1) * 1 * sig(1.0), (7 + 1) * 7 * sig(7.0), (-7 + 1) * -9 * sig(-9.0)])
    assert torch.allclose(got, want, atol=1e-6)


def test_mxfp8_dequant_matches_float_reference():
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 2, 24)[:, None]
    q, s = quantize_mxfp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (24, 3)
    ref = q.double() * torch.pow(2.0, s.double() - 127).repeat_interleave(32, dim=1)  # fp8 × 2^(b − 127)
    assert torch.equal(dequant_block_fp8(q, s).double(), ref)
    assert ((ref - w.double()).abs() <= w.double().abs() * 0.0625 + 1e-30).all()  # e4m3: 3 mantissa bits
    one = dequant_block_fp8(torch.full((1, 32), 1.5).to(torch.float8_e4m3fn), torch.tensor([[130]], dtype=torch.uint8))
    assert torch.equal(one, torch.full((1, 32), 12.0))  # 1.5 × 2^3, not 1.5 × 130 or 1.5 / 130
