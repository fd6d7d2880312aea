"""Shared by the greedy parity tests (ladle vs transformers on the real SmolLM2 GGUF, float32): the reference
model and the near-tie rule.

Near-tie rule: where ladle's greedy token and the reference's differ, the divergence is tolerated only when the
reference's top-2 logit gap is below NEAR_TIE_GAP and each side's token is in the other's top TOP_K (float32
summation order alone can flip such a choice); the comparison of that sequence stops there.
"""

from __future__ import annotations

import os

import torch

NEAR_TIE_GAP = 1e-4
TOP_K = 5


def transformers_gguf_model(gguf_path: str):
    """transformers' AutoModelForCausalLM on the GGUF at `gguf_path`, de-quantized to float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                dtype=torch.float32).eval()


def ladle_top_tokens(logprobs_at_step) -> list[int]:
    """Token ids of ladle's top TOP_K at one step, best first, from a `logprobs=TOP_K` offline output entry (a dict
    token id -> Logprob: the top ones ranked 1..TOP_K, and the sampled token, ranked after them when not among them)."""
    return sorted(logprobs_at_step, key=lambda tid: logprobs_at_step[tid].rank)[:TOP_K]


def near_tie(ref_logits: torch.Tensor, ladle_token: int, ref_token: int, ladle_top: list[int]) -> tuple[bool, float]:
    """(tolerated, gap) of a divergence at one step; ref_logits [V] are the reference's raw logits there."""
    top2 = torch.topk(ref_logits, 2).values
    gap = float(top2[0] - top2[1])
    ref_top = torch.topk(ref_logits, TOP_K).indices.tolist()
    return gap < NEAR_TIE_GAP and ladle_token in ref_top and ref_token in ladle_top, gap
