"""HF `architectures` string -> ladle model class, imported lazily (importing the registry loads no model).

Add an architecture by adding one line to `_MODELS`: "HFArchitectureName": ("module.path", "ClassName").
"""

from __future__ import annotations

import importlib
from typing import Iterable

_LLAMA = ("ladle.models.llama", "LlamaForCausalLM")
_M3 = ("ladle.models.minimax_m3", "MiniMaxM3ForCausalLM")

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,  # refused at construction if the config sets a sliding window
    "Qwen2ForCausalLM": _LLAMA,
    "MiniMaxM3SparseForConditionalGeneration": _M3,
    "MiniMaxM3SparseForCausalLM": _M3,
    "MiniMaxM3VLForCausalLM": _M3,
}


def supported_architectures() -> list[str]:
    """Sorted list of the HF architecture names ladle can serve."""
    return sorted(_MODELS)


def resolve_model_class(architectures: "Iterable[str] | str | None") -> type:
    """The class for the first supported name in `architectures` (config.json's list).

    Raises ValueError naming what was asked for and listing every supported architecture.
    """
    names = [architectures] if isinstance(architectures, str) else list(architectures or [])
    for name in names:
        if name in _MODELS:
            module_name, class_name = _MODELS[name]
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(
        f"model architecture {names or '(none given in config.json)'} is not supported by ladle; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
