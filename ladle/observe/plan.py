"""The model's plan (local GEMM shapes, parameter bytes, KV bytes per token) and the bytes one step moves.

Built once from the loaded model, duck-typed (no torch import; no import of layers/ or models/):
  - a GEMM is a module whose own 2-D parameter `weight` is [N_local, K_local] (ColumnParallel/RowParallel/QKV/
    Merged linears, the LM head): the shard this rank holds, so N and K are already after tensor parallelism;
  - a fused MoE is a module with `w13` [E', 2*I_local, H] and `w2` [E', H, I_local] and `top_k`, `num_experts`
    (E' = E, or E + 1 with the shared expert folded in as an extra row that every token uses);
  - the MoE router is its `gate_weight` [E, H] (float32);
  - everything else (norms, biases, embeddings) is "other" parameter bytes; the embedding table is gathered, so a
    step reads T rows of it, not the table.

Byte planes of one step (`step_bytes`), all in bytes, per rank:
  compute    weights_read = every dense GEMM weight once + the LM head when a token is sampled + the MoE experts
                            that receive a token (expected count under uniform routing: E * (1 - (1 - k/E)^T),
                            the occupancy formula for T tokens each picking k of E experts) + the router;
             activations  = sum over GEMM launches of (M*K + M*N) * activation bytes (read the input, write the
                            output) + T rows of the embedding table;
  persistent kv_written   = T * (2 * kv_heads * head_dim) * kv bytes, summed over layers (KV store);
             index_k_written = T * index_head_dim * kv bytes over MSA layers;
             kv_read      = sum over requests of seq_len * 2*kv_heads*head_dim * kv bytes per layer (each request's
                            K/V read once per layer: exact for decode, a lower bound for tiled prefill; an upper
                            bound for MSA sparse layers, which read only their selected blocks);
             index_k_read = sum over requests of seq_len * index_head_dim * kv bytes over MSA layers;
             scales       = 0 (no quantised KV in this plan);
  communication allreduce = per all-reduce 2*(tp-1)/tp * T*H*act bytes (ring all-reduce), 2 per layer + 1 for the
                            vocab-parallel embedding when tp > 1; 0 at tp = 1.
FLOPs: 2*M*N*K per GEMM launch (attention score/value FLOPs are not counted).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class GemmGroup:
    """One kind of GEMM in the plan: `count` launches per step (one per layer that has it), local [N, K] weight.
    m_source: "tokens" (M = tokens in the step), "sampled" (M = logits rows) or "expert" (M = tokens per expert)."""

    name: str
    n: int
    k: int
    count: int
    weight_bytes: int  # all `count` weights together
    m_source: str = "tokens"


@dataclass(frozen=True)
class MoEGroup:
    """The routed experts of all MoE layers: `layers` layers of `num_experts` experts, top_k each, local 2I and H."""

    layers: int
    num_experts: int
    top_k: int
    hidden: int
    inter_local: int
    expert_bytes: int  # one expert's w13 + w2 bytes (one layer)
    shared_folded: bool = False


@dataclass(frozen=True)
class ModelPlan:
    """What `step_bytes` needs: see the module docstring. Sizes in elements, bytes in bytes."""

    gemms: tuple[GemmGroup, ...]
    moe: Optional[MoEGroup]
    other_param_bytes: int
    hidden: int
    num_layers: int
    act_bytes: int
    kv_bytes_per_token: int  # K+V over all layers
    index_k_bytes_per_token: int  # index-K over all MSA layers
    tp_size: int = 1
    total_param_bytes: int = 0

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("gemms", "moe")}
        d["gemms"] = [g.__dict__ for g in self.gemms]
        d["moe"] = None if self.moe is None else self.moe.__dict__
        return d


@dataclass
class StepBatch:
    """One step's batch: tokens fed, logits rows computed, and each request's seq_len after the step."""

    num_tokens: int
    num_sampled: int
    seq_lens: list[int] = field(default_factory=list)


def _nbytes(p: Any) -> int:
    return int(p.numel()) * int(p.element_size())


def _layer_of(name: str) -> Optional[int]:
    m = _LAYER_RE.search("." + name + ".")
    return int(m.group(1)) if m else None


def plan_from_model(model: Any, kv_cache_specs: Iterable[Any], act_bytes: int, kv_bytes: Optional[int] = None,
                    tp_size: Optional[int] = None) -> ModelPlan:
    """Walk `model.named_modules()` once. kv_cache_specs: LayerCacheSpec-like (num_kv_heads, head_dim,
    index_head_dim). act_bytes / kv_bytes: bytes per activation / KV element (kv_bytes defaults to act_bytes)."""
    kv_bytes = act_bytes if kv_bytes is None else kv_bytes
    groups: dict[tuple[str, int, int, str], list[int]] = {}
    moe_layers, moe = 0, None
    other = total = 0
    layers: set[int] = set()
    tp = 1
    for name, mod in model.named_modules():
        tp = max(tp, int(getattr(mod, "tp_size", 1) or 1))
        own = dict(mod.named_parameters(recurse=False))
        total += sum(_nbytes(p) for p in own.values())
        layer = _layer_of(name)
        if layer is not None:
            layers.add(layer)
        if "w13" in own and "w2" in own and hasattr(mod, "top_k"):
            moe_layers += 1
            w13, w2 = own["w13"], own["w2"]
            moe = (int(mod.num_experts), int(mod.top_k), int(w2.shape[1]), int(w2.shape[2]),
                   (_nbytes(w13) + _nbytes(w2)) // int(w13.shape[0]), int(w13.shape[0]) > int(mod.num_experts))
            if "gate_weight" in own:
                g = own["gate_weight"]
                _add(groups, ("moe_router", int(g.shape[0]), int(g.shape[1]), "tokens"), _nbytes(g))
            other += sum(_nbytes(p) for k, p in own.items() if k not in ("w13", "w2", "gate_weight"))
            continue
        w = own.get("weight")
        is_embedding = type(mod).__name__.endswith("Embedding")
        if w is not None and w.dim() == 2 and not is_embedding:
            source = "sampled" if "LMHead" in type(mod).__name__ or name.endswith("lm_head") else "tokens"
            _add(groups, (name.rsplit(".", 1)[-1], int(w.shape[0]), int(w.shape[1]), source), _nbytes(w))
            other += sum(_nbytes(p) for k, p in own.items() if k != "weight")
        else:
            other += sum(_nbytes(p) for p in own.values())
    gemms = tuple(GemmGroup(n, N, K, c, b, s) for (n, N, K, s), (c, b) in groups.items())
    moe_group = None
    if moe is not None:
        e, k, h, i, eb, folded = moe
        moe_group = MoEGroup(moe_layers, e, k, h, i, eb, folded)
    specs = list(kv_cache_specs)
    kv_tok = sum(2 * s.num_kv_heads * s.head_dim for s in specs) * kv_bytes
    idx_tok = sum(int(getattr(s, "index_head_dim", 0)) for s in specs) * kv_bytes
    hidden = max((g.k for g in gemms if g.m_source == "sampled"), default=0) or (moe_group.hidden if moe_group else 0)
    return ModelPlan(gemms, moe_group, other, hidden, max(len(specs), len(layers)), act_bytes, kv_tok, idx_tok,
                     tp_size or tp, total)


def _add(groups: dict, key: tuple, nbytes: int) -> None:
    row = groups.setdefault(key, [0, 0])
    row[0] += 1
    row[1] += nbytes


def experts_hit(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts that T tokens reach when each picks top_k of E uniformly: E*(1-(1-k/E)^T)."""
    if num_tokens <= 0 or num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** num_tokens)


def tokens_per_expert(num_tokens: int, num_experts: int, top_k: int) -> int:
    """M of one routed expert GEMM under uniform routing: ceil(T*k/E) (at least 1 when T > 0)."""
    return max(1, math.ceil(num_tokens * top_k / num_experts)) if num_tokens > 0 else 0


def step_gemm_shapes(plan: ModelPlan, batch: StepBatch) -> list[tuple[str, int, int, int, int]]:
    """(op, M, N, K, launches) of every GEMM of the step (local shapes; MoE experts at their expected M)."""
    out = []
    for g in plan.gemms:
        m = batch.num_sampled if g.m_source == "sampled" else batch.num_tokens
        if m > 0:
            out.append((g.name, m, g.n, g.k, g.count))
    moe = plan.moe
    if moe is not None and batch.num_tokens > 0:
        m = tokens_per_expert(batch.num_tokens, moe.num_experts, moe.top_k)
        launches = moe.layers  # one fused launch per layer and GEMM
        out.append(("moe_w13", m, 2 * moe.inter_local, moe.hidden, launches))
        out.append(("moe_w2", m, moe.hidden, moe.inter_local, launches))
        if moe.shared_folded:
            out.append(("moe_shared", batch.num_tokens, 2 * moe.inter_local, moe.hidden, launches))
    return out


def step_bytes(plan: ModelPlan, batch: StepBatch) -> dict[str, dict[str, float]]:
    """The three byte planes of one step (module docstring), each {item: bytes}, plus "flops"."""
    t, a = batch.num_tokens, plan.act_bytes
    weights = sum(g.weight_bytes for g in plan.gemms if g.m_source == "tokens" and t > 0)
    weights += sum(g.weight_bytes for g in plan.gemms if g.m_source == "sampled" and batch.num_sampled > 0)
    moe = plan.moe
    if moe is not None and t > 0:
        hit = experts_hit(t, moe.num_experts, moe.top_k) + int(moe.shared_folded)
        weights += hit * moe.expert_bytes * moe.layers
    shapes = step_gemm_shapes(plan, batch)
    dense = [(m, n, k, launches) for op, m, n, k, launches in shapes if not _is_expert(op)]
    acts = sum((m * k + m * n) * launches * a for m, n, k, launches in dense)
    flops = sum(2.0 * m * n * k * launches for m, n, k, launches in dense)
    if moe is not None and t > 0:  # routed: T*k token-expert pairs through w13 and w2 (not the padded M)
        pairs = t * moe.top_k + (t if moe.shared_folded else 0)
        acts += pairs * (moe.hidden + 2 * moe.inter_local + moe.inter_local + moe.hidden) * a * moe.layers
        flops += 2.0 * pairs * 3 * moe.inter_local * moe.hidden * moe.layers
    acts += t * plan.hidden * a  # embedding rows gathered
    kv_per_tok, idx_per_tok = plan.kv_bytes_per_token, plan.index_k_bytes_per_token
    tp = plan.tp_size
    allreduce = 0.0
    if tp > 1 and t > 0:
        allreduce = (2 * plan.num_layers + 1) * 2.0 * (tp - 1) / tp * t * plan.hidden * a
    return {
        "compute": {"weights_read": float(weights), "activations": float(acts)},
        "persistent": {"kv_written": float(t * kv_per_tok), "index_k_written": float(t * idx_per_tok),
                       **context_bytes(plan, sum(batch.seq_lens)), "scales": 0.0},
        "communication": {"allreduce": allreduce, "kv_transfer": 0.0},
        "flops": {"gemm": flops},
    }


def context_bytes(plan: ModelPlan, context_tokens: int) -> dict[str, float]:
    """The persistent plane's items that depend on the step's context (the sum of its requests' seq_lens; the rest
    of `step_bytes` depends only on num_tokens and num_sampled): {"kv_read", "index_k_read"} in bytes."""
    return {"kv_read": float(context_tokens * plan.kv_bytes_per_token),
            "index_k_read": float(context_tokens * plan.index_k_bytes_per_token)}


def _is_expert(op: str) -> bool:
    return op.startswith("moe_") and op != "moe_router"


def plane_totals(planes: dict[str, dict[str, float]]) -> dict[str, float]:
    """{plane: total bytes} for the three byte planes."""
    return {p: sum(planes[p].values()) for p in ("compute", "persistent", "communication")}


def roofline_seconds(planes: dict[str, dict[str, float]], copy_bw: Optional[float],
                     gemm_rate: Optional[float]) -> Optional[float]:
    """Lower bound on the step time: max(bytes / copy bandwidth, FLOPs / GEMM rate); None when a rate is missing.
    copy_bw in bytes/s, gemm_rate in FLOP/s (the roofline model: Williams, Waterman, Patterson, CACM 2009)."""
    if not copy_bw or not gemm_rate:
        return None
    return max(sum(plane_totals(planes).values()) / copy_bw, planes["flops"]["gemm"] / gemm_rate)
