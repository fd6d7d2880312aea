"""Small helpers on Hugging Face `config.json` dicts, shared by the models, the loader and the engine's config
resolution (one definition of "the language-model part of a config")."""

from __future__ import annotations


def text_config_of(hf_config: dict) -> dict:
    """The language-model config: `text_config` of a multimodal wrapper (e.g. MiniMax-M3's VL release), else the
    dict itself."""
    inner = hf_config.get("text_config")
    return inner if isinstance(inner, dict) else hf_config
