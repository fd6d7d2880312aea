"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, dense Qwen2), HF-shaped.

Follows transformers' `LlamaForCausalLM` math (pre-norm decoder, RMSNorm, RoPE NeoX style, GQA, SwiGLU MLP)
with serving changes: q/k/v and gate/up are merged GEMMs (QKVParallelLinear, MergedColumnParallelLinear), the
residual add is fused into the next norm, and attention reads/writes the paged KV cache through
`ladle.layers.attention.layer.Attention`. Norms and RoPE run the fused Triton kernels when the forward context's
`backends.fused_norms` asks for them (ladle/layers/norm.py, rotary.py).

Module names match HF checkpoints, except the merged projections (see `WEIGHT_RULES`):
    model.embed_tokens, model.layers.N.{input_layernorm, self_attn.{qkv_proj, o_proj},
    post_attention_layernorm, mlp.{gate_up_proj, down_proj}}, model.norm, lm_head (tied to embed_tokens
    when `tie_word_embeddings`).
Qwen2 differs only in q/k/v biases (and no o_proj bias): `model_type == "qwen2"` turns them on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from ladle.layers.attention.layer import Attention, take_kv_scales
from ladle.layers.attention.metadata import LayerCacheSpec
from ladle.layers.linear import QKVParallelLinear, RowParallelLinear
from ladle.layers.mlp import GatedMLP
from ladle.layers.norm import RMSNorm
from ladle.layers.rotary import RotaryEmbedding
from ladle.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from ladle.models.weights import TPShard, WeightNameTable, WeightRule, init_dummy_weights, load_weights_by_table

# The name table: HF checkpoint name -> (ladle parameter, shard id); anything else maps to itself.
WEIGHT_RULES: tuple[WeightRule, ...] = (
    WeightRule(r"(.+)\.self_attn\.([qkv])_proj\.(weight|bias)", r"\1.self_attn.qkv_proj.\3", shard_id=r"\2"),
    WeightRule(r"(.+)\.mlp\.gate_proj\.(weight|bias)", r"\1.mlp.gate_up_proj.\2", shard_id=0),
    WeightRule(r"(.+)\.mlp\.up_proj\.(weight|bias)", r"\1.mlp.gate_up_proj.\2", shard_id=1),
    WeightRule(r"(.+)", r"\1"),
)
# Checkpoint tensors that carry nothing the model needs (old checkpoints saved RoPE's inv_freq buffer).
SKIP_PATTERNS: tuple[str, ...] = (r".*rotary_emb\.inv_freq$",)
# Dummy weights: every bound capped at 1e-3 and norms exactly 1, which keeps 30+ layer stacks finite and the
# values small (tests/models/test_loader.py checks this at SmolLM2's shapes).
DUMMY_MAX_ABS = 1e-3


@dataclass(frozen=True)
class LlamaArgs:
    """The fields of an HF Llama/Qwen2/Mistral config.json the model uses. Raises ValueError on unsupported
    features (non-SiLU activation, sliding window, unsupported RoPE scaling)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaArgs":
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} (only 'silu')")
        if cfg.get("use_sliding_window", False) or (
            cfg.get("model_type") == "mistral" and cfg.get("sliding_window") is not None
        ):
            raise ValueError("sliding-window attention is not supported yet")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers >= 5 writes rope_parameters {rope_theta, rope_type, ...}; older files rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        is_qwen2 = cfg.get("model_type") == "qwen2"
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or is_qwen2,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )


class LlamaAttention(nn.Module):
    """qkv_proj -> RoPE -> paged Attention -> o_proj. forward(positions [T], x [T, H]) -> [T, H]."""

    def __init__(self, args: LlamaArgs, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype,
                 device: torch.device, tp: TPShard = TPShard()) -> None:
        super().__init__()
        d = args.head_dim
        self.qkv_proj = QKVParallelLinear(args.hidden_size, d, args.num_heads, args.num_kv_heads,
                                          bias=args.qkv_bias, dtype=dtype, device=device, **tp.kwargs())
        self.o_proj = RowParallelLinear(args.num_heads * d, args.hidden_size, bias=args.o_bias, dtype=dtype,
                                        device=device, **tp.kwargs())
        self.rotary = [rotary]  # shared across layers; a list keeps it out of this module's state_dict
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d, d**-0.5, layer_idx)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # column views of one GEMM output
        q, k = self.rotary[0](positions, q, k, inplace=True)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. forward(positions, x, residual) -> (x, residual); residual None on the first layer.
    The residual add of each sub-block happens inside the following RMSNorm (fused add-norm)."""

    def __init__(self, args: LlamaArgs, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype,
                 device: torch.device, tp: TPShard = TPShard()) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(args, rotary, layer_idx, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, "silu", bias=args.mlp_bias, dtype=dtype,
                            device=device, **tp.kwargs())

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.add_norm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, args: LlamaArgs, dtype: torch.dtype, device: torch.device, tp: TPShard = TPShard()) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, dtype=dtype, device=device,
                                                   **tp.kwargs())
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rotary_dim, args.max_position, args.rope_theta,
                                          args.rope_scaling, is_neox_style=True, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, self.rotary_emb, i, dtype, device, tp) for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """The `CausalLM` protocol (ladle/models/interface.py) for Llama-family configs.

    ctor(hf_config dict, dtype, device, tp): parameters are allocated on `device` in `dtype`, uninitialised (norms
    1) until `load_weights` or `init_dummy_weights`; the RoPE cache is float32. `tp` (TPShard): this rank's shard
    of a tensor-parallel group (heads, MLP and vocabulary split; ladle/layers/linear.py).
    """

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32,
                 device: "torch.device | str" = "cpu", tp: TPShard = TPShard()) -> None:
        super().__init__()
        self.hf_config = dict(hf_config)
        self.args = LlamaArgs.from_hf(hf_config)
        self.dtype, self.tp = dtype, tp
        self.device = device = torch.device(device)
        self.model = LlamaModel(self.args, dtype, device, tp)
        self.lm_head = ParallelLMHead(self.args.vocab_size, self.args.hidden_size, dtype=dtype, device=device,
                                      **tp.kwargs())
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        skip = SKIP_PATTERNS + ((r"lm_head\.weight$",) if self.args.tie_word_embeddings else ())
        self.weight_names = WeightNameTable(WEIGHT_RULES, skip=skip)

    @classmethod
    def required_block_size(cls, hf_config: dict) -> Optional[int]:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, hidden] model dtype (inside a forward
        context; writes this step's K/V into every layer's cache)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head.compute_logits(hidden_states).float()

    def kv_cache_specs(self) -> list[LayerCacheSpec]:
        """One spec per layer with this rank's KV heads (the Attention layer's own)."""
        return [layer.self_attn.attn.kv_cache_spec() for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in through the name table (ladle/models/weights.py). Returns the parameter names
        fully loaded (a merged parameter counts once all its shards arrived). Raises KeyError on an unknown name,
        ValueError on a shape mismatch. Skips `SKIP_PATTERNS` and `lm_head.weight` when embeddings are tied.
        Per-tensor KV-cache scales (`self_attn.k_scale` / `v_scale`, FP8-KV checkpoints) go to the Attention
        layers (`take_kv_scales`), read back by `kv_cache_scales`."""
        attn = [layer.self_attn.attn for layer in self.model.layers]
        return load_weights_by_table(self, take_kv_scales(weights, attn), self.weight_names)

    def kv_cache_scales(self) -> list[tuple[float, float]]:
        """Per layer (k_scale, v_scale) for an FP8 KV cache: the checkpoint's, else 1.0."""
        return [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in self.model.layers]

    def init_dummy_weights(self, seed: int) -> None:
        """Norm weights = 1, everything else uniform within ±DUMMY_MAX_ABS (ladle/models/weights.py); a rank's
        shards are the slices of the one-rank model's tensors."""
        init_dummy_weights(self, seed, norm_noise=0.0, max_abs=DUMMY_MAX_ABS, unsharded=self._unsharded())

    def _unsharded(self) -> Optional[nn.Module]:
        """The one-rank twin on the meta device (shapes only) when this model is a shard, else None."""
        return None if self.tp.size == 1 else type(self)(self.hf_config, self.dtype, "meta")
