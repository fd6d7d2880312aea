"""Tokenizers for building prompts: a local HF tokenizer directory, or the server's /tokenize and /detokenize.

Both offer: `encode(text) -> list[int]` (no special tokens), `decode(ids) -> str`, `vocab_size` (base vocabulary,
like HF's `tokenizer.vocab_size`), `special_ids` (ids never drawn for random prompts), `num_special_tokens_to_add`
and `max_model_len` (None if unknown).

Server shapes (vLLM's): POST /tokenize {"model", "prompt", "add_special_tokens"} -> {"tokens": [...], "count",
"max_model_len"}; POST /detokenize {"model", "tokens"} -> {"prompt": "..."}.
The server does not report its vocabulary size in those shapes, so `ServerTokenizer` looks for a `vocab_size` key in
`/version` (or `/tokenizer_info`), then binary-searches the largest id `/detokenize` accepts, and falls back to
32000 with a warning when the server accepts any id.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import httpx

from ladle.bench.server_info import find_key


class BenchTokenizer(Protocol):
    vocab_size: int
    special_ids: set[int]
    num_special_tokens_to_add: int
    max_model_len: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LocalTokenizer:
    """transformers.AutoTokenizer from a local directory (never downloads). Raises OSError if it cannot load."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # lazy: only when --tokenizer is given

        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = int(self.hf.vocab_size)
        self.special_ids = set(int(i) for i in self.hf.all_special_ids)
        self.num_special_tokens_to_add = int(self.hf.num_special_tokens_to_add())
        self.max_model_len = None
        self.path = path

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)

    def chat_prompt(self, text: str) -> str:
        """The prompt text after the tokenizer's chat template (one user turn, generation prompt added)."""
        return self.hf.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )


class ServerTokenizer:
    """Tokenizes through the server. Thread-safe (httpx.Client); raises httpx.HTTPError when the server refuses."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 120.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.client = httpx.Client(timeout=timeout_s)
        first = self._tokenize("a", add_special_tokens=True)
        plain = self.encode("a")
        self.max_model_len = first.get("max_model_len")
        with_specials = list(first["tokens"])
        self.num_special_tokens_to_add = max(0, len(with_specials) - len(plain))
        self.special_ids = set(with_specials) - set(plain)
        self.vocab_size = self._discover_vocab_size()

    def _tokenize(self, text: str, add_special_tokens: bool) -> dict[str, Any]:
        r = self.client.post(
            f"{self.base_url}/tokenize",
            json={"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens},
        )
        r.raise_for_status()
        return r.json()

    def encode(self, text: str) -> list[int]:
        return list(self._tokenize(text, add_special_tokens=False)["tokens"])

    def decode(self, ids: list[int]) -> str:
        r = self.client.post(f"{self.base_url}/detokenize", json={"model": self.model, "tokens": list(ids)})
        r.raise_for_status()
        return r.json()["prompt"]

    def _decodes(self, token_id: int) -> bool:
        try:
            r = self.client.post(f"{self.base_url}/detokenize", json={"model": self.model, "tokens": [token_id]})
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def _discover_vocab_size(self) -> int:
        for path in ("/version", "/tokenizer_info"):
            try:
                r = self.client.get(f"{self.base_url}{path}")
                if r.status_code == 200:
                    v = find_key(r.json(), "vocab_size")
                    if isinstance(v, int) and v > 0:
                        return v
            except (httpx.HTTPError, ValueError):
                pass
        hi = 1 << 21
        if self._decodes(hi):
            print("WARNING: cannot learn the server's vocabulary size; assuming 32000", file=sys.stderr)
            return 32000
        lo = 0  # invariant: lo decodes, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._decodes(mid):
                lo = mid
            else:
                hi = mid
        return lo + 1
