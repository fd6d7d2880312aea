"""A converted copy of a GGUF model, made once and reused: config.json, tokenizer files, generation config and
the dequantised float32 weights as `model.safetensors` (HF names, q/k rows already un-permuted).

Why: reading a GGUF through transformers (config and tokenizer) and dequantising it with the `gguf` library takes
tens of seconds on a small CPU for a 135M-parameter model; a safetensors file of the same float32 values loads
in about a second. The values are bit-identical to what `ladle.models.gguf.iter_gguf_tensors` yields, so the
copy changes nothing but time.

Location: `$LADLE_CACHE_DIR` (default `~/.cache/ladle`) / `gguf/<key>`, where key hashes the file's content
(see `cache_key`) and `CACHE_VERSION`; the copy holds float32 weights (about 4 bytes per parameter: 540 MB for
SmolLM2-135M). A copy is written to a temporary folder and renamed into place,
so concurrent processes never see half a copy. Where the cache cannot be written (read-only home), callers fall
back to reading the GGUF directly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Optional

from ladle.config import env_flag

CACHE_VERSION = 1
COMPLETE_MARKER = "ladle_gguf_cache_complete"
WEIGHTS_FILE = "model.safetensors"
FULL_HASH_MAX_BYTES = 512 << 20
HEAD_TAIL_BYTES = 16 << 20

logger = logging.getLogger(__name__)


def cache_root() -> str:
    """The folder holding converted GGUF copies."""
    base = env_flag("LADLE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ladle")
    return os.path.join(base, "gguf")


def cache_key(gguf_path: str) -> str:
    """A key from the file's content, so every checkout or venv holding the same file shares one copy.

    Files up to FULL_HASH_MAX_BYTES are hashed whole (about 0.2 s for SmolLM2's 98 MB); larger ones by size,
    modification time and their first and last HEAD_TAIL_BYTES, to keep start-up fast."""
    real = os.path.realpath(gguf_path)
    size = os.path.getsize(real)
    digest = hashlib.sha256(f"v{CACHE_VERSION}|{size}|".encode())
    with open(real, "rb") as f:
        if size <= FULL_HASH_MAX_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        else:
            digest.update(str(os.stat(real).st_mtime_ns).encode())
            digest.update(f.read(HEAD_TAIL_BYTES))
            f.seek(size - HEAD_TAIL_BYTES)
            digest.update(f.read(HEAD_TAIL_BYTES))
    stem = os.path.splitext(os.path.basename(real))[0]
    return f"{stem}-{digest.hexdigest()[:16]}"


def cached_dir(gguf_path: str) -> Optional[str]:
    """The complete converted copy of `gguf_path`, or None if there is none yet."""
    path = os.path.join(cache_root(), cache_key(gguf_path))
    return path if os.path.isfile(os.path.join(path, COMPLETE_MARKER)) else None


def ensure_converted(gguf_path: str) -> Optional[str]:
    """Return the converted copy's folder, writing it first if needed; None if it cannot be written
    (the error is logged, and callers read the GGUF directly)."""
    found = cached_dir(gguf_path)
    if found:
        return found
    final = os.path.join(cache_root(), cache_key(gguf_path))
    try:
        os.makedirs(cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=cache_root())
    except OSError as e:
        logger.warning("cannot write the GGUF cache under %s (%s); reading the GGUF directly", cache_root(), e)
        return None
    try:
        _convert(gguf_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            if not cached_dir(gguf_path):
                raise
    except Exception as e:  # noqa: BLE001 - any failure leaves the direct path usable
        logger.warning("GGUF cache conversion failed (%s); reading the GGUF directly", e)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cached_dir(gguf_path)


def _convert(gguf_path: str, out_dir: str) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    from ladle.models.checkpoint_llama import export_config_only
    from ladle.models.gguf import iter_gguf_tensors

    export_config_only(gguf_path, out_dir)
    count, tensors = iter_gguf_tensors(gguf_path)
    desc = f"Converting {os.path.basename(gguf_path)} (once)"
    state = {name: t.contiguous() for name, t in tqdm(tensors, total=count, desc=desc, unit="tensor")}
    save_file(state, os.path.join(out_dir, WEIGHTS_FILE), metadata={"source": os.path.basename(gguf_path)})
    with open(os.path.join(out_dir, COMPLETE_MARKER), "w", encoding="utf-8") as f:
        f.write(f"{os.path.realpath(gguf_path)}\n")
