"""MiniMax-M3 (tiny preset, float32) on the kernel path (OpBackends.kernels(): fused residual + Gemma RMSNorm,
per-head norm + RoPE with the KV/index-K stores in one op (qk_norm_rope_store) or as separate ops, dense paged
attention, MSA indexer, MSA sparse attention, router, fused MoE; one GEMM for the q/k/v and index q/k projections)
run by the Triton CPU interpreter, against the torch reference path, through a prefill, a chunk that crosses a
block boundary, and decode steps that cross another (tiny preset: 16-token blocks; positions 30-43 cross 32,
decode 44-51 crosses 48)."""

from __future__ import annotations

import pytest
import torch

from ladle.layers.attention.metadata import OpBackends
from ladle.kernels import head_norm_rope
from m3_helpers import selection_sets

from drivers.minimax_m3_paged import PagedDriver, load_m3_dir
from ladle.observe import dispatch

pytestmark = pytest.mark.usefixtures("one_thread")


def _executed(op: str) -> int:
    return sum(b["executed"] for b in dispatch.snapshot()["ops"].get(op, {}).get("buckets", {}).values())


@pytest.mark.parametrize("prologue_max_tokens", [None, 0])
def test_kernel_path_matches_torch_path_on_cpu(ckpt, prologue_max_tokens, monkeypatch):
    """prologue_max_tokens None: qk_norm_rope_store's rule (every step here is small: its one launch runs); 0: its
    separate ops, the per-head norm + RoPE and store kernels (what longer prefill steps run)."""
    if prologue_max_tokens is not None:
        monkeypatch.setattr(head_norm_rope, "FUSED_PROLOGUE_MAX_TOKENS", prologue_max_tokens)
    prologue = ("qk_norm_rope_store",) if prologue_max_tokens is None else ("head_norm_rope", "kv_store",
                                                                              "index_k_store")
    model = load_m3_dir(ckpt, torch.float32, "cpu")
    ids = torch.randint(3, 500, (52,), generator=torch.Generator().manual_seed(5)).tolist()
    ref_drv, ker_drv = PagedDriver(model, 16), PagedDriver(model, 16, backends=OpBackends.kernels())
    ops = ("rmsnorm", *prologue, "attn_prefill", "attn_decode", "msa_indexer",
           "msa_sparse_attention", "moe_router", "fused_moe", "moe_combine")
    before = {op: _executed(op) for op in ops}
    outs = []
    for drv in (ref_drv, ker_drv):
        logits, extras = drv.step([("a", ids[:30])], record_selection=True)  # prefill
        rows = [logits, drv.step([("a", ids[30:44])])[0]]  # a chunk on top of the cache
        rows += [drv.step([("a", ids[t:t + 1])])[0] for t in range(44, 52)]  # decode steps
        outs.append((torch.cat(rows), extras["msa_selected_block_ids"]))
    (ref, ref_sel), (got, got_sel) = outs
    for op, n in before.items():
        assert _executed(op) > n, f"{op} did not run on the kernel path"
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min().item() > 0.99999, cos
    assert ((got - ref).norm() / ref.norm()).item() < 1e-4
    assert ref_sel.keys() == got_sel.keys() and ref_sel
    for i in ref_sel:
        assert torch.equal(selection_sets(got_sel[i]), selection_sets(ref_sel[i])), f"layer {i}: selected blocks differ"
