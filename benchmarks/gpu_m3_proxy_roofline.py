"""Byte and FLOP arithmetic for the MiniMax-M3 TP4-rank proxy (benchmarks/gpu_m3_proxy.py), kept free of GPU and
engine imports so tests/models/test_minimax_m3_proxy.py can check it on CPU against hand sums.

Sources: design/kernels_and_limits.md §6 (per-rank byte model: weights read once per step, distinct experts, KV
read per layer kind, index-K scanned over the whole context; prefill FLOPs), design/minimax_m3.md §5.2 (shapes).
"""

from __future__ import annotations

import torch

GiB = 2**30


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def weight_bytes(model) -> dict:
    """Bytes of a MiniMaxM3ForCausalLM's parameters (meta device works), split the way a decode step reads them.

    Returns {"layers": [per layer {"sparse", "moe", "attn", "indexer", "norms", "dense_mlp", "router", "shared",
    "expert", "num_experts"}], "embed", "embed_row", "lm_head", "final_norm", "total"}; "expert" is one routed
    expert's w13 + w2 bytes.
    """
    from ladle.layers.moe import FusedMoE

    layers = []
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        idx = _nbytes(att.indexer.parameters()) if att.indexer is not None else 0
        d = dict(sparse=att.indexer is not None, moe=isinstance(mlp, FusedMoE), attn=_nbytes(att.parameters()) - idx,
                 indexer=idx, norms=_nbytes(layer.input_layernorm.parameters())
                 + _nbytes(layer.post_attention_layernorm.parameters()),
                 dense_mlp=0, router=0, shared=0, expert=0, num_experts=0)
        if d["moe"]:
            e = mlp.num_experts
            one = (mlp.w13[0].numel() + mlp.w2[0].numel()) * mlp.w13.element_size()
            d.update(router=_nbytes([mlp.gate_weight, mlp.e_score_correction_bias]), expert=one, num_experts=e,
                     shared=one if mlp.shared_folded else _nbytes(mlp.shared_experts.parameters()))
        else:
            d["dense_mlp"] = _nbytes(mlp.parameters())
        layers.append(d)
    emb = model.embed_tokens.weight
    head = 0 if model.lm_head.weight is emb else _nbytes(model.lm_head.parameters())  # tied: counted once
    return dict(layers=layers, embed=_nbytes([emb]), embed_row=emb.shape[1] * emb.element_size(), lm_head=head,
                final_norm=_nbytes(model.norm.parameters()), total=_nbytes(model.parameters()))


def stored_bytes(wb: dict, num_layers: int) -> int:
    """Parameter bytes of a model that keeps the first `num_layers` layers of `wb` (routed experts all stored)."""
    per = [sum(v for k, v in d.items() if k in ("attn", "indexer", "norms", "dense_mlp", "router", "shared"))
           + d["expert"] * d["num_experts"] for d in wb["layers"][:num_layers]]
    return wb["embed"] + wb["lm_head"] + wb["final_norm"] + sum(per)


def kv_bytes_per_token(specs, num_layers: int, elt: int) -> int:
    """K + V (+ index-K on MSA layers) bytes per token over the first `num_layers` layers' LayerCacheSpecs."""
    return sum(s.bytes_per_token(elt) for s in specs[:num_layers])


def pick_layers(wb: dict, specs, budget: int, batch: int, tokens_per_seq: int, reserve: int, elt: int = 2) -> int:
    """Largest L with weights(L) + KV(batch x tokens_per_seq, L) + reserve <= budget (bytes)."""
    best = 0
    for n in range(1, len(wb["layers"]) + 1):
        if stored_bytes(wb, n) + batch * tokens_per_seq * kv_bytes_per_token(specs, n, elt) + reserve <= budget:
            best = n
    return best


def expected_distinct(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by `tokens` uniform, independent top-k routings (kernels_and_limits.md §6.1)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def decode_step_bytes(wb: dict, cfg, seq_lens, distinct_routed, kv_elt: int) -> dict:
    """Bytes one decode step must read (see the module doc). seq_lens: per request, context incl. the new token;
    distinct_routed: per layer, distinct routed experts this step (ignored for dense layers). Returns
    {"weights", "experts", "kv", "index_k", "total"}."""
    b = len(seq_lens)
    weights = wb["lm_head"] + wb["final_norm"] + b * wb["embed_row"]
    experts = kv = idx = 0
    kv_tok = 2 * cfg.num_key_value_heads * cfg.head_dim * kv_elt
    bs, topk = cfg.index_block_size, cfg.index_topk_blocks
    dense_tokens = sum(seq_lens)
    sparse_tokens = sum(min(s, min(topk, -(-s // bs)) * bs) for s in seq_lens)
    for d, n in zip(wb["layers"], distinct_routed):
        weights += d["attn"] + d["indexer"] + d["norms"] + d["dense_mlp"] + d["router"] + d["shared"]
        if d["moe"]:
            experts += n * d["expert"]
        if d["sparse"]:
            kv += kv_tok * sparse_tokens
            idx += cfg.index_head_dim * kv_elt * dense_tokens
        else:
            kv += kv_tok * dense_tokens
    return dict(weights=weights, experts=experts, kv=kv, index_k=idx, total=weights + experts + kv + idx)


def prefill_flops(cfg, num_tokens: int) -> dict:
    """Useful FLOPs of prefilling one request of `num_tokens` tokens from position 0 (logits for the last token
    only): {"gemm", "attention", "indexer", "total"}. MSA query t (block b = t // bs) sees min(top-k, b + 1) blocks,
    the last one up to t: (min(top-k, b + 1) - 1) * bs + t % bs + 1 keys."""
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    ni, di, bs, topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_block_size, cfg.index_topk_blocks
    t = torch.arange(num_tokens, dtype=torch.float64)
    causal = float((t + 1).sum())
    sparse_keys = float(((torch.clamp(t // bs + 1, max=topk) - 1) * bs + t % bs + 1).sum())
    attn_p = h * (nh * hd + 2 * nkv * hd) + nh * hd * h
    gemm = attn = index = 0.0
    for sparse, moe in zip(cfg.sparse_layers, cfg.moe_layers):
        p = attn_p + (h * (ni * di + di) if sparse else 0)
        if moe:
            p += cfg.num_local_experts * h + (cfg.num_experts_per_tok + 1) * 3 * cfg.intermediate_size * h
        else:
            p += 3 * cfg.dense_intermediate_size * h
        gemm += 2.0 * num_tokens * p
        attn += 4.0 * nh * hd * (sparse_keys if sparse else causal)
        index += 2.0 * ni * di * causal if sparse else 0.0
    gemm += 2.0 * cfg.vocab_size * h
    return dict(gemm=gemm, attention=attn, indexer=index, total=gemm + attn + index)


def memory_plan(preset: str, num_layers: int, batch: int, tokens_per_seq: int, total: int, util: float,
                reserve: int) -> dict:
    """Build the full preset on the meta device (no memory) and size the L-layer proxy against `util * total`."""
    from ladle.models.minimax_m3 import MiniMaxM3ForCausalLM
    from ladle.tools.checkpoint_m3 import root_config, text_config

    full = MiniMaxM3ForCausalLM(root_config(text_config(preset), "bf16"), torch.bfloat16, "meta")
    wb, specs = weight_bytes(full), full.kv_cache_specs()
    w = stored_bytes(wb, num_layers)
    kv = batch * tokens_per_seq * kv_bytes_per_token(specs, num_layers, 2)
    return dict(preset=preset, layers=num_layers, weights_gib=w / GiB, kv_bytes_per_token=kv_bytes_per_token(
        specs, num_layers, 2), kv_gib=kv / GiB, batch=batch, tokens_per_seq=tokens_per_seq, budget_gib=util * total / GiB,
        left_gib=(util * total - w - kv) / GiB, largest_fitting=pick_layers(wb, specs, int(util * total), batch,
                                                                             tokens_per_seq, reserve))
