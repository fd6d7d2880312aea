"""A minimal paged-KV driver for tests: runs a model without the runner or the scheduler.

`PagedTestCache` owns per-layer K/V tensors in the fixed layout, hands out blocks in a shuffled order (so
block tables are not trivially contiguous), tracks each sequence's length and builds the `AttentionMetadata`
+ `ForwardContext` for one step from a list of (sequence key, new token ids) chunks. Any mix works: fresh
prompts, chunked prefill continuation, decode, several sequences ragged in one step, trailing padding tokens.

    cache = PagedTestCache(model.kv_cache_specs(), num_blocks=64, block_size=16)
    hidden = cache.run(model, [("a", prompt_a), ("b", prompt_b)])   # [T, hidden]
    hidden = cache.run(model, [("a", [next_a]), ("b", [next_b])])  # decode step
"""

from __future__ import annotations

import random
from typing import Hashable, Optional, Sequence

import torch

from ladle.layers.attention.metadata import (
    AttentionMetadata,
    ForwardContext,
    OpBackends,
    LayerCacheSpec,
    LayerKVCache,
    set_forward_context,
)


class PagedTestCache:
    """Caches + block bookkeeping for tests. Block 0 is the null block and is never handed out."""

    def __init__(
        self,
        specs: Sequence[LayerCacheSpec],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: "torch.device | str" = "cpu",
        shuffle_seed: Optional[int] = 0,
        backends: Optional[OpBackends] = None,
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.backends = backends or OpBackends.reference()
        self.kv_caches = []
        for spec in specs:
            shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            index = (torch.zeros(num_blocks, block_size, spec.index_head_dim, dtype=dtype, device=device)
                     if spec.index_head_dim else None)
            self.kv_caches.append(LayerKVCache(
                torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device), index))
        self._free = list(range(1, num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self._free)
        self.block_ids: dict[Hashable, list[int]] = {}
        self.seq_lens: dict[Hashable, int] = {}

    def _ensure_blocks(self, key: Hashable, num_tokens: int) -> list[int]:
        blocks = self.block_ids.setdefault(key, [])
        while len(blocks) * self.block_size < num_tokens:
            if not self._free:
                raise RuntimeError("PagedTestCache out of blocks")
            blocks.append(self._free.pop())
        return blocks

    def build(
        self, chunks: Sequence[tuple[Hashable, Sequence[int]]], num_padding: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """One step's (input_ids [T] int64, positions [T] int64, ForwardContext). Advances the sequences.
        `num_padding` trailing tokens (id 0, position 0, slot -1) imitate CUDA-graph padding."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl, seq_lens, ctx_lens, tables = [0], [], [], []
        for key, tokens in chunks:
            start = self.seq_lens.get(key, 0)
            end = start + len(tokens)
            blocks = self._ensure_blocks(key, end)
            for pos in range(start, end):
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids.extend(int(t) for t in tokens)
            positions.extend(range(start, end))
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            ctx_lens.append(start)
            tables.append(list(blocks))
            self.seq_lens[key] = end
        input_ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [-1] * num_padding
        max_blocks = max(len(t) for t in tables)
        table = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        md = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            block_size=self.block_size,
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx_lens,
            num_actual_tokens=qsl[-1],
        )
        ctx = ForwardContext(attn_metadata=md, kv_caches=self.kv_caches, backends=self.backends)
        return md.positions.new_tensor(input_ids), md.positions, ctx

    @torch.no_grad()
    def run(
        self, model: torch.nn.Module, chunks: Sequence[tuple[Hashable, Sequence[int]]], num_padding: int = 0
    ) -> torch.Tensor:
        """model.forward over one step built by `build`; returns hidden states [T, hidden]."""
        input_ids, positions, ctx = self.build(chunks, num_padding)
        with set_forward_context(ctx):
            return model(input_ids, positions)

    @staticmethod
    def last_token_rows(chunks: Sequence[tuple[Hashable, Sequence[int]]]) -> list[int]:
        """Row index of each chunk's last token in the flat batch (what `logits_indices` would hold)."""
        rows, offset = [], 0
        for _, tokens in chunks:
            offset += len(tokens)
            rows.append(offset - 1)
        return rows
