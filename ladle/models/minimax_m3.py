"""MiniMax-M3 text model (`MiniMaxM3ForCausalLM`): the exact CPU reference path.

60-layer pre-norm decoder (design/minimax_m3.md §0, §3): Gemma (1+w) fp32 RMSNorm everywhere, per-head QK norm,
partial NeoX RoPE, GQA; layers marked sparse add the MSA indexer (per-GQA-group block top-k) and attend only to
the selected blocks; layers marked MoE use the sigmoid-routed experts with the shared expert folded in.

Built from the generic layer kit (ladle/layers: RMSNorm with weight_offset 1, RotaryEmbedding, QKVParallelLinear
carrying the MSA index q/k as extra head shards of the same GEMM, RowParallelLinear, GatedMLP, FusedMoE).
Registered (ladle/models/registry.py) for `MiniMaxM3SparseForConditionalGeneration`, `MiniMaxM3SparseForCausalLM`
and `MiniMaxM3VLForCausalLM`. Checkpoint names map through the name table in ladle/models/minimax_m3_weights.py.

Forward contract (ladle/models/interface.py): reads `get_forward_context()`; writes K, V and (sparse layers)
index-K for every token with slot >= 0. `ctx.backends` (ladle.layers.attention.metadata.OpBackends, the runner's
choice) selects the ladle.kernels path for attention and the indexer (`attention`), the MoE (`moe`) and the norms
(`fused_norms`: residual add + RMSNorm fused into one kernel, per-head norm + RoPE into another; with the Triton
attention backend too, the four per-head norms + RoPE and the K/V / index-K stores of a layer are one op,
`Attention.norm_rope_store`: one launch at decode sizes), or the references.
When `ctx.extras["record_msa_selection"]` is truthy, each MSA layer's Attention leaves its selections in
`ctx.extras["msa_selected_block_ids"][layer_idx]` ([num_kv_heads, T, topk] int32, ARCHITECTURE.md layout).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ladle.layers.attention.layer import Attention, MSAParams
from ladle.layers.attention.metadata import LayerCacheSpec
from ladle.layers.backends import op_backends
from ladle.layers.linear import QKVParallelLinear, RowParallelLinear
from ladle.layers.mlp import GatedMLP
from ladle.layers.moe import FusedMoE
from ladle.layers.norm import RMSNorm
from ladle.layers.rotary import RotaryEmbedding
from ladle.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from ladle.models.minimax_m3_config import M3Config, parse_m3_config
from ladle.models.minimax_m3_weights import m3_weight_table
from ladle.models.weights import TPShard, init_dummy_weights, load_weights_by_table


def _gemma_norm(dim: int, cfg: M3Config, dtype: torch.dtype, device) -> RMSNorm:
    """M3's norms are Gemma-style: scale 1 + w, float32 math (design/minimax_m3.md §3.2)."""
    return RMSNorm(dim, cfg.rms_norm_eps, weight_offset=1.0, dtype=dtype, device=device)


class Indexer(nn.Module):
    """MSA index branch: index_n_heads (= kv heads) index-q heads, one shared index-k head; both normed and roped.
    Its q/k projections are shards "iq"/"ik" of the attention's `qkv_proj`."""

    def __init__(self, cfg: M3Config, num_heads: int, dtype: torch.dtype, device):
        super().__init__()
        self.ni, self.di = num_heads, cfg.index_head_dim
        self.q_norm = _gemma_norm(self.di, cfg, dtype, device)
        self.k_norm = _gemma_norm(self.di, cfg, dtype, device)

    def forward(self, iq: torch.Tensor, ik: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected iq [T, ni*di], ik [T, di] (column views are fine) -> (index_q [T, ni, di], index_k [T, di]),
        normed and roped (`RMSNorm.norm_rope`)."""
        t = iq.shape[0]
        iq = self.q_norm.norm_rope(iq.view(t, self.ni, self.di), cos, sin)
        ik = self.k_norm.norm_rope(ik.view(t, 1, self.di), cos, sin)
        return iq, ik.view(t, self.di)


class M3Attention(nn.Module):
    """q/k/v (+ index q/k on sparse layers) in one GEMM -> per-head norm + RoPE -> paged (MSA) attention -> o_proj."""

    def __init__(self, cfg: M3Config, layer_idx: int, sparse: bool, dtype: torch.dtype, device,
                 tp: TPShard = TPShard()):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        extra = {"iq": (cfg.index_n_heads, cfg.index_head_dim), "ik": (1, cfg.index_head_dim)} if sparse else None
        self.qkv_proj = QKVParallelLinear(h, d, cfg.num_attention_heads, cfg.num_key_value_heads, extra_heads=extra,
                                          dtype=dtype, device=device, **tp.kwargs())
        self.nh, self.nkv, self.d = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, dtype=dtype, device=device, **tp.kwargs())
        self.q_norm = _gemma_norm(d, cfg, dtype, device)
        self.k_norm = _gemma_norm(d, cfg, dtype, device)
        self.indexer = None
        if sparse:  # this rank's index-q heads: the "iq" shard of qkv_proj
            self.indexer = Indexer(cfg, self.qkv_proj.shards["iq"].rows // cfg.index_head_dim, dtype, device)
        msa = MSAParams(cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks,
                        cfg.index_head_dim) if sparse else None
        self.attn = Attention(self.nh, self.nkv, d, d ** -0.5, layer_idx, msa=msa)

    def forward(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """a [T, H] (input-normed), cos/sin [T, rotary_dim] -> out [T, H]. The Attention layer writes K/V (+ index-K)
        and records MSA selections when the forward context asks for them."""
        t = a.shape[0]
        parts = self.qkv_proj.split(self.qkv_proj(a))  # column views of one GEMM output
        backends = op_backends()
        if backends.fused_norms and backends.triton_attention:  # norms, RoPE, cache stores: one op (one launch)
            idx = self.indexer
            q, k, v = (parts[i].view(t, n, self.d) for i, n in ((0, self.nh), (1, self.nkv), (2, self.nkv)))
            index = (parts[3].view(t, idx.ni, idx.di), parts[4], idx.q_norm, idx.k_norm) if idx is not None else ()
            q, iq = self.attn.norm_rope_store(q, k, v, self.q_norm, self.k_norm, cos, sin, *index)
            return self.o_proj(self.attn(q, None, None, iq, None, stored=True))
        q = self.q_norm.norm_rope(parts[0].view(t, self.nh, self.d), cos, sin)
        k = self.k_norm.norm_rope(parts[1].view(t, self.nkv, self.d), cos, sin)
        v = parts[2].view(t, self.nkv, self.d)  # row-strided view: the KV stores take row strides
        iq, ik = self.indexer(parts[3], parts[4], cos, sin) if self.indexer is not None else (None, None)
        return self.o_proj(self.attn(q, k, v, iq, ik))


class M3DecoderLayer(nn.Module):
    def __init__(self, cfg: M3Config, idx: int, dtype: torch.dtype, device, tp: TPShard = TPShard()):
        super().__init__()
        self.self_attn = M3Attention(cfg, idx, cfg.sparse_layers[idx], dtype, device, tp)
        if cfg.moe_layers[idx]:
            self.mlp: nn.Module = FusedMoE(
                cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size,
                cfg.shared_intermediate_size, cfg.routed_scaling_factor, cfg.swiglu_alpha, cfg.swiglu_limit,
                dtype=dtype, device=device, expert_parallel=tp.expert_parallel, **tp.kwargs())
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, "swigluoai", dtype=dtype, device=device,
                                swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, **tp.kwargs())
        self.input_layernorm = _gemma_norm(cfg.hidden_size, cfg, dtype, device)
        self.post_attention_layernorm = _gemma_norm(cfg.hidden_size, cfg, dtype, device)


class MiniMaxM3ForCausalLM(nn.Module):
    """See module docstring. ctor(hf_config: root config.json dict or its text_config, dtype, device, tp: this
    rank's TPShard — heads, dense MLP, vocabulary and experts (intermediate dim, or whole experts with
    tp.expert_parallel) split over the ranks)."""

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 tp: TPShard = TPShard()):
        super().__init__()
        cfg = parse_m3_config(hf_config)
        self.hf_config = dict(hf_config)
        self.config, self.dtype, self.device, self.tp = cfg, dtype, torch.device(device), tp
        self.fuse_shared_expert = True  # False runs the shared expert as its own op call (a test checks equality)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device,
                                                   **tp.kwargs())
        self.layers = nn.ModuleList(M3DecoderLayer(cfg, i, dtype, device, tp) for i in range(cfg.num_hidden_layers))
        self.norm = _gemma_norm(cfg.hidden_size, cfg, dtype, device)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device, **tp.kwargs())
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      device=device)
        self.weight_names = m3_weight_table(cfg)

    # -- protocol --------------------------------------------------------------------------------------
    @classmethod
    def required_block_size(cls, hf_config: dict) -> int | None:
        """MSA pools index scores over blocks anchored at absolute positions: the KV block must be that block."""
        cfg = parse_m3_config(hf_config)
        return cfg.index_block_size if cfg.has_sparse_layers else None

    def kv_cache_specs(self) -> list[LayerCacheSpec]:
        return [layer.self_attn.attn.kv_cache_spec() for layer in self.layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> final-normed hidden states [T, H] (model dtype)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        h = None  # the residual stream; each residual add happens inside the next norm (`add_norm`)
        for layer in self.layers:
            a, h = layer.input_layernorm.add_norm(x, h)
            attn = layer.self_attn(a, cos, sin)
            b, h = layer.post_attention_layernorm(attn, h)
            if isinstance(layer.mlp, FusedMoE):
                x = layer.mlp(b, fuse_shared=self.fuse_shared_expert)
            else:
                x = layer.mlp(b)
        return self.norm.add_norm(x, h)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, H] -> logits [N, vocab] float32."""
        return self.lm_head.compute_logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Release (`language_model.`), text-only (`model.`) and transformers-fused layouts, bf16, HF block FP8,
        MXFP8 or MXFP4 experts, through the one name table; every quantized pair (`X.weight` + its scale) goes to
        the quant method's weight loaders, so an FP8 checkpoint needs a model built in its quant config
        (`quant_config_scope(quant_config_of(...))`, as ladle/models/loader.py does for every model). Returns the
        names of parameters whose every piece was written. Raises UnknownWeightError on unknown names (outside the
        documented skip list: vision tower, projector, patch merge, MTP; a scale for an unquantized model is one)
        and ValueError on shape mismatches."""
        return load_weights_by_table(self, weights, self.weight_names)

    def init_dummy_weights(self, seed: int) -> None:
        """Norms at (1 + w) = 1 ± 0.1, matrices ±1/sqrt(fan_in), embeddings ±1 (ladle/models/weights.py); a rank's
        shards are the slices of the one-rank model's tensors (drawn on a meta-device twin's shapes)."""
        twin = None if self.tp.size == 1 else type(self)(self.hf_config, self.dtype, "meta")
        init_dummy_weights(self, seed, norm_noise=0.1, unsharded=twin)
