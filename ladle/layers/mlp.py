"""Gated MLP: down_proj(act(gate_proj(x), up_proj(x))) with gate and up in one GEMM.

Llama-family MLPs use act = silu_and_mul (SwiGLU); MiniMax-M3's dense layers and its unfolded shared expert use
act = swigluoai_and_mul (clamped SwiGLU, alpha 1.702, limit 7; design/minimax_m3.md §3.7). Tensor parallel as
Megatron's MLP: gate_up column-parallel over the intermediate dim, down row-parallel (one all-reduce at the end).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from ladle.layers.activation import silu_and_mul, swigluoai_and_mul
from ladle.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden].

    gate_up_proj: MergedColumnParallelLinear(hidden, [I, I]) (shards 0 = gate, 1 = up);
    down_proj: RowParallelLinear(I, hidden). act: "silu" or "swigluoai" (then swiglu_alpha / swiglu_limit).
    reduce_results False leaves the down projection's partial sum (a caller that reduces once, e.g. FusedMoE).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False,
                 dtype: Optional[torch.dtype] = None, device: "torch.device | str | None" = None,
                 tp_rank: int = 0, tp_size: int = 1, reduce_results: bool = True,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> None:
        super().__init__()
        tp = dict(dtype=dtype, device=device, tp_rank=tp_rank, tp_size=tp_size)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias, **tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results,
                                           **tp)
        if act == "silu":
            self.act_fn = silu_and_mul
        elif act == "swigluoai":
            self.act_fn = functools.partial(swigluoai_and_mul, alpha=swiglu_alpha, limit=swiglu_limit)
        else:
            raise ValueError(f"unsupported MLP activation {act!r} (silu, swigluoai)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
