"""MiniMax-M3 checkpoint name table (three layouts).

The name table feeds the one loading protocol (ladle/models/weights.py): each row maps checkpoint names to a
parameter of MiniMaxM3ForCausalLM and its weight_loader's shard_id (and expert_id for the FusedMoE tables).

Layouts accepted (design/minimax_m3.md §1.1, §2; minimax_m3_vs_transformers.md B4):
  release          `language_model.model.layers.N.…`, `language_model.lm_head.weight`; per-expert `w1/w3/w2`;
                   `self_attn.index_{q,k}_{proj,norm}`; `block_sparse_moe.{gate.weight, e_score_correction_bias}`;
                   `block_sparse_moe.shared_experts.{gate,up,down}_proj`; dense `mlp.{gate,up,down}_proj`
  text-only        the same names under a plain `model.` prefix (third-party repacks)
  transformers     `model.layers.N.…` (MiniMaxM3VLForCausalLM) or `model.language_model.layers.N.…` (VL class,
                   save_original_format=False): `mlp.experts.gate_up_proj [E, 2I, H]` (= cat(w1, w3) on dim 1),
                   `mlp.experts.down_proj [E, H, I]`, `mlp.gate.{weight, e_score_correction_bias}`,
                   `mlp.shared_experts.gate_up_proj.weight`, `self_attn.indexer.*`, dense `mlp.gate_up_proj.weight`
Skipped (documented): vision tower, multimodal projector, patch-merge MLP, MTP modules.

Quantized checkpoints (MXFP8 §2.2, HF block FP8, MXFP4 experts §2.3): a scale `X.weight_scale_inv` / `X.weight_scale`
maps to the parameter of `X.weight` + "_scale_inv" (ladle/models/weights.py); the model is built in the checkpoint's
quant config (ladle/quant/config.py), so the pairs are kept as stored, never dequantised to the model dtype.
"""

from __future__ import annotations

import re

from ladle.models.minimax_m3_config import M3Config
from ladle.models.weights import WeightNameTable, WeightRule

# vision tower, projector, patch merge, MTP: not part of the text model
SKIP_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "model.vision_tower.",
                 "model.multi_modal_projector.", "mtp.", "model.mtp.", "language_model.mtp.")
PREFIXES = (("language_model.model.", ""), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", ""), ("model.", ""))


L = r"(layers\.\d+)\."  # every per-layer rule starts with it; group 1 = "layers.N"
_MOE = r"(?:block_sparse_moe|mlp)\."


def _shared_expert_rules(folded: bool) -> tuple[WeightRule, ...]:
    """The shared expert: row "shared" of the expert tables when folded (same width as the routed experts), else
    the separate `shared_experts` GatedMLP."""
    sh = L + _MOE + r"shared_experts\."
    if folded:
        return (WeightRule(sh + r"gate_proj\.weight", r"\1.mlp.w13", "w1", "shared"),
                WeightRule(sh + r"up_proj\.weight", r"\1.mlp.w13", "w3", "shared"),
                WeightRule(sh + r"gate_up_proj\.weight", r"\1.mlp.w13", "w13", "shared"),
                WeightRule(sh + r"down_proj\.weight", r"\1.mlp.w2", "w2", "shared"))
    return (WeightRule(sh + r"gate_proj\.weight", r"\1.mlp.shared_experts.gate_up_proj.weight", 0),
            WeightRule(sh + r"up_proj\.weight", r"\1.mlp.shared_experts.gate_up_proj.weight", 1),
            WeightRule(sh + r"gate_up_proj\.weight", r"\1.mlp.shared_experts.gate_up_proj.weight"),
            WeightRule(sh + r"down_proj\.weight", r"\1.mlp.shared_experts.down_proj.weight"))


def m3_weight_table(cfg: M3Config) -> WeightNameTable:
    """The one name table of MiniMaxM3ForCausalLM (layouts in the module doc; parameter names in minimax_m3.py)."""
    rules = (
        WeightRule(r"(embed_tokens|norm|lm_head)\.weight", r"\1.weight"),
        WeightRule(L + r"(input_layernorm|post_attention_layernorm)\.weight", r"\1.\2.weight"),
        WeightRule(L + r"self_attn\.(o_proj|q_norm|k_norm)\.weight", r"\1.self_attn.\2.weight"),
        WeightRule(L + r"self_attn\.([qkv])_proj\.weight", r"\1.self_attn.qkv_proj.weight", r"\2"),
        WeightRule(L + r"self_attn\.(?:index_|indexer\.)([qk])_proj\.weight", r"\1.self_attn.qkv_proj.weight", r"i\2"),
        WeightRule(L + r"self_attn\.(?:index_|indexer\.)([qk])_norm\.weight", r"\1.self_attn.indexer.\2_norm.weight"),
        # MoE router (fp32) and experts: release per-expert w1/w3/w2, transformers' fused [E, ...] tables
        WeightRule(L + _MOE + r"gate\.weight", r"\1.mlp.gate_weight"),
        WeightRule(L + r"(?:block_sparse_moe\.|mlp\.gate\.)e_score_correction_bias", r"\1.mlp.e_score_correction_bias"),
        WeightRule(L + r"block_sparse_moe\.experts\.(\d+)\.w([13])\.weight", r"\1.mlp.w13", r"w\3", r"\2"),
        WeightRule(L + r"block_sparse_moe\.experts\.(\d+)\.w2\.weight", r"\1.mlp.w2", "w2", r"\2"),
        WeightRule(L + r"mlp\.experts\.gate_up_proj", r"\1.mlp.w13", "w13"),
        WeightRule(L + r"mlp\.experts\.down_proj", r"\1.mlp.w2", "w2"),
        *_shared_expert_rules(cfg.shared_intermediate_size == cfg.intermediate_size),
        # dense MLP layers
        WeightRule(L + r"mlp\.gate_proj\.weight", r"\1.mlp.gate_up_proj.weight", 0),
        WeightRule(L + r"mlp\.up_proj\.weight", r"\1.mlp.gate_up_proj.weight", 1),
        WeightRule(L + r"mlp\.(gate_up_proj|down_proj)\.weight", r"\1.mlp.\2.weight"),
    )
    skip = tuple(re.escape(p) for p in SKIP_PREFIXES)
    if cfg.tie_word_embeddings:
        skip += (r"(?:language_model\.)?lm_head\.weight$",)
    return WeightNameTable(rules, prefixes=PREFIXES, skip=skip)

