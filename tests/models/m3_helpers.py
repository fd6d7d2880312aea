"""Small helpers shared by the MiniMax-M3 test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import torch


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    """n random token ids in [3, vocab) (ids 0-2 are the tiny tokenizer's specials), reproducible by seed."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def selection_sets(sel: torch.Tensor) -> torch.Tensor:
    """selected_block_ids [heads, T, k] (-1 padded) -> the same ids sorted per row, padding last, on the CPU: equal
    tensors mean equal block sets per (head, token)."""
    sel = sel.long().cpu()
    return torch.sort(torch.where(sel < 0, torch.full_like(sel, 1 << 30), sel), dim=-1).values
