"""Incremental detokenizer: UTF-8 safe text deltas and stop strings matched across token boundaries.

Text per step comes from decoding a short window of token ids (the offsets scheme also used by vLLM and
HF TGI): `prefix_offset..read_offset` is text already emitted, `prefix_offset..end` includes the new tokens;
the delta is the difference. A delta that ends in U+FFFD (an incomplete multi-byte sequence split over
byte-level tokens) is held until the next token completes it; at finish everything left is flushed.

Stop strings: text that could still be the start of a stop string is held back; when the match fails it is
released, when it succeeds the text is cut before the stop string (or after it with
include_stop_str_in_output) and the caller finishes the request with reason "stop".
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first outputs (spacing of SentencePiece-style vocabularies)


def fast_decoder(tokenizer: Any, skip_special_tokens: bool) -> Optional[Callable[[list[int]], str]]:
    """The `tokenizers` (Rust) decode of a transformers TokenizersBackend tokenizer, bound to
    `skip_special_tokens`, or None when that is not provably what `tokenizer.decode(ids,
    skip_special_tokens=..., clean_up_tokenization_spaces=False)` computes (a subclass overriding decode, a
    slow tokenizer). transformers 5.x `TokenizersBackend._decode` with clean-up off is exactly
    `self._tokenizer.decode(ids, skip_special_tokens=...)`; its Python wrapper (to_py_obj, kwargs) costs ~5x
    the Rust call, paid twice per token per sequence."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # pragma: no cover - other transformers layouts take the plain path
        return None
    cls = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend) and cls._decode is TokenizersBackend._decode
            and cls.decode is PreTrainedTokenizerBase.decode):
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return None
    return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """One sequence's text state. Not thread-safe (the engine thread owns it).

    Args: tokenizer (transformers), prompt_token_ids, stop (strings), include_stop_str_in_output,
    skip_special_tokens, min_tokens (as in vLLM, stop strings are not matched in text produced before the
    request has `min_tokens` output tokens), single_token_texts (optional, shared by the sequences of one tokenizer
    and one skip_special_tokens value: token id -> the decode of that token alone; in steady decoding the
    already-emitted window is one token, so one of the two decodes per step becomes a lookup).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0, single_token_texts: Optional[dict[int, str]] = None) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self._num_output_tokens = 0
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""  # all decoded text (emitted + held)
        self._emitted = 0  # chars of _text already released
        self.stop_reason: Optional[str] = None  # the stop string that matched, once one did
        self._fast_decode = fast_decoder(tokenizer, skip_special_tokens)
        self._single = single_token_texts

    @property
    def output_text(self) -> str:
        """Text released so far (what the client has seen)."""
        return self._text[:self._emitted]

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_new(self, flush: bool) -> str:
        """New complete text from tokens since the last call (all pending text when flush)."""
        window = self._ids[self._prefix_offset:self._read_offset]
        if len(window) == 1 and self._single is not None:  # decode is a pure function of the ids: cache it
            prefix = self._single.get(window[0])
            if prefix is None:
                prefix = self._single[window[0]] = self._decode(window)
        else:
            prefix = self._decode(window)
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) and not flush:
            return ""
        if full.endswith(_REPLACEMENT) and not flush:
            return ""  # incomplete UTF-8: wait for the rest
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Feed new tokens; return the text delta to release now.

        When a stop string matches, `stop_reason` is set and the returned delta ends the output (the caller
        must finish the request). `finished=True` (the request ended for another reason) flushes held text.
        """
        if self.stop_reason is not None:
            return ""
        self._ids.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        delta = self._decode_new(flush=finished)
        if not self.stop:  # nothing is ever held back: everything decoded so far was released, and now the delta
            self._text += delta
            self._emitted = len(self._text)
            return delta
        old_len = len(self._text)
        self._text += delta
        if self.stop and self._num_output_tokens < self.min_tokens:
            return self._release(len(self._text))  # too early for stop strings: nothing to hold back
        if self.stop:
            hit = self._find_stop(old_len)
            if hit is not None:
                idx, stop = hit
                self.stop_reason = stop
                self._text = self._text[:idx + (len(stop) if self.include_stop else 0)]
                return self._release(len(self._text))
        if finished or not self.stop or self.include_stop:
            return self._release(len(self._text))
        return self._release(len(self._text) - self._held_suffix())

    def _find_stop(self, old_len: int) -> Optional[tuple[int, str]]:
        """Earliest stop string occurrence that ends in the new text."""
        best: Optional[tuple[int, str]] = None
        for stop in self.stop:
            start = max(0, old_len - len(stop) + 1, 0 if self.include_stop else self._emitted)
            idx = self._text.find(stop, start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

    def _held_suffix(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        text, longest = self._text, 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self._text[self._emitted:upto]
        self._emitted = upto
        return delta
