"""FusedMoE: sigmoid router with selection-only bias + SwiGLU-OAI experts, the shared expert folded in.

Math (design/minimax_m3.md §3.6, §3.8; checked against transformers `MiniMaxM3VLSparseMoeBlock`):
  logits = x·W_gᵀ in float32; σ = sigmoid(logits); choose top-k of σ + bias (bias for choice only);
  w_e = σ_e / Σ_chosen σ, then × routed_scaling_factor; y = Σ_e w_e·Expert_e(x) + Shared(x).
  Expert(x) = swigluoai(x·W1ᵀ, x·W3ᵀ)·W2ᵀ with gate = W1 (first half of `w13`), up = W3 (second half).
The math lives in two ops, each with its torch reference beside its Triton kernel: `ladle.kernels.moe_router`
(routing) and `ladle.kernels.fused_moe` (experts); `backends.triton_moe` asks for the kernels.

Storage: `w13 [E(+1), 2 I_r, H]` and `w2 [E(+1), H, I_r]` in the model dtype, I_r = I / tp_size (the experts'
intermediate dim is split over ranks: rank r holds gate and up rows [r I_r, (r+1) I_r) and the matching w2
columns; summing the ranks' outputs gives y). When the shared expert has the routed width (M3: 3072 = 3072) it is
stored as row E and the router appends it as one more column that every token selects with weight exactly 1.0 —
never renormalised, never scaled. A shared expert of another width is a separate `GatedMLP` (`shared_experts`).

Expert parallelism (`expert_parallel=True`, vLLM's --enable-expert-parallel): instead of splitting I, rank r holds
the whole experts [r E/tp, (r+1) E/tp) (local rows 0..E/tp-1, I_r = I) and a folded shared expert whole; every rank
routes all tokens with the replicated router, keeps the choices of its own experts (the others get weight 0 on
local row 0), rank 0 alone adds the folded shared column, and the all-reduce sums the routed (and shared) parts.
"""

from __future__ import annotations

from typing import Hashable, Optional, Union

import torch
from torch import nn

from ladle.kernels.fused_moe import fused_moe, into
from ladle.kernels.moe_router import moe_router
from ladle.layers.backends import op_backends
from ladle.layers.linear import (check_shape, all_reduce_across_ranks, head_shard, replicated_weight_loader,
                                 set_weight_loader)
from ladle.layers.mlp import GatedMLP
from ladle.layers.quant_slot import scoped_moe_method

ExpertId = Union[int, str, None]

# Tokens per fused-MoE call (`FusedMoE._experts`). The kernels keep one row per (token, slot) before the combine,
# T x k x H values (bf16 at prefill sizes with bf16 activations, `slot_dtype_for`; float32 otherwise; FP8 GEMM 2's
# aligned rows add the padding rows): at one TP4 rank of M3 (k = 4 + the shared column, H 6144) a 32K-token step in
# one call needs 2.0 GB of bf16 rows, the largest activation of the step, and the memory profile takes it from the KV
# pool. H200 (round 14 call 3, benchmarks/results/round14/call3/fp8_moe_prefill.log, one run): a 32K-token step's FP8
# MoE as 4 x 8192 = 4 x 2,498 us, 2 x 16384 = 2 x 4,604 us (1.09x, with 128-row tiles above 8192 tokens: the note
# at MOE_TILES "fp8_block"), one call 8,761 us (1.14x). Served (round 15 call 1, results/round15/README.md; issue
# 11's line, vocab-parallel FP8 proxy): 16384-token chunks against round 14's 8192, c = 128 2,090.7 against 2,012.9
# output tok/s (+3.9%; another machine) with the KV pool 1,186,048 tokens against 1,218,560 (-2.7%) and no
# preemption; c = 32 +1.2%. One 32768-token call would take about 1 GB more of the pool, which c = 128 (about 1.18 M
# tokens at once) cannot spare. Decode and CUDA-graph sizes are far below this.
MOE_CHUNK_TOKENS = 16384


class UnquantizedFusedMoEMethod:
    """The plain method of FusedMoE: expert tables in the model dtype, run by the `fused_moe` op."""

    def create_weights(self, layer: nn.Module, num_rows: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: Optional[torch.dtype], device, weight_loader) -> None:
        """Register `layer.w13` [num_rows, 2 I_r, H] and `layer.w2` [num_rows, H, I_r] (uninitialised)."""
        i_r = intermediate_size_per_partition
        for name, shape in (("w13", (num_rows, 2 * i_r, hidden_size)), ("w2", (num_rows, hidden_size, i_r))):
            p = nn.Parameter(torch.empty(*shape, dtype=params_dtype, device=device), requires_grad=False)
            layer.register_parameter(name, set_weight_loader(p, weight_loader, 1))

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              use_triton: bool, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, H], topk_ids / topk_weights [T, k] (rows of w13 / w2, weights) -> [T, H] in x.dtype, copied into
        `out` when given ([T, H] contiguous: FusedMoE passes a chunk's rows of its output) and returned."""
        return into(out, fused_moe(x, layer.w13, layer.w2, topk_ids, topk_weights, layer.swiglu_alpha,
                                   layer.swiglu_limit, use_triton=use_triton))


class FusedMoE(nn.Module):
    """Router + routed experts + one shared expert (shared_intermediate_size 0: none).

    forward(x [T, H], fuse_shared=True) -> [T, H] in x.dtype. fuse_shared False runs the shared expert as its own
    op call and adds it (kept to check that folding it in changes nothing). `route(x)` exposes the routed choice.
    Parameters: gate_weight [E, H] float32 and e_score_correction_bias [E] float32 (replicated on every rank),
    w13, w2 (module doc; created by `quant_method`, an UnquantizedFusedMoEMethod now). Checkpoint names map through the model's name table to
    `weight_loader(param, loaded_weight, shard_id=None, expert_id=None)`.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int = 0, routed_scaling_factor: float = 1.0, swiglu_alpha: float = 1.702,
                 swiglu_limit: float = 7.0, dtype: Optional[torch.dtype] = None,
                 device: "torch.device | str | None" = None, tp_rank: int = 0, tp_size: int = 1,
                 reduce_results: bool = True, quant_method: Optional[UnquantizedFusedMoEMethod] = None,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.intermediate_size, self.routed_scaling_factor = intermediate_size, routed_scaling_factor
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.tp_rank, self.tp_size, self.reduce_results = tp_rank, tp_size, reduce_results
        self.expert_parallel = expert_parallel and tp_size > 1
        if self.expert_parallel:
            if num_experts % tp_size:
                raise ValueError(f"expert parallelism: {num_experts} experts do not split over tp_size {tp_size}")
            self.num_local_experts = num_experts // tp_size
            self.expert_start = tp_rank * self.num_local_experts
            self.intermediate_size_per_partition, self.intermediate_start = intermediate_size, 0
        else:
            self.num_local_experts, self.expert_start = num_experts, 0
            self.intermediate_size_per_partition = head_shard(intermediate_size, tp_rank, tp_size)[1]
            self.intermediate_start = tp_rank * self.intermediate_size_per_partition
        self.has_shared = shared_intermediate_size > 0
        self.shared_folded = shared_intermediate_size == intermediate_size
        self.shared_experts = None
        if self.has_shared and not self.shared_folded:
            self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size, "swigluoai", dtype=dtype,
                                           device=device, tp_rank=tp_rank, tp_size=tp_size, reduce_results=False,
                                           swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)

        def router_param(*shape):  # the router stays float32 and whole on every rank
            p = nn.Parameter(torch.empty(*shape, dtype=torch.float32, device=device), requires_grad=False)
            return set_weight_loader(p, replicated_weight_loader, None)

        self.gate_weight = router_param(num_experts, hidden_size)
        self.e_score_correction_bias = router_param(num_experts)
        self.quant_method = quant_method or scoped_moe_method() or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts + int(self.shared_folded), hidden_size,
                                         self.intermediate_size_per_partition, dtype, device, self.weight_loader)

    # -- loading -------------------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None,
                      expert_id: ExpertId = None) -> int:
        """Copy one checkpoint expert tensor (full, all ranks) into this rank's slice.

        shard_id: "w1" (gate [I, H]), "w3" (up [I, H]), "w13" (gate rows then up rows [2I, H]) into `w13`;
        "w2" (down [H, I]) into `w2`. expert_id: routed expert 0 <= e < E; "shared" = the folded shared expert
        (row E); None = every routed expert at once (a tensor with a leading [E] dim, transformers' fused layout).
        Returns the elements written (0 for an expert another rank holds under expert parallelism). Raises ValueError on a bad shard / expert or a shape mismatch."""
        if expert_id is None:
            check_shape(f"{shard_id} of all experts", loaded_weight.shape[:1], [self.num_experts])
            return sum(self.weight_loader(param, loaded_weight[e], shard_id, e) for e in range(self.num_experts))
        row = self._expert_row(expert_id)
        if row is None:
            return 0
        i, i_r, h = self.intermediate_size, self.intermediate_size_per_partition, self.hidden_size
        start = self.intermediate_start
        if shard_id == "w13":
            check_shape("w13", loaded_weight.shape, [2 * i, h])
            gate, up = loaded_weight.split(i, dim=0)
            return self.weight_loader(param, gate, "w1", expert_id) + self.weight_loader(param, up, "w3", expert_id)
        if shard_id in ("w1", "w3"):
            check_shape(f"{shard_id} of expert {expert_id}", loaded_weight.shape, [i, h])
            dst = param.data[row].narrow(0, 0 if shard_id == "w1" else i_r, i_r)
            dst.copy_(loaded_weight.narrow(0, start, i_r))
        elif shard_id == "w2":
            check_shape(f"w2 of expert {expert_id}", loaded_weight.shape, [h, i])
            dst = param.data[row]
            dst.copy_(loaded_weight.narrow(1, start, i_r))
        else:
            raise ValueError(f"unknown expert shard {shard_id!r} (w1, w3, w13, w2)")
        return dst.numel()

    def _expert_row(self, expert_id: ExpertId) -> Optional[int]:
        """This rank's table row of `expert_id`; None for a routed expert another rank holds."""
        if expert_id == "shared":
            if not self.shared_folded:
                raise ValueError("this MoE has no folded shared expert row")
            return self.num_local_experts
        if not isinstance(expert_id, int) or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id!r} not in [0, num_experts {self.num_experts})")
        local = expert_id - self.expert_start
        return local if 0 <= local < self.num_local_experts else None

    # -- forward -------------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, with_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k(+1)] int32, topk_weights [T, k(+1)] float32; routed weights sum to
        routed_scaling_factor; with_shared appends the folded shared column E with weight 1.0)."""
        return moe_router(x, self.gate_weight, self.e_score_correction_bias, self.top_k, self.routed_scaling_factor,
                          shared_expert=with_shared, use_triton=op_backends().triton_moe)

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert alone, weight 1: [T, H] in x.dtype (this rank's partial sum)."""
        if self.shared_experts is not None:
            return self.shared_experts(x)
        ids = torch.full((x.shape[0], 1), self.num_local_experts, dtype=torch.int32, device=x.device)
        ones = torch.ones((x.shape[0], 1), dtype=torch.float32, device=x.device)
        return self._experts(x, ids, ones)

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The quant method's experts on x [T, H] with routes ids / weights [T, k] -> [T, H] in x.dtype, in
        token chunks of at most MOE_CHUNK_TOKENS (module constant; every token's result is independent of the
        other tokens', so chunking changes no value beyond the kernels' own tile-size effects)."""
        use_triton = op_backends().triton_moe
        num_tokens = x.shape[0]
        if num_tokens <= MOE_CHUNK_TOKENS:
            return self.quant_method.apply(self, x, ids, weights, use_triton=use_triton)
        out = torch.empty_like(x)
        for start in range(0, num_tokens, MOE_CHUNK_TOKENS):
            rows = slice(start, min(start + MOE_CHUNK_TOKENS, num_tokens))
            # the chunk's result lands in its rows of `out`: the FP8 op's combine writes them, the other ops copy
            self.quant_method.apply(self, x[rows], ids[rows], weights[rows], use_triton=use_triton, out=out[rows])
        return out

    def local_route(self, x: torch.Tensor, with_shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` in this rank's table rows: under expert parallelism the choices of other ranks' experts get
        weight 0 (on local row 0) and only rank 0 appends the folded shared column (local row E/tp)."""
        if not self.expert_parallel:
            return self.route(x, with_shared=with_shared)
        ids, w = self.route(x)
        local = ids - self.expert_start
        own = (local >= 0) & (local < self.num_local_experts)
        ids = torch.where(own, local, torch.zeros_like(local)).to(torch.int32)
        w = torch.where(own, w, torch.zeros_like(w))
        if with_shared and self.tp_rank == 0:
            ids = torch.cat([ids, ids.new_full((ids.shape[0], 1), self.num_local_experts)], dim=1)
            w = torch.cat([w, w.new_ones((w.shape[0], 1))], dim=1)
        return ids, w

    def forward(self, x: torch.Tensor, fuse_shared: bool = True) -> torch.Tensor:
        fold = fuse_shared and self.shared_folded
        ids, w = self.local_route(x, with_shared=fold)
        out = self._experts(x, ids, w)
        # a folded shared row is whole on every expert-parallel rank: rank 0 alone adds it
        shared_here = self.shared_experts is not None or not self.expert_parallel or self.tp_rank == 0
        if self.has_shared and not fold and shared_here:
            out = out + self.shared_expert(x)
        return all_reduce_across_ranks(out, self.tp_size) if self.reduce_results else out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, I_per_rank={self.intermediate_size_per_partition}, "
                f"shared={'folded' if self.shared_folded else self.shared_experts is not None}, "
                f"tp={self.tp_rank}/{self.tp_size}, ep={self.expert_parallel}")
