"""Mixture of experts: sigmoid router with selection-only bias, SwiGLU-OAI experts, shared expert folded in.

Math (design/minimax_m3.md §3.6, §3.8; checked against transformers `MiniMaxM3VLSparseMoeBlock`):
  logits = x·W_gᵀ in float32; σ = sigmoid(logits); choose top-k of σ + bias (bias for choice only);
  w_e = σ_e / Σ_chosen σ, then × routed_scaling_factor; y = Σ_e w_e·Expert_e(x) + Shared(x).
  Expert(x) = swigluoai(x·W1ᵀ, x·W3ᵀ)·W2ᵀ with gate = W1 (first half of `w13`), up = W3 (second half).

Storage: `w13 [E(+1), 2I, H]` and `w2 [E(+1), H, I]` in the model dtype. When the shared expert has the routed
width (M3: 3072 = 3072), it is stored as row E and the fused path treats it as one more routed column that every
token selects with weight exactly 1.0 — never renormalised, never scaled. The unfused path (routed × scale, plus a
separate shared MLP) is kept as the reference and must agree (tests/models/test_minimax_m3_layers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swigluoai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, beta: float = 1.0) -> torch.Tensor:
    """Clamped SwiGLU (GPT-OSS style, non-interleaved): (clip(up,±limit) + beta) · g·σ(alpha·g), g = min(gate, limit).

    gate, up: [..., I] same dtype -> [..., I]. beta = 1.0 is M3's hard-coded "+1" (transformers MOD:190).
    """
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return (u + beta) * (g * torch.sigmoid(g * alpha))


def swigluoai_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, alpha: float, limit: float,
                  beta: float = 1.0) -> torch.Tensor:
    """One SwiGLU-OAI MLP: x [T, H], w13 [2I, H] = cat(gate, up) rows (gate first), w2 [H, I] -> [T, H]."""
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(swigluoai(gate, up, alpha, limit, beta), w2)


class MoE(nn.Module):
    """Router + routed experts + one shared expert.

    forward(x [T, H]) -> [T, H] in x.dtype. `route(x)` exposes the choice for tests.
    Parameters (checkpoint mapping in ladle/models/minimax_m3_weights.py):
      gate_weight [E, H] float32, e_score_correction_bias [E] float32,
      w13 [E+F, 2I, H], w2 [E+F, H, I] (F = 1 when the shared expert is folded in),
      shared_w13 [2Is, H], shared_w2 [H, Is] only when it is not folded (widths differ).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, routed_scaling_factor: float, swiglu_alpha: float,
                 swiglu_limit: float, swiglu_beta: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.routed_scaling_factor = routed_scaling_factor
        self.act = dict(alpha=swiglu_alpha, limit=swiglu_limit, beta=swiglu_beta)
        self.shared_folded = shared_intermediate_size == intermediate_size
        nf = num_experts + (1 if self.shared_folded else 0)

        def p(*shape, dt=dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

        self.gate_weight = p(num_experts, hidden_size, dt=torch.float32)
        self.e_score_correction_bias = p(num_experts, dt=torch.float32)
        self.w13 = p(nf, 2 * intermediate_size, hidden_size)
        self.w2 = p(nf, hidden_size, intermediate_size)
        if not self.shared_folded:
            self.shared_w13 = p(2 * shared_intermediate_size, hidden_size)
            self.shared_w2 = p(hidden_size, shared_intermediate_size)

    # -- routing -------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] float32 summing to routed_scaling_factor).

        The router GEMM runs in float32 on float32 weights (the checkpoint stores the router in fp32; a bf16
        transformers oracle would downcast it, minimax_m3_vs_transformers.md B2).
        """
        logits = F.linear(x.float(), self.gate_weight.float())  # [T, E] fp32
        scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.float()
        topk_ids = torch.topk(choice, self.top_k, dim=-1).indices  # ties: unspecified, as in transformers
        w = scores.gather(1, topk_ids)
        w = w / w.sum(dim=-1, keepdim=True) * self.routed_scaling_factor
        return topk_ids, w

    # -- experts -------------------------------------------------------------------------------------
    def _expert(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return swigluoai_mlp(x, w13, w2, **self.act)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_slots weights[t, s] · Expert_{ids[t, s]}(x[t]), accumulated in float32. ids index rows of w13/w2."""
        out = torch.zeros(x.shape[0], self.hidden_size, dtype=torch.float32, device=x.device)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.w13.shape[0]).tolist()
        tok = (order // ids.shape[1])
        wts = weights.reshape(-1)[order]
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            t_idx = tok[start:start + c]
            y = self._expert(x[t_idx], self.w13[e], self.w2[e])
            out.index_add_(0, t_idx, y.float() * wts[start:start + c, None])
            start += c
        return out

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """Shared expert output [T, H] in x.dtype (weight 1)."""
        if self.shared_folded:
            return self._expert(x, self.w13[self.num_experts], self.w2[self.num_experts])
        return self._expert(x, self.shared_w13, self.shared_w2)

    def forward(self, x: torch.Tensor, fuse_shared: bool = True, use_kernels: bool = False) -> torch.Tensor:
        """x [T, H] -> [T, H]. use_kernels: ladle.kernels router + fused MoE (graph-safe; each records its
        dispatch and falls back to its own reference when ineligible); needs the folded shared expert and beta 1."""
        if use_kernels and fuse_shared and self.shared_folded and self.act["beta"] == 1.0:
            from ladle.kernels.fused_moe import fused_moe
            from ladle.kernels.moe_router import moe_router

            ids, w = moe_router(x, self.gate_weight, self.e_score_correction_bias, self.top_k,
                                self.routed_scaling_factor, shared_expert=True)
            return fused_moe(x, self.w13, self.w2, ids, w, self.act["alpha"], self.act["limit"])
        ids, w = self.route(x)
        if fuse_shared and self.shared_folded:
            t = x.shape[0]
            shared_col = torch.full((t, 1), self.num_experts, dtype=ids.dtype, device=ids.device)
            ids = torch.cat([ids, shared_col], dim=1)
            w = torch.cat([w, torch.ones(t, 1, dtype=w.dtype, device=w.device)], dim=1)  # exactly 1.0
            return self._grouped(x, ids, w).to(x.dtype)
        routed = self._grouped(x, ids, w).to(x.dtype)
        return routed + self.shared_expert(x)
