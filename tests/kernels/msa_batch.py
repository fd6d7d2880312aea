"""Tiny ragged MSA batches for the indexer / sparse-attention tests (CPU interpreter or CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MSABatch:
    positions: torch.Tensor  # [T] int64 (tokens past the last request have -1)
    query_start_loc: torch.Tensor  # [B+1] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    num_blocks: int
    num_tokens: int


def build(reqs: list[tuple[int, int]], block_size: int, max_blocks: int, pad_tokens: int = 0,
          device: str = "cpu", seed: int = 0) -> MSABatch:
    """reqs: (context_len, num_new_tokens) per request; new tokens sit at positions context_len .. + n - 1.
    Physical blocks are a random permutation of 1..num_blocks-1 (block 0 is the null block)."""
    g = torch.Generator().manual_seed(seed)
    qsl, pos = [0], []
    for ctx, n in reqs:
        assert (ctx + n + block_size - 1) // block_size <= max_blocks
        qsl.append(qsl[-1] + n)
        pos += list(range(ctx, ctx + n))
    pos += [-1] * pad_tokens
    B = len(reqs)
    num_blocks = B * max_blocks + 3
    perm = torch.randperm(num_blocks - 1, generator=g)[: B * max_blocks] + 1
    return MSABatch(
        positions=torch.tensor(pos, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        block_table=perm.view(B, max_blocks).to(torch.int32).to(device),
        num_blocks=num_blocks,
        num_tokens=len(pos),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def as_sets(sel: torch.Tensor) -> list:
    """[H, T, k] -> nested lists of frozensets of the valid ids, for set-based comparisons."""
    return [[frozenset(v for v in row if v >= 0) for row in h] for h in sel.cpu().tolist()]


def spy_launches(monkeypatch, module, kernel_name: str) -> list:
    """Replace the Triton kernel `module.<kernel_name>` with a wrapper that records each launch grid and launches the
    real kernel. Returns the (live) list of grids."""
    launched: list = []
    real = getattr(module, kernel_name)

    class Spy:
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(module, kernel_name, Spy())
    return launched
