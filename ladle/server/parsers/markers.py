"""Finding fixed markers in streamed text, holding back only what could still become a marker.

Streamed model output arrives in arbitrary pieces, so a marker such as `</mm:think>` may be split anywhere
(`"...</mm"` + `":think>..."`). A streaming parser emits text up to the earliest complete marker and, when there is
none, everything except the longest suffix that is a proper prefix of some marker; that suffix waits for the next
piece (or is flushed as plain text when the stream ends).
"""

from __future__ import annotations

from typing import Iterable, Optional


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper, non-empty prefix of one of `markers` (0 if none)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: Iterable[str], start: int = 0) -> Optional[tuple[int, str]]:
    """(index, marker) of the earliest occurrence in `text[start:]` of any of `markers`; on a tie the longer marker."""
    best: Optional[tuple[int, str]] = None
    for marker in markers:
        i = text.find(marker, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(marker) > len(best[1]))):
            best = (i, marker)
    return best


def split_at_marker(text: str, markers: Iterable[str]) -> tuple[str, Optional[str], str]:
    """Split streamed `text` at the earliest marker.

    Returns `(before, marker, after)` when a marker occurs; otherwise `(safe, None, held)` where `held` is the
    longest suffix that could still grow into a marker and `safe + held == text`.
    """
    markers = tuple(markers)
    hit = find_first(text, markers)
    if hit is not None:
        i, marker = hit
        return text[:i], marker, text[i + len(marker):]
    k = partial_marker_len(text, markers)
    return text[: len(text) - k], None, text[len(text) - k:]
