"""MiniMax-M3 tiny and `small` presets: greedy tokens of the CUDA kernel path (OpBackends.kernels(), fused norms,
MSA indexer + sparse attention, fused MoE) against the CPU float32 torch reference path (issue 6, GPU tests).
Skipped without CUDA (marked gpu).

Tolerances (stated); at the first differing token the comparison of that prompt stops (the continuations differ
from then on):
* float32 on the GPU: a greedy token may differ only where the reference's top-2 logit gap is below 1e-3 x std of
  that logit row (a near tie the summation order can flip; fp32 kernels with IEEE dots agree to ~1e-6 relative).
  Selected MSA blocks are compared as sets per (layer, kv head, token): >= 99.9% identical.
* bf16 on the GPU against the same float32 reference: at the first differing token, each side's token must be in
  the other's top 5 (the logprob-closeness rule vLLM's model tests use). bf16 can flip a near-tied MSA block choice,
  and one flipped block moves the logits by far more than bf16 rounding, so a gap bound does not hold there (seen on
  the `small` preset: token 7 of a 2300-token prompt flipped at a reference gap of 0.52 std).
  The router is discrete in the same way: where the k-th and (k+1)-th routed choice scores of a token are within
  bf16's relative resolution (2^-7) in some MoE layer, bf16 noise picks either expert and the logits move by far more
  than rounding (seen on the `tiny` preset after the layer-kit refactor, issue 10: prompt 1, token 1, experts 1 vs 6
  at choice scores 0.6094 vs 0.6061 in layer 3). Such a first divergence is accepted when the bf16 run recorded that
  near tie for that token at that step; any other divergence must pass the top-5 rule.
"""

from __future__ import annotations

import pytest
import torch

from ladle.layers.attention.metadata import OpBackends
from m3_helpers import selection_sets

from ladle.tools.checkpoint_m3 import make_checkpoint
from drivers.minimax_m3_paged import PagedDriver, load_m3_dir

pytestmark = pytest.mark.gpu

# preset -> (prompt lengths: longer than top-k x block so the sparse selection drops blocks; KV blocks per driver)
CASES = {"tiny": ([150, 70, 33], 48), "small": ([2300, 700, 140], 64)}
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=sorted(CASES))
def preset_ckpt(request, tmp_path_factory):
    return request.param, make_checkpoint(str(tmp_path_factory.mktemp("m3") / request.param), request.param)


def _prompts(lengths: list[int], vocab: int) -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return {i: torch.randint(3, vocab - 3, (n,), generator=g).tolist() for i, n in enumerate(lengths)}


def greedy_trace(drv: PagedDriver, prompts: dict, n: int, record: bool = False):
    """Greedy continuations with each step's top-2 gap in units of the row's logit std and its top-5 token ids.
    Returns ({sid: [n tokens]}, {sid: [n gaps]}, {sid: [n top-5 lists]}, prefill extras (selected blocks when
    `record`))."""
    for sid in prompts:
        drv.add(sid)
    logits, extras = drv.step(list(prompts.items()), record_selection=record)
    ends = torch.tensor([len(p) for p in prompts.values()]).cumsum(0) - 1
    rows = logits[ends.to(logits.device)]
    toks, gaps, top5 = ({s: [] for s in prompts} for _ in range(3))
    for step in range(n):
        rows = rows.float()
        top = rows.topk(5, dim=-1)
        gap = ((top.values[:, 0] - top.values[:, 1]) / rows.std(dim=-1)).tolist()
        for sid, ids, g in zip(prompts, top.indices.tolist(), gap):
            toks[sid].append(ids[0])
            gaps[sid].append(g)
            top5[sid].append(ids)
        if step + 1 < n:
            rows, _ = drv.step([(sid, [toks[sid][-1]]) for sid in prompts])
    return toks, gaps, top5, extras


def assert_same_greedy(got: dict, ref: dict, ref_gaps: dict, tol: float) -> None:
    for sid in ref:
        for j, (a, b) in enumerate(zip(got[sid], ref[sid])):
            if a != b:
                assert ref_gaps[sid][j] < tol, (f"prompt {sid}: token {j} is {a}, reference {b}, and the reference's "
                                                f"top-2 gap {ref_gaps[sid][j]:.3g} std is not a near tie (< {tol})")
                break


def assert_top5_close(got: dict, got_top5: dict, ref: dict, ref_top5: dict, router_ties: dict | None = None) -> None:
    for sid in ref:
        for j, (a, b) in enumerate(zip(got[sid], ref[sid])):
            if a != b:
                if router_ties is not None and router_ties[sid][j]:
                    break  # a routed-expert near tie at this token (module docstring): either expert is bf16-correct
                assert a in ref_top5[sid][j] and b in got_top5[sid][j], (
                    f"prompt {sid}: token {j} is {a} (top 5 {got_top5[sid][j]}), reference {b} "
                    f"(top 5 {ref_top5[sid][j]}): not within each other's top 5")
                break


@pytest.fixture(scope="module")
def reference(preset_ckpt):
    preset, ckpt = preset_ckpt
    lengths, blocks = CASES[preset]
    model = load_m3_dir(ckpt, torch.float32, "cpu")
    prompts = _prompts(lengths, model.config.vocab_size)
    return prompts, greedy_trace(PagedDriver(model, blocks), prompts, NEW_TOKENS, record=True)


def test_fp32_kernel_path_greedy_matches_cpu_reference(preset_ckpt, reference):
    preset, ckpt = preset_ckpt
    prompts, (ref, ref_gaps, _, ref_x) = reference
    drv = PagedDriver(load_m3_dir(ckpt, torch.float32, "cuda"), CASES[preset][1], backends=OpBackends.kernels())
    got, _, _, got_x = greedy_trace(drv, prompts, NEW_TOKENS, record=True)
    assert_same_greedy(got, ref, ref_gaps, tol=1e-3)
    layers = sorted(ref_x["msa_selected_block_ids"])
    assert layers and layers == sorted(got_x["msa_selected_block_ids"])
    rows = same = 0
    for i in layers:
        a, b = selection_sets(got_x["msa_selected_block_ids"][i]), selection_sets(ref_x["msa_selected_block_ids"][i])
        assert a.shape == b.shape
        rows += a.shape[0] * a.shape[1]
        same += (a == b).all(-1).sum().item()
    assert same / rows >= 0.999, f"selected block sets agree on {same}/{rows} (layer, head, token) rows"


def test_bf16_kernel_path_greedy_matches_cpu_reference(preset_ckpt, reference):
    preset, ckpt = preset_ckpt
    prompts, (ref, _, ref_top5, _) = reference
    model = load_m3_dir(ckpt, torch.bfloat16, "cuda")
    drv = PagedDriver(model, CASES[preset][1], backends=OpBackends.kernels())
    with RouterNearTies(model) as ties:
        got, _, got_top5, _ = greedy_trace(drv, prompts, NEW_TOKENS)
    assert_top5_close(got, got_top5, ref, ref_top5, ties.per_step(prompts))


class RouterNearTies:
    """Records, for every forward of the model, which token rows had a routed-expert near tie in some MoE layer:
    the k-th and (k+1)-th choice scores (sigmoid(x W_g^T) + bias, fp32) within a relative 2^-7 (bf16 resolution)."""

    REL = 2.0 ** -7

    def __init__(self, model) -> None:
        from ladle.layers.moe import FusedMoE

        self.moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
        self.calls: list[torch.Tensor] = []  # per forward: [T] bool, OR over MoE layers (appended by layer 0's hook)
        self.hooks = []

    def __enter__(self) -> "RouterNearTies":
        for i, moe in enumerate(self.moes):
            self.hooks.append(moe.register_forward_hook(lambda mod, inp, out, i=i: self._record(mod, inp[0], i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()

    def _record(self, moe, x: torch.Tensor, i: int) -> None:
        choice = torch.sigmoid(x.float() @ moe.gate_weight.float().T) + moe.e_score_correction_bias.float()
        top = choice.topk(moe.top_k + 1, dim=-1).values
        tie = (top[:, -2] - top[:, -1]) <= self.REL * top[:, -2].abs()
        if i == 0:
            self.calls.append(tie.cpu())
        else:
            self.calls[-1] |= tie.cpu()

    def per_step(self, prompts: dict) -> dict:
        """{sid: [bool per greedy token j]}: token j came from forward j (the prefill's last row, then one decode row
        per step), so a near tie at forward j for that row explains a flip of token j."""
        ends = (torch.tensor([len(p) for p in prompts.values()]).cumsum(0) - 1).tolist()
        out = {sid: [bool(self.calls[0][ends[r]])] for r, sid in enumerate(prompts)}
        for call in self.calls[1:]:
            for r, sid in enumerate(prompts):
                out[sid].append(bool(call[r]))
        return out
