"""MiniMax-M3 text config: parsed from plain JSON (transformers is never imported at run time).

Accepts both shapes a user can have on disk (design/minimax_m3.md §1, minimax_m3_vs_transformers.md B1/B6/B7/B8):

* the release form: root `minimax_m3_vl` wrapper with `text_config`; `moe_layer_freq`, `sparse_attention_config`
  (`sparse_*` keys), flat `rope_theta`, `rotary_dim`, `partial_rotary_factor`, `hidden_act: "swigluoai"`;
* the form transformers saves (`MiniMaxM3VLTextConfig.to_dict()`): `layer_types`, `mlp_layer_types`, flat `index_*`,
  `rope_parameters`, `hidden_act: "silu"` (never read to pick the activation: it is always swigluoai).

Rules (errors are `ValueError`, raised at load time):
* rotary width r = head_dim × partial_rotary_factor (the key transformers reads; absent means 1.0); a `rotary_dim`
  that disagrees is refused, because transformers would silently rotate r channels, not `rotary_dim`.
* Keys whose released value is the only one implemented (Gemma norm, QK norm per head, no output gate, sigmoid
  scoring, routing bias, one shared expert, no init block, max score, selection-only indexer, sparse attention on)
  must be absent or carry that value.
* The layer plan comes from the freq lists or from `layer_types`/`mlp_layer_types`; when both are present they
  must agree; when neither is present the config is refused (transformers would build an all-dense / all-MoE model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ladle.models.hf_config import text_config_of

SPARSE_ATTN = "minimax_m3_sparse"
FULL_ATTN = "full_attention"


@dataclass(frozen=True)
class M3Config:
    """Resolved text-model hyper-parameters. Per-layer plans are tuples of bools, one per layer."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # channels rotated per head = head_dim × partial_rotary_factor
    max_position_embeddings: int
    tie_word_embeddings: bool
    dense_intermediate_size: int
    intermediate_size: int
    shared_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    sparse_layers: tuple[bool, ...]  # MSA attention + indexer
    moe_layers: tuple[bool, ...]  # MoE block (else dense MLP)
    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    bos_token_id: int
    eos_token_id: int | list[int]

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_sparse_layers(self) -> bool:
        return any(self.sparse_layers)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"MiniMax-M3 config: {msg}")


def _assert_released(tc: dict, sc: dict) -> None:
    """Keys ladle implements with one value only (the released one): refuse anything else."""
    fixed: list[tuple[dict, str, Any]] = [
        (tc, "use_gemma_norm", True),
        (tc, "attention_output_gate", False),
        (tc, "use_qk_norm", True),
        (tc, "qk_norm_type", "per_head"),
        (tc, "scoring_func", "sigmoid"),
        (tc, "use_routing_bias", True),
        (tc, "n_shared_experts", 1),
        (tc, "swiglu_beta", 1.0),  # the "+ 1" of swigluoai (transformers MOD:190; the fused MoE kernel's epilogue)
        (sc, "use_sparse_attention", True),
        (sc, "sparse_init_block", 0),
        (sc, "sparse_score_type", "max"),
    ]
    for src, key, want in fixed:
        if key in src and src[key] != want:
            raise ValueError(f"MiniMax-M3 config: {key}={src[key]!r} is not supported (only {want!r}, the released "
                             "value, is implemented; transformers hard-codes it too)")
    act = tc.get("hidden_act", "swigluoai")
    _require(act in ("swigluoai", "silu"), f"hidden_act={act!r}; M3 uses swigluoai ('silu' is what transformers saves)")
    rope_params = tc.get("rope_parameters") or {}
    _require(rope_params.get("rope_type", "default") == "default", f"rope_type {rope_params.get('rope_type')!r} unsupported")


def _pick(a: Any, b: Any, what: str) -> Any:
    """The one value given by two spellings of a key; both given and different is an error."""
    if a is not None and b is not None and a != b:
        raise ValueError(f"MiniMax-M3 config: {what} given twice with different values ({a!r} vs {b!r})")
    return a if a is not None else b


def _layer_plan(tc: dict, sc: dict, n: int) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    freq_s = sc.get("sparse_attention_freq")
    lt = tc.get("layer_types")
    sparse = None if freq_s is None else tuple(bool(f) for f in freq_s)
    if lt is not None:
        _require(all(t in (SPARSE_ATTN, FULL_ATTN) for t in lt), f"unknown layer_types entries {sorted(set(lt))}")
        sparse = _pick(sparse, tuple(t == SPARSE_ATTN for t in lt), "sparse_attention_freq / layer_types")
    _require(sparse is not None, "neither sparse_attention_config.sparse_attention_freq nor layer_types is given "
             "(transformers would build an all-dense model; refusing)")
    freq_m = tc.get("moe_layer_freq")
    mlt = tc.get("mlp_layer_types")
    moe = None if freq_m is None else tuple(bool(f) for f in freq_m)
    if mlt is not None:
        _require(all(t in ("sparse", "dense") for t in mlt), f"unknown mlp_layer_types entries {sorted(set(mlt))}")
        moe = _pick(moe, tuple(t == "sparse" for t in mlt), "moe_layer_freq / mlp_layer_types")
    _require(moe is not None, "neither moe_layer_freq nor mlp_layer_types is given")
    _require(len(sparse) == n and len(moe) == n, f"layer plans have {len(sparse)}/{len(moe)} entries for {n} layers")
    disable_iv = sc.get("sparse_disable_index_value")
    if disable_iv is not None:
        _require(len(disable_iv) == n and all(bool(d) for d, s in zip(disable_iv, sparse) if s),
                 "sparse_disable_index_value must be 1 on every sparse layer (index value path not implemented)")
    return sparse, moe


def _rotary(tc: dict, head_dim: int) -> tuple[float, int]:
    rp = tc.get("rope_parameters") or {}
    theta = _pick(tc.get("rope_theta"), rp.get("rope_theta"), "rope_theta")
    theta = 5_000_000.0 if theta is None else float(theta)  # transformers' default_theta for M3
    prf = _pick(tc.get("partial_rotary_factor"), rp.get("partial_rotary_factor"), "partial_rotary_factor")
    prf = 1.0 if prf is None else float(prf)
    width = int(head_dim * prf)
    rd = tc.get("rotary_dim")
    if rd is not None and int(rd) != width:
        raise ValueError(f"MiniMax-M3 config: rotary_dim={rd} disagrees with head_dim × partial_rotary_factor = "
                         f"{head_dim} × {prf} = {width}; transformers (the reference) rotates {width} channels. Fix "
                         "the config (set partial_rotary_factor = rotary_dim / head_dim)")
    _require(width % 2 == 0 and 0 < width <= head_dim, f"rotary width {width} must be even and in (0, head_dim]")
    return theta, width


def _index_params(tc: dict, sc: dict) -> dict[str, int]:
    names = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
             "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
             "index_local_blocks": "sparse_local_block"}
    defaults = {"index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128, "index_topk_blocks": 16,
                "index_local_blocks": 1}
    out = {}
    for flat, legacy in names.items():
        v = _pick(sc.get(legacy), tc.get(flat), f"{legacy} / {flat}")
        out[flat] = int(defaults[flat] if v is None else v)
    return out


def parse_m3_config(hf_config: dict) -> M3Config:
    """Parse a root config.json dict (or its text_config) into `M3Config`. Raises ValueError (see module doc)."""
    tc = text_config_of(hf_config)
    sc = tc.get("sparse_attention_config") or {}
    _assert_released(tc, sc)
    n = int(tc["num_hidden_layers"])
    sparse, moe = _layer_plan(tc, sc, n)
    head_dim = int(tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"])
    theta, rot = _rotary(tc, head_dim)
    idx = _index_params(tc, sc)
    nh, nkv = int(tc["num_attention_heads"]), int(tc["num_key_value_heads"])
    _require(nh % nkv == 0, f"num_attention_heads {nh} not a multiple of num_key_value_heads {nkv}")
    if any(sparse):
        # Selection is per GQA group: index head g serves query heads of kv head g (transformers: h // (nh/ni)).
        _require(idx["index_n_heads"] == nkv, f"index heads {idx['index_n_heads']} must equal kv heads {nkv}")
        _require(idx["index_head_dim"] >= rot, "index_head_dim must hold the rotary width")
        _require(1 <= idx["index_local_blocks"] <= idx["index_topk_blocks"], "need 1 <= local blocks <= top-k blocks")
    bos = tc.get("bos_token_id", hf_config.get("bos_token_id"))
    eos = tc.get("eos_token_id", hf_config.get("eos_token_id"))
    return M3Config(
        vocab_size=int(tc["vocab_size"]), hidden_size=int(tc["hidden_size"]), num_hidden_layers=n,
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=head_dim,
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)), rope_theta=theta, rotary_dim=rot,
        max_position_embeddings=int(tc.get("max_position_embeddings", 524288)),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", False)),
        dense_intermediate_size=int(tc.get("dense_intermediate_size", 12288)),
        intermediate_size=int(tc["intermediate_size"]),
        shared_intermediate_size=int(tc.get("shared_intermediate_size", tc["intermediate_size"])),
        num_local_experts=int(tc["num_local_experts"]), num_experts_per_tok=int(tc["num_experts_per_tok"]),
        routed_scaling_factor=float(tc.get("routed_scaling_factor", 2.0)),
        swiglu_alpha=float(tc.get("swiglu_alpha", 1.702)), swiglu_limit=float(tc.get("swiglu_limit", 7.0)),
        sparse_layers=sparse, moe_layers=moe, **idx,
        bos_token_id=int(200034 if bos is None else bos),
        eos_token_id=200020 if eos is None else eos,
    )
