"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, dense Qwen2), HF-shaped.

Follows transformers' `LlamaForCausalLM` math (pre-norm decoder, RMSNorm, RoPE NeoX style, GQA, SwiGLU MLP)
with serving changes: q/k/v and gate/up are merged GEMMs, the residual add is fused into the next norm, and
attention reads/writes the paged KV cache through `ladle.layers.attention.layer.Attention`.

Module names match HF checkpoints, except the merged projections (see `STACKED_PARAMS`):
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

from ladle.layers.activation import silu_and_mul
from ladle.layers.attention.layer import Attention
from ladle.layers.attention.metadata import LayerCacheSpec
from ladle.layers.embedding import VocabEmbedding
from ladle.layers.linear import MergedLinear
from ladle.layers.norm import RMSNorm
from ladle.layers.rotary import RotaryEmbedding

# Checkpoint piece -> (merged ladle module, shard id). Matched on the module-name component.
STACKED_PARAMS: tuple[tuple[str, str, object], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# Checkpoint tensors that carry nothing the model needs (old checkpoints saved RoPE's inv_freq buffer).
SKIP_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)
DUMMY_INIT_RANGE = 1e-3  # uniform(-r, r) for dummy weights: keeps 30+ layer stacks finite


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


class LlamaAttentionBlock(nn.Module):
    """qkv_proj -> RoPE -> paged Attention -> o_proj. forward(positions [T], x [T, H]) -> [T, H]."""

    def __init__(self, args: LlamaArgs, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = MergedLinear(args.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size},
                                     bias=args.qkv_bias, dtype=dtype, device=device)
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=args.o_bias, dtype=dtype, device=device)
        self.rotary = [rotary]  # shared across layers; a list keeps it out of this module's state_dict
        self.attn = Attention(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5, layer_idx)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.output_slices(self.qkv_proj(x))
        q, k = self.rotary[0](positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up merged. forward(x [T, H]) -> [T, H]."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(args.hidden_size, {0: args.intermediate_size, 1: args.intermediate_size},
                                         bias=args.mlp_bias, dtype=dtype, device=device)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias, dtype=dtype,
                                   device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block. forward(positions, x, residual) -> (x, residual); residual None on the first layer.
    The residual add of each sub-block happens inside the following RMSNorm (fused add-norm)."""

    def __init__(self, args: LlamaArgs, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = LlamaAttentionBlock(args, rotary, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = LlamaMLP(args, dtype, device)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Parameters are created on `param_device` (the meta device while building, see `_materialize`); the RoPE
    cache on `device`."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, device: torch.device, param_device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(args.vocab_size, args.hidden_size, dtype=dtype, device=param_device)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rotary_dim, args.max_position, args.rope_theta,
                                          args.rope_scaling, is_neox_style=True, device=device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, self.rotary_emb, i, dtype, param_device) for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype, device=param_device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


def _materialize(root: nn.Module, device: torch.device) -> None:
    """Replace meta parameters with uninitialised ones on `device` (RMSNorm weights = 1); a parameter shared by
    several modules (tied embeddings) stays shared. Inference only: parameters do not require grad."""
    done: dict[int, nn.Parameter] = {}
    for module in root.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                data = torch.empty(param.shape, dtype=param.dtype, device=device)
                if isinstance(module, RMSNorm):
                    data.fill_(1.0)
                done[id(param)] = nn.Parameter(data, requires_grad=False)
            module._parameters[name] = done[id(param)]


class LlamaForCausalLM(nn.Module):
    """The `CausalLM` protocol (ladle/models/interface.py) for Llama-family configs.

    ctor(hf_config dict, dtype, device): parameters are allocated on `device` in `dtype`, uninitialised (norms 1)
    until `load_weights` or `init_dummy_weights`; the RoPE cache is float32.
    """

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32,
                 device: "torch.device | str" = "cpu") -> None:
        super().__init__()
        self.hf_config = dict(hf_config)
        self.args = LlamaArgs.from_hf(hf_config)
        self.dtype = dtype
        # Parameters are built on the meta device and materialised uninitialised: no random init of weights that
        # loading (or init_dummy_weights) overwrites anyway. (Explicit device arguments, not a `torch.device`
        # context: under that context torch routes factory calls through Python refs, which is slow.)
        device, meta = torch.device(device), torch.device("meta")
        self.model = LlamaModel(self.args, dtype, device, meta)
        self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False, dtype=dtype, device=meta)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        _materialize(self, device)

    @classmethod
    def required_block_size(cls, hf_config: dict) -> Optional[int]:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, hidden] model dtype (inside a forward
        context; writes this step's K/V into every layer's cache)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden_states).float()

    def kv_cache_specs(self) -> list[LayerCacheSpec]:
        return [LayerCacheSpec(self.args.num_kv_heads, self.args.head_dim) for _ in range(self.args.num_layers)]

    def _route(self, name: str) -> tuple[str, object]:
        """Checkpoint name -> (ladle parameter name, shard id or None)."""
        parts = name.split(".")
        for merged, piece, shard_id in STACKED_PARAMS:
            if piece in parts:
                parts[parts.index(piece)] = merged
                return ".".join(parts), shard_id
        return name, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in (cast to the parameter dtype/device). Returns the parameter names fully
        loaded (a merged parameter counts once all its shards arrived). Raises KeyError on an unknown name,
        ValueError on a shape mismatch. Skips `SKIP_SUFFIXES` and `lm_head.weight` when embeddings are tied."""
        params = dict(self.named_parameters())
        shards_seen: dict[str, set] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(SKIP_SUFFIXES) or (self.args.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, shard_id = self._route(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            if shard_id is None:
                if tuple(params[target].shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                     f"{tuple(params[target].shape)}")
                params[target].copy_(tensor)
                loaded.add(target)
                continue
            module_name, param_name = target.rsplit(".", 1)
            module = self.get_submodule(module_name)
            module.load_shard(param_name, shard_id, tensor)
            shards_seen.setdefault(target, set()).add(shard_id)
            if len(shards_seen[target]) == len(module.output_sizes):
                loaded.add(target)
        return loaded

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """Norm weights = 1, everything else uniform(-DUMMY_INIT_RANGE, DUMMY_INIT_RANGE), from a generator
        seeded with `seed` on the parameters' device (same seed, same device -> same weights)."""
        device = next(self.parameters()).device
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, param in self.named_parameters():
            if isinstance(self.get_submodule(name.rsplit(".", 1)[0]), RMSNorm):
                param.fill_(1.0)
            else:
                param.uniform_(-DUMMY_INIT_RANGE, DUMMY_INIT_RANGE, generator=gen)
