"""Llama checkpoints made by ladle: the config-only export of a GGUF (for `--load-format dummy` elsewhere).

`ladle make-checkpoint llama --from-gguf GGUF --config-only OUT` calls `export_config_only`: the GGUF itself
(98 MB for SmolLM2 Q4_1) need not travel to a GPU host; config.json + tokenizer files + generation_config.json
(a few MB) are enough to build the model at real shapes with random weights.
"""

from __future__ import annotations

import json
import os

from ladle.models.gguf import read_gguf_config

# Dtype written into an exported config that does not name one (GGUF metadata carries none); SmolLM2's
# original checkpoint is bfloat16.
EXPORT_DEFAULT_DTYPE = "bfloat16"


def export_config_only(gguf_path: str, out_dir: str) -> None:
    """Write config.json, the tokenizer files (tokenizer.json, tokenizer_config.json with the chat template)
    and generation_config.json for the GGUF's model into `out_dir` (created if needed). No weights.
    Raises FileNotFoundError if the GGUF is missing, ValueError for an unsupported GGUF model type."""
    from transformers import AutoTokenizer, GenerationConfig

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    os.makedirs(out_dir, exist_ok=True)
    cfg = read_gguf_config(gguf_path)
    if not cfg.get("dtype"):
        cfg["dtype"] = EXPORT_DEFAULT_DTYPE
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                              gguf_file=os.path.basename(gguf_path))
    tokenizer.save_pretrained(out_dir)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    GenerationConfig(**gen).save_pretrained(out_dir)
