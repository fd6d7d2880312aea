"""Tokenizer loading (through transformers), chat template, and the model's EOS ids.

The tokenizer comes from the model: an HF directory (`AutoTokenizer.from_pretrained(dir)`) or a GGUF file
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, which reads the vocabulary, merges and chat template
stored in the GGUF metadata). `--tokenizer DIR` overrides both.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Optional


def load_tokenizer(tokenizer_path: Optional[str], gguf_file: Optional[str] = None) -> Any:
    """A transformers tokenizer.

    tokenizer_path: a directory (or the directory holding the GGUF); gguf_file: the GGUF's file name (or full
    path) when the tokenizer lives inside it (`--tokenizer` is already folded into tokenizer_path by the loader).
    Raises ValueError when nothing to load from.
    """
    from transformers import AutoTokenizer

    if gguf_file:
        directory = tokenizer_path or os.path.dirname(os.path.abspath(gguf_file))
        if os.path.isfile(directory):
            directory = os.path.dirname(directory)
        return AutoTokenizer.from_pretrained(directory, gguf_file=os.path.basename(gguf_file))
    if not tokenizer_path:
        raise ValueError("no tokenizer: the model source names no tokenizer directory; pass --tokenizer")
    return AutoTokenizer.from_pretrained(tokenizer_path)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, Iterable):
        return [int(v) for v in value if v is not None]
    return []


def eos_token_ids(tokenizer: Any, generation_config: Optional[dict] = None) -> tuple[int, ...]:
    """The tokenizer's eos id plus generation_config's `eos_token_id` (an int or a list), deduplicated,
    in first-seen order."""
    ids: list[int] = []
    for v in _as_ids(getattr(tokenizer, "eos_token_id", None)) + _as_ids((generation_config or {}).get("eos_token_id")):
        if v not in ids:
            ids.append(v)
    return tuple(ids)


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                        add_special_tokens: bool = False, **template_kwargs: Any) -> list[int]:
    """Render `messages` with the model's chat template and tokenize. Raises ValueError without a template.
    `add_special_tokens`: the tokenizer's own (BOS ...) on top of what the template writes; off by default, the
    template writes them (vLLM's /tokenize default for messages too)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use the completions API")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids
