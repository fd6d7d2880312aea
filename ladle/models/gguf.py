"""GGUF files: the HF config (via transformers) and dequantised, HF-named tensors (via the `gguf` library).

Tensor names follow llama.cpp's standard scheme (gguf spec, "Standardized tensor names"):
`token_embd`, `output_norm`, `output`, and per block `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output,
ffn_norm, ffn_gate, ffn_up, ffn_down}`, each with `.weight` (and `.bias` for Qwen2's q/k/v). `GGUF_TO_HF` maps
them to transformers names, which the model's own table then routes.

RoPE permutation: llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`) reorders the rows of
q/k weights of `llama`-architecture files from HF's half-split (NeoX) rotary layout to interleaved pairs:
    w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)
`unpermute_rope_rows` applies the inverse, giving the HF layout back. Qwen2 files are not permuted.
"""

from __future__ import annotations

import os
import re
from typing import Iterator

import numpy as np
import torch

# general.architecture -> HF architectures entry (the GGUF architectures whose tensors this module maps)
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# transformers model_type (from its GGUF config reader) -> HF architectures entry
MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

GGUF_TO_HF: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`. Raises KeyError if unmapped."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, kind, suffix = m.groups()
        if kind in GGUF_TO_HF and not GGUF_TO_HF[kind].startswith(("model.", "lm_head")):
            return f"model.layers.{layer}.{GGUF_TO_HF[kind]}.{suffix}"
    elif m := _TOP_RE.match(gguf_name):
        kind, suffix = m.groups()
        if kind in ("token_embd", "output_norm", "output"):
            return f"{GGUF_TO_HF[kind]}.{suffix}"
        if kind == "rope_freqs":
            raise KeyError("GGUF tensor rope_freqs (Llama-3.1 RoPE factors) is not supported yet; "
                           "use the HF safetensors checkpoint of this model")
    raise KeyError(f"GGUF tensor {gguf_name!r} has no mapping to a transformers name")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation. w [rows, cols] (or [rows] for a bias) with rows =
    n_head * head_dim; returns the HF (half-split rotary) row order, same shape."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_config(gguf_path: str) -> dict:
    """The HF config.json dict transformers builds from the file's metadata, with `architectures` filled in
    (transformers leaves it empty for GGUF). Raises ValueError for a model type ladle cannot name."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                        gguf_file=os.path.basename(gguf_path))
    cfg = config.to_dict()
    model_type = cfg.get("model_type")
    if not cfg.get("architectures"):
        if model_type not in MODEL_TYPE_TO_ARCH:
            raise ValueError(f"GGUF model type {model_type!r} is not supported; supported: "
                             f"{', '.join(sorted(MODEL_TYPE_TO_ARCH))}")
        cfg["architectures"] = [MODEL_TYPE_TO_ARCH[model_type]]
    cfg.pop("_name_or_path", None)
    return cfg


def iter_gguf_tensors(gguf_path: str) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """(tensor count, iterator of (HF name, float32 CPU tensor)), dequantising one tensor at a time.

    Raises ValueError for a GGUF architecture ladle does not map, KeyError for an unmapped tensor name.
    """
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}")
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_head_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in reader.tensors:
            name = gguf_hf_name(tensor.name)
            weights = dequantize(tensor.data, tensor.tensor_type)
            if arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
                weights = unpermute_rope_rows(weights, n_head)
            elif arch == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
                weights = unpermute_rope_rows(weights, n_head_kv)
            yield name, torch.from_numpy(np.array(weights, dtype=np.float32))  # copy: file data is a read-only memmap

    return len(reader.tensors), gen()


def _field(reader, key: str, default=None):
    """Scalar or string metadata value of a GGUF key (default if absent)."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF file lacks metadata key {key!r}")
        return default
    return field.contents()
