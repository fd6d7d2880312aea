"""MiniMax-M3 MoE router: fp32 logits, sigmoid, biased choice, top-k, renormalise, scale, shared-expert column.

Math (design/minimax_m3.md §3.8):
    logits = x.float() @ W.float()^T                        [T, E] fp32 (torch matmul, IEEE fp32: no TF32)
    sig    = sigmoid(logits)
    choice = sig + e_score_correction_bias                  (selection only)
    ids    = top-k of choice (ties: the LOWER expert id wins)
    w      = sig[ids] / sum(sig[ids]) * routed_scaling_factor
With `shared_expert=True` a column k is appended with id E (the shared expert packed as expert #E of the fused
MoE table) and weight exactly 1.0 — never renormalised, never scaled (kernels_and_limits.md §1.6).

Kernel: `_router_topk_kernel`, one program per token, on the [T, E] fp32 logits. Grid (T,), no host sync.
"""

from __future__ import annotations

from typing import Optional

import torch

from ladle.kernels._common import decide_triton, triton_ok, tl, triton
from ladle.observe import dispatch
from ladle.observe.op_timing import timed_op

OP = "moe_router"
dispatch.register(OP, "triton", "cuda (or cpu+TRITON_INTERPRET); logits by torch fp32 matmul")


@triton.jit
def _router_topk_kernel(
    logits_ptr, bias_ptr, ids_ptr, w_ptr, num_experts, scaling,
    E_P2: tl.constexpr, TOPK: tl.constexpr, OUT_COLS: tl.constexpr, OUT_P2: tl.constexpr,
    HAS_BIAS: tl.constexpr, SHARED: tl.constexpr,
):
    t = tl.program_id(0)
    e = tl.arange(0, E_P2)
    ok = e < num_experts
    logit = tl.load(logits_ptr + t.to(tl.int64) * num_experts + e, mask=ok, other=0.0)
    sig = tl.sigmoid(logit)
    if HAS_BIAS:
        choice = sig + tl.load(bias_ptr + e, mask=ok, other=0.0)
    else:
        choice = sig
    choice = tl.where(ok, choice, float("-inf"))
    col = tl.arange(0, OUT_P2)
    ids = tl.zeros([OUT_P2], tl.int32)
    ws = tl.zeros([OUT_P2], tl.float32)
    for i in tl.static_range(TOPK):
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, e, E_P2), axis=0)
        wsel = tl.sum(tl.where(e == idx, sig, 0.0), axis=0)
        ids = tl.where(col == i, idx, ids)
        ws = tl.where(col == i, wsel, ws)
        choice = tl.where(e == idx, float("-inf"), choice)
    total = tl.sum(ws, axis=0)
    ws = ws / total * scaling
    if SHARED:
        ids = tl.where(col == TOPK, num_experts, ids)
        ws = tl.where(col == TOPK, 1.0, ws)
    base = t.to(tl.int64) * OUT_COLS
    tl.store(ids_ptr + base + col, ids, mask=col < OUT_COLS)
    tl.store(w_ptr + base + col, ws, mask=col < OUT_COLS)


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """[T, E] fp32 logits = x.float() @ W.float()^T with TF32 off for this matmul (routing must not depend on it)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return x.float() @ gate_weight.float().t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def moe_router_triton(
    x: torch.Tensor,  # [T, hidden] activations (any float dtype)
    gate_weight: torch.Tensor,  # [E, hidden] fp32 router weight
    e_score_correction_bias: Optional[torch.Tensor],  # [E] fp32, choice only
    top_k: int,
    routed_scaling_factor: float = 1.0,
    shared_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_ids [T, k(+1)] int32, topk_weights [T, k(+1)] fp32); the shared column, if any, is last."""
    assert x.dim() == 2 and gate_weight.dim() == 2 and x.shape[1] == gate_weight.shape[1]
    E = gate_weight.shape[0]
    assert 1 <= top_k <= E
    if e_score_correction_bias is not None:
        assert e_score_correction_bias.shape == (E,)
        bias = e_score_correction_bias.float().contiguous()
    else:
        bias = gate_weight  # unused
    logits = router_logits(x, gate_weight).contiguous()
    T = x.shape[0]
    cols = top_k + int(shared_expert)
    ids = torch.empty((T, cols), dtype=torch.int32, device=x.device)
    ws = torch.empty((T, cols), dtype=torch.float32, device=x.device)
    if T == 0:
        return ids, ws
    _router_topk_kernel[(T,)](
        logits, bias, ids, ws, E, float(routed_scaling_factor),
        E_P2=triton.next_power_of_2(E), TOPK=top_k, OUT_COLS=cols, OUT_P2=triton.next_power_of_2(cols + 1),
        HAS_BIAS=e_score_correction_bias is not None, SHARED=shared_expert, num_warps=1 if E <= 256 else 4,
    )
    return ids, ws


def moe_router_ref(
    x: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
    routed_scaling_factor: float = 1.0, shared_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference: choice in fp32 exactly as specified (stable sort: lower id wins ties), weights in
    float64 then cast to fp32."""
    logits = router_logits(x, gate_weight)
    sig = torch.sigmoid(logits)
    choice = sig + (e_score_correction_bias.float() if e_score_correction_bias is not None else 0.0)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = sig.double().gather(1, ids)
    w = w / w.sum(dim=-1, keepdim=True) * routed_scaling_factor
    if shared_expert:
        T, E = logits.shape
        ids = torch.cat([ids, torch.full((T, 1), E, dtype=ids.dtype, device=ids.device)], dim=1)
        w = torch.cat([w, torch.ones((T, 1), dtype=w.dtype, device=w.device)], dim=1)
    return ids.to(torch.int32), w.float()


@timed_op
def moe_router(
    x: torch.Tensor, gate_weight: torch.Tensor, e_score_correction_bias: Optional[torch.Tensor], top_k: int,
    routed_scaling_factor: float = 1.0, shared_expert: bool = False, *, use_triton: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching entry point (records op "moe_router")."""
    reason = triton_ok(x, gate_weight)
    run_fast = decide_triton(OP, x.shape[0], use_triton, reason)
    fn = moe_router_triton if run_fast else moe_router_ref
    return fn(x, gate_weight, e_score_correction_bias, top_k, routed_scaling_factor, shared_expert)
