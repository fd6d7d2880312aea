"""TP = N equals TP = 1 (CPU, gloo, float32): the greedy tokens, the logits within 1e-5 relative, and the MSA
selected-block sets per (token, KV head) — on tiny Llama and tiny MiniMax-M3 at TP 2, and on tiny M3 at TP 4, where
TP exceeds the 2 KV heads and 2 index heads (each is held by two ranks); all again with expert parallelism."""

from __future__ import annotations

import pytest
import torch

from distributed.tp_harness import run_case, spawn_ranks
from models.m3_helpers import selection_sets


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return {case: run_case(case, 0, 1) for case in ("llama", "m3")}


def _check(ref: dict, ranks: list[dict], case: str) -> None:
    got = ranks[0][case]
    assert got["tokens"] == ref["tokens"], case
    scale = ref["logits"].abs().max()
    err = (got["logits"] - ref["logits"]).abs().max()
    assert err <= 1e-5 * scale, f"{case}: max |logit diff| {err} > 1e-5 x {scale}"
    for layer, (heads, sel) in ref["selections"].items():
        for rank in ranks:
            held, rank_sel = rank[case]["selections"][layer]
            for i, head in enumerate(held):
                assert torch.equal(selection_sets(rank_sel[i:i + 1]), selection_sets(sel[head:head + 1])), \
                    (case, layer, head)
    if case != "llama":
        assert ref["selections"], "the tiny M3 has MSA layers: selections must be recorded"


def test_tp2_llama_and_m3_equal_tp1(reference):
    ranks = spawn_ranks(2, ["llama", "m3", "m3-ep"])
    _check(reference["llama"], ranks, "llama")
    _check(reference["m3"], ranks, "m3")
    _check(reference["m3"], ranks, "m3-ep")


def test_tp4_m3_replicated_kv_and_index_heads_equal_tp1(reference):
    ranks = spawn_ranks(4, ["m3", "m3-ep"])
    _check(reference["m3"], ranks, "m3")
    _check(reference["m3"], ranks, "m3-ep")
