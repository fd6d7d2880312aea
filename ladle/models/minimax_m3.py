"""MiniMax-M3 text model (`MiniMaxM3ForCausalLM`): the exact CPU reference path.

60-layer pre-norm decoder (design/minimax_m3.md §0, §3): Gemma (1+w) fp32 RMSNorm everywhere, per-head QK norm,
partial NeoX RoPE, GQA; layers marked sparse add the MSA indexer (per-GQA-group block top-k) and attend only to
the selected blocks; layers marked MoE use the sigmoid-routed experts with the shared expert folded in.

Registered (ladle/models/registry.py) for `MiniMaxM3SparseForConditionalGeneration`, `MiniMaxM3SparseForCausalLM`
and `MiniMaxM3VLForCausalLM`. Checkpoint names map through ladle/models/minimax_m3_weights.py.

Forward contract (ladle/models/interface.py): reads `get_forward_context()`; writes K, V and (sparse layers)
index-K for every token with slot >= 0. `ctx.backends` (ladle.layers.attention.metadata.OpBackends, the runner's
choice) selects the ladle.kernels path for attention and the indexer (`attention`), the MoE (`moe`) and the norms
(`fused_norms`: residual add + RMSNorm and per-head norm + RoPE fused into one kernel each), or the references. When `ctx.extras["record_msa_selection"]` is truthy, the selections are
left in `ctx.extras["msa_selected_block_ids"][layer_idx]` ([num_kv_heads, T, topk] int32, ARCHITECTURE.md layout).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ladle.layers.attention.layer import Attention, MSAParams
from ladle.layers.attention.metadata import LayerCacheSpec, get_forward_context
from ladle.layers.embedding import VocabEmbedding
from ladle.layers.linear import MergedLinear
from ladle.layers.moe import MoE
from ladle.models.minimax_m3_config import M3Config, parse_m3_config
from ladle.models.minimax_m3_layers import DenseMLP, GemmaRMSNorm, PartialNeoxRope
from ladle.models.minimax_m3_weights import M3WeightLoader, init_dummy


class Proj(nn.Module):
    """Bias-free linear, weight [out, in] (PyTorch layout, as on disk)."""

    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Indexer(nn.Module):
    """MSA index branch: 4 (= kv heads) index-q heads, one shared index-k head; both normed and roped. Its q/k
    projections are shards "iq"/"ik" of the attention's `qkv_proj`."""

    def __init__(self, cfg: M3Config, dtype: torch.dtype, device):
        super().__init__()
        self.ni, self.di = cfg.index_n_heads, cfg.index_head_dim
        self.q_norm = GemmaRMSNorm(self.di, cfg.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(self.di, cfg.rms_norm_eps, dtype, device)

    def forward(self, iq: torch.Tensor, ik: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected iq [T, ni*di], ik [T, di] (column views are fine) -> (index_q [T, ni, di], index_k [T, di]),
        normed and roped (fused: one kernel per tensor)."""
        t = iq.shape[0]
        iq = self.q_norm.norm_rope(iq.view(t, self.ni, self.di), cos, sin, fused)
        ik = self.k_norm.norm_rope(ik.view(t, 1, self.di), cos, sin, fused)
        return iq, ik.view(t, self.di)


class M3Attention(nn.Module):
    def __init__(self, cfg: M3Config, sparse: bool, dtype: torch.dtype, device, layer_idx: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.scale = d ** -0.5
        # q, k, v (and the indexer's q, k) read the same input: one GEMM (checkpoint pieces load into row shards)
        shards = {"q": self.nh * d, "k": self.nkv * d, "v": self.nkv * d}
        if sparse:
            shards.update(iq=cfg.index_n_heads * cfg.index_head_dim, ik=cfg.index_head_dim)
        self.qkv_proj = MergedLinear(h, shards, bias=False, dtype=dtype, device=device)
        self.o_proj = Proj(self.nh * d, h, dtype, device)
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.indexer = Indexer(cfg, dtype, device) if sparse else None
        msa = MSAParams(cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks,
                        cfg.index_head_dim) if sparse else None
        self.attn = Attention(self.nh, self.nkv, d, self.scale, layer_idx, msa=msa)

    def forward(self, a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """a [T, H] (input-normed) -> out [T, H]. fused: per-head norm + RoPE in one kernel per tensor instead of
        the torch composition."""
        t = a.shape[0]
        parts = self.qkv_proj.output_slices(self.qkv_proj(a))  # column views of one GEMM output
        q = self.q_norm.norm_rope(parts[0].view(t, self.nh, self.d), cos, sin, fused)
        k = self.k_norm.norm_rope(parts[1].view(t, self.nkv, self.d), cos, sin, fused)
        v = parts[2].view(t, self.nkv, self.d)  # row-strided view: the KV stores take row strides
        iq, ik = self.indexer(parts[3], parts[4], cos, sin, fused) if self.indexer is not None else (None, None)
        return self.o_proj(self.attn(q, k, v, iq, ik))


class M3DecoderLayer(nn.Module):
    def __init__(self, cfg: M3Config, idx: int, dtype: torch.dtype, device):
        super().__init__()
        self.self_attn = M3Attention(cfg, cfg.sparse_layers[idx], dtype, device, idx)
        act = dict(alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, beta=cfg.swiglu_beta)
        if cfg.moe_layers[idx]:
            self.mlp: nn.Module = MoE(cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                                      cfg.intermediate_size, cfg.shared_intermediate_size, cfg.routed_scaling_factor,
                                      cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta, dtype, device)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, act, dtype, device)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class MiniMaxM3ForCausalLM(nn.Module):
    """See module docstring. ctor(hf_config: root config.json dict or its text_config, dtype, device)."""

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        cfg = parse_m3_config(hf_config)
        self.config, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.fuse_shared_expert = True  # the unfused path stays for tests
        # VocabEmbedding: same `weight` and lookup as nn.Embedding, without a random init that loading overwrites
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(M3DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else Proj(cfg.hidden_size, cfg.vocab_size, dtype, device)
        self.rotary = PartialNeoxRope(cfg.rotary_dim, cfg.rope_theta, device)

    # -- protocol --------------------------------------------------------------------------------------
    @classmethod
    def required_block_size(cls, hf_config: dict) -> int | None:
        """MSA pools index scores over blocks anchored at absolute positions: the KV block must be that block."""
        cfg = parse_m3_config(hf_config)
        return cfg.index_block_size if cfg.has_sparse_layers else None

    def kv_cache_specs(self) -> list[LayerCacheSpec]:
        c = self.config
        return [LayerCacheSpec(c.num_key_value_heads, c.head_dim, c.index_head_dim if s else 0)
                for s in c.sparse_layers]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> final-normed hidden states [T, H] (model dtype)."""
        ctx = get_forward_context()
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        kernels = ctx.backends.triton_moe
        fused = ctx.backends.fused_norms
        h = None  # the residual stream; each residual add happens inside the next norm (`add_norm`)
        for layer in self.layers:
            a, h = layer.input_layernorm.add_norm(x, h, fused)
            attn = layer.self_attn(a, cos, sin, fused)
            b, h = layer.post_attention_layernorm.add_norm(attn, h, fused)
            if isinstance(layer.mlp, MoE):
                x = layer.mlp(b, fuse_shared=self.fuse_shared_expert, use_kernels=kernels)
            else:
                x = layer.mlp(b)
        return self.norm.add_norm(x, h, fused)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, H] -> logits [N, vocab] float32."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden_states, w).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Release (`language_model.`), text-only (`model.`) and transformers-fused layouts, bf16 or MXFP8.

        Returns the names of parameters whose every piece was written. Raises ValueError on unknown names (outside
        the documented skip list: vision tower, projector, patch merge, MTP) and on shape mismatches.
        """
        return M3WeightLoader(self).load(weights)

    def init_dummy_weights(self, seed: int) -> None:
        init_dummy(self, seed)
