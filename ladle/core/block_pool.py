"""Physical KV blocks: allocation, reference counts, the prefix-cache hash map and the LRU free list.

Block ids index dimension 0 of every layer's K/V (and index-K) tensor `[num_blocks, block_size, ...]`.
Block 0 is the null block (padding rows of block tables point at it); it is never handed out.

Free list order (front = next to be allocated):

    [ uncached free blocks ... | cached free blocks, least recently freed ... most recently freed ]

A freed block without a hash goes to the front (nothing is lost by reusing it); a freed cached block goes
to the back and keeps its hash entry, so a later request can still hit it. Allocation takes from the
front; taking a cached block evicts it (its hash entry is dropped). So cached blocks are evicted only
when allocation needs them, least recently freed first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

NULL_BLOCK_ID = 0


def hash_block_tokens(
    parent_hash: Optional[int], token_ids: Sequence[int], extra_keys: Optional[tuple] = None
) -> int:
    """Hash-chain key of one full block: sha256 over repr((parent_hash, token ids, extra_keys)), first
    8 bytes as an unsigned int. Deterministic across processes. `extra_keys` is reserved for inputs that
    change K/V beyond the token ids (LoRA id, multimodal hashes); None today."""
    payload = repr((parent_hash, tuple(token_ids), extra_keys)).encode()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


class KVBlock:
    """One physical block. `block_hash`/`parent_hash`/`token_ids` are set while it is in the prefix
    cache (token ids are kept so a hit is verified, not trusted to the hash)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[int] = None
        self.parent_hash: Optional[int] = None
        self.token_ids: Optional[tuple[int, ...]] = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """All blocks of the cache; `num_blocks` includes the null block, so `num_blocks - 1` are usable.

    Invariants: a block is on the free list iff its ref_cnt is 0 (block 0 never is); `cached[h]` is the
    block whose `block_hash == h`.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1  # pinned forever
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[int, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (including cached blocks nobody references)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, num: int) -> list[KVBlock]:
        """Take `num` blocks from the front of the free list (ref_cnt 1 each), evicting cached ones taken.
        The caller checks `num_free_blocks` first."""
        assert num <= len(self._free), f"allocating {num} blocks with {len(self._free)} free"
        out = []
        for _ in range(num):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks (removing free ones from the free list)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the order given. Blocks reaching 0 join the free list:
        cached ones at the back (evicted last), uncached ones at the front."""
        for block in blocks:
            assert block.ref_cnt > 0 and block.block_id != NULL_BLOCK_ID, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def lookup(
        self, block_hash: int, parent_hash: Optional[int], token_ids: Sequence[int]
    ) -> Optional[KVBlock]:
        """The cached block for this hash if its parent hash and token ids match exactly, else None."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_block(
        self, block: KVBlock, block_hash: int, parent_hash: Optional[int], token_ids: Sequence[int]
    ) -> bool:
        """Register a fully computed block under `block_hash`. Returns False (block stays uncached) when
        caching is off or another block already holds this hash (same content computed twice, or a
        hash collision)."""
        if not self.enable_caching or block_hash in self._cached:
            return False
        assert block.block_hash is None and block.ref_cnt > 0, block
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
        self._cached[block_hash] = block
        return True

    def _evict(self, block: KVBlock) -> None:
        del self._cached[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = block.parent_hash = block.token_ids = None
        self.num_evictions += 1
