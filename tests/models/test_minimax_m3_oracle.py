"""MiniMax-M3 against transformers' own `minimax_m3_vl` (the oracle; tests only), float32 on CPU.

Recipe and traps: design/minimax_m3_vs_transformers.md §C (load the release layout with
MiniMaxM3SparseForConditionalGeneration in float32; its sparse layers must have an `indexer`; compare selections
as sets per (token, group) only where the top-k has a clear margin).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from m3_helpers import prompt

from drivers.minimax_m3_paged import PagedDriver, load_m3_dir
from ladle.kernels.msa_indexer import msa_block_scores

M = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
pytest.importorskip("transformers").logging.set_verbosity_error()  # the vision tower is absent on purpose

COS_MIN = 0.99999
TOPK, BLOCK = 4, 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hf(ckpt):
    model = M.MiniMaxM3SparseForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    layers = model.model.language_model.layers
    assert [layer.self_attn.indexer is not None for layer in layers] == [False, True, True, True], \
        "oracle built without sparse layers (missing sparse_attention_config?)"
    return model




@torch.no_grad()
def hf_forward(hf, ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """logits [T, V] and per-sparse-layer selections [ni, T, k'] (transformers' order, -1 padded)."""
    sel, hooks = {}, []
    for i, layer in enumerate(hf.model.language_model.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda mod, args, out, i=i: sel.__setitem__(i, out[0])))
    try:
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return logits, sel


def clear_margin_rows(index_q: torch.Tensor, index_k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[ni, T] bool: rows whose (k-1)-th and k-th best non-local block scores differ by > 1e-3 (no near-ties)."""
    bs = msa_block_scores(index_q, index_k, positions, BLOCK)
    own = (positions // BLOCK)[None, :, None].expand(bs.shape[0], -1, 1)
    bs = bs.scatter(-1, own, float("-inf"))
    top = torch.topk(bs, min(TOPK, bs.shape[-1]), dim=-1).values
    if top.shape[-1] < TOPK:
        return torch.ones(bs.shape[:2], dtype=torch.bool)
    gap = top[..., TOPK - 2] - top[..., TOPK - 1]
    return ~torch.isfinite(top[..., TOPK - 1]) | (gap > 1e-3)


def as_sets(sel: torch.Tensor) -> torch.Tensor:
    """[ni, T, k'] block ids with -1 padding -> [ni, T, TOPK] sorted ids, padding last (set comparison)."""
    sel = sel.long()
    if sel.shape[-1] < TOPK:
        sel = torch.nn.functional.pad(sel, (0, TOPK - sel.shape[-1]), value=-1)
    return torch.sort(torch.where(sel < 0, torch.full_like(sel, 1 << 30), sel), dim=-1).values


@pytest.mark.parametrize("n", [40, 160, 733])
def test_prefill_logits_and_selections_match_transformers(hf, lm, n):
    ids = prompt(n, seed=n)
    ref, ref_sel = hf_forward(hf, ids)
    captured, hooks = {}, []
    for i, layer in enumerate(lm.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda mod, args, out, i=i: captured.__setitem__(i, out)))
    drv = PagedDriver(lm, num_blocks=n // BLOCK + 4)
    try:
        logits, extras = drv.step([("a", ids)], record_selection=True)
    finally:
        for h in hooks:
            h.remove()
    cos = torch.nn.functional.cosine_similarity(logits, ref, dim=-1)
    assert cos.min().item() >= COS_MIN, f"min cosine {cos.min().item()} at position {cos.argmin().item()}"
    positions = torch.arange(n)
    checked = 0
    for layer, ours in extras["msa_selected_block_ids"].items():
        ok = clear_margin_rows(*captured[layer], positions)
        assert ok.float().mean() > 0.9
        a, b = as_sets(ours), as_sets(ref_sel[layer])
        bad = ((a != b).any(-1) & ok).nonzero().tolist()
        assert not bad, f"layer {layer}: (group, token) {bad[:3]}: {a[tuple(bad[0])]} vs {b[tuple(bad[0])]}"
        checked += int(ok.sum())
    assert checked > 0
    if n > TOPK * BLOCK:  # selection is really active: groups choose differently somewhere
        sel = extras["msa_selected_block_ids"][1]
        assert not torch.equal(sel[0], sel[1])


@torch.no_grad()
def hf_greedy(hf, ids: list[int], steps: int) -> list[int]:
    """Greedy loop through transformers' own cache (DynamicCache with the sparse index-K layers)."""
    out = hf(input_ids=torch.tensor([ids]), use_cache=True)
    toks = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = hf(input_ids=torch.tensor([[toks[-1]]]), cache=out.past_key_values, use_cache=True)
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


def test_greedy_continuations_alone_and_batched(hf, lm):
    prompts = {"long": prompt(150, 1), "mid": prompt(70, 2), "short": prompt(33, 3)}
    expected = {k: hf_greedy(hf, v, 32) for k, v in prompts.items()}
    alone = PagedDriver(lm, num_blocks=16).greedy({"long": prompts["long"]}, 32)
    assert alone["long"] == expected["long"]
    batched = PagedDriver(lm, num_blocks=40, seed=7).greedy(prompts, 32)
    assert batched == expected


def test_decode_batch_with_tokens_equal_to_kv_heads(hf, lm):
    """T == num_kv_heads == 2: a [heads, tokens] vs [tokens, heads] mix-up in the selection layout would pass
    shape checks; comparing per (token, group) with the oracle and the logits catches it."""
    a, b = prompt(150, 11), prompt(171, 12)
    drv = PagedDriver(lm, num_blocks=30)
    drv.step([("a", a[:-1]), ("b", b[:-1])])
    logits, extras = drv.step([("a", a[-1:]), ("b", b[-1:])], record_selection=True)
    for t, ids in enumerate((a, b)):
        ref, ref_sel = hf_forward(hf, ids)
        cos = torch.nn.functional.cosine_similarity(logits[t], ref[-1], dim=0)
        assert cos.item() >= COS_MIN
        for layer, sel in extras["msa_selected_block_ids"].items():
            assert sel.shape == (2, 2, TOPK)
            for g in range(2):
                ours = {x for x in sel[g, t].tolist() if x >= 0}
                assert ours == {x for x in ref_sel[layer][g, -1].tolist() if x >= 0}
                assert sel[g, t, len(ours) - 1].item() == (len(ids) - 1) // BLOCK  # local block last


def _rewrite_text_only(src: str, dst: str) -> None:
    """Text-only repack: `model.` prefix, text config at the root."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst)
    tensors = {}
    for fn in sorted(os.listdir(src)):
        if fn.endswith(".safetensors"):
            for k, v in load_file(os.path.join(src, fn)).items():
                tensors[k[len("language_model."):]] = v
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        tc = dict(json.load(f)["text_config"], model_type="minimax_m3")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(tc, f)


def _save_transformers_fused(hf, dst: str) -> None:
    """What MiniMaxM3VLForCausalLM.save_pretrained writes: fused experts, indexer.*, transformers config form."""
    text = M.MiniMaxM3VLForCausalLM(hf.config.text_config).eval()
    sd = {}
    for k, v in hf.state_dict().items():
        if k.startswith("model.language_model."):
            sd["model." + k[len("model.language_model."):]] = v
        elif k.startswith("lm_head."):
            sd[k] = v
    text.load_state_dict(sd, strict=True)
    text.save_pretrained(dst)


def test_three_checkpoint_layouts_load_to_identical_logits(hf, lm, ckpt, tmp_path):
    ids = prompt(90, 5)
    ref = PagedDriver(lm, num_blocks=10).prefill("a", ids)
    _rewrite_text_only(ckpt, str(tmp_path / "text_only"))
    _save_transformers_fused(hf, str(tmp_path / "fused"))
    with open(tmp_path / "fused" / "config.json") as f:
        assert "layer_types" in json.load(f)  # really the transformers config form
    for d in ("text_only", "fused"):
        other = load_m3_dir(str(tmp_path / d), torch.float32)
        got = PagedDriver(other, num_blocks=10).prefill("a", ids)
        assert torch.equal(got, ref), d
