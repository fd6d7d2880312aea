"""Per-request block tables on top of the BlockPool, and automatic prefix caching.

A request holding `n` tokens of K/V owns `ceil(n / block_size)` blocks; block i holds token positions
[i * block_size, (i + 1) * block_size). Prefix caching keys each *full* block by a hash chain

    h_0 = hash(None, tokens[0:bs]),  h_i = hash(h_{i-1}, tokens[i*bs:(i+1)*bs])

so a hit on block i implies the whole prefix matches (and `BlockPool.lookup` re-checks the token ids and
parent hash, so a hash collision is a miss, never a wrong hit). Hits are whole blocks; the last known token
is never served from the cache, so a fully cached prompt still computes at least one token (its logits are
needed to sample).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ladle.core.block_pool import BlockPool, KVBlock, hash_block_tokens
from ladle.core.request import Request

HashFn = Callable[[Optional[int], Sequence[int], Optional[tuple]], int]


class KVCacheManager:
    """Owns the BlockPool and each request's block list.

    Args:
        block_size: tokens per block.
        num_blocks: pool size including the null block 0.
        enable_prefix_caching: register computed full blocks and serve hits.
        hash_fn: block hash function (tests inject colliding ones).
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_block_ids: dict[str, list[int]] = {}  # mirror of _req_blocks' ids (get_block_ids each step)
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks of the request already registered

    # ---- sizes -------------------------------------------------------------------------------------

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (physical ids, a new list)."""
        return list(self._req_block_ids.get(request_id, ()))

    # ---- prefix cache ------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of `request.all_token_ids` in whole blocks, leaving the last token out.

        Returns (blocks, num_hit_tokens = len(blocks) * block_size). Takes no reference: pass the blocks
        to `allocate_slots`. Requests with prompt_logprobs never hit (they need logits at every position).
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_hit_blocks)
        tokens = request.all_token_ids
        bs = self.block_size
        hits: list[KVBlock] = []
        parent: Optional[int] = None
        for i in range(max_hit_blocks):
            block = self.pool.lookup(hashes[i], parent, tokens[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
            parent = hashes[i]
        return hits, len(hits) * bs

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose tokens are all computed (call after advancing
        `num_computed_tokens`). Blocks whose hash another block already holds stay uncached."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        end = request.num_computed_tokens // self.block_size
        if end <= start:
            return
        blocks = self._req_blocks[rid]
        hashes = self._block_hashes(request, end)
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(start, end):
            parent = hashes[i - 1] if i else None
            self.pool.cache_block(blocks[i], hashes[i], parent, tokens[i * bs:(i + 1) * bs])
        self._num_cached_blocks[rid] = end

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Extend `request.block_hashes` to at least `num_blocks` entries (token ids are append-only, so
        hashes computed once stay valid, across preemptions too)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[i - 1] if i else None
            hashes.append(self.hash_fn(parent, tokens[i * bs:(i + 1) * bs], None))
        return hashes

    # ---- allocation --------------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Make the request hold blocks for
        `request.num_computed_tokens + len(new_computed_blocks) * block_size + num_new_tokens` tokens.

        `new_computed_blocks` (prefix-cache hits from `get_computed_blocks`, only for a request holding no
        blocks) are referenced and placed first. Returns False and changes nothing when the free list
        cannot cover the new blocks plus any hit blocks that are currently free.
        """
        rid = request.request_id
        blocks = self._req_blocks.get(rid, [])
        if not new_computed_blocks and request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
            return True  # the usual decode step: the last block still has room
        assert not new_computed_blocks or not blocks, "prefix hits only for a request without blocks"
        num_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.num_blocks_for(num_tokens) - len(blocks) - len(new_computed_blocks)
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_free_hits > self.pool.num_free_blocks:
            return False
        ids = self._req_block_ids.setdefault(rid, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            ids.extend(b.block_id for b in new_computed_blocks)
            self._num_cached_blocks[rid] = len(new_computed_blocks)
        if num_new_blocks > 0:
            new_blocks = self.pool.allocate(num_new_blocks)
            blocks.extend(new_blocks)
            ids.extend(b.block_id for b in new_blocks)
        self._req_blocks[rid] = blocks
        return True

    def free(self, request: Request) -> None:
        """Release all the request's blocks, tail first (so its tail is evicted before its prefix)."""
        rid = request.request_id
        blocks = self._req_blocks.pop(rid, [])
        self._req_block_ids.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        self.pool.free(reversed(blocks))
