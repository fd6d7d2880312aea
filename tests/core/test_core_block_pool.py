"""BlockPool: null block, reference counts, hash map, LRU free list (hand-computed expectations)."""

import hashlib

import pytest

from ladle.core.block_pool import NULL_BLOCK_ID, BlockPool, hash_block_tokens


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4
    ids = [b.block_id for b in pool.allocate(4)]
    assert sorted(ids) == [1, 2, 3, 4] and NULL_BLOCK_ID not in ids
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    with pytest.raises(AssertionError):
        pool.allocate(1)


def test_too_small_pool_is_an_error():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_hash_is_sha256_chain():
    want = int.from_bytes(hashlib.sha256(repr((None, (1, 2, 3), None)).encode()).digest()[:8], "little")
    h0 = hash_block_tokens(None, [1, 2, 3])
    assert h0 == want
    assert hash_block_tokens(h0, [4, 5, 6]) != hash_block_tokens(None, [4, 5, 6])
    assert hash_block_tokens(h0, [4, 5, 6]) == hash_block_tokens(h0, (4, 5, 6))
    assert hash_block_tokens(None, [1, 2, 3], extra_keys=("lora", 1)) != h0


def test_ref_counts_and_touch():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.cache_block(a, 111, None, [1, 2])
    pool.touch([a])  # a second request shares it
    assert a.ref_cnt == 2
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free([a])
    assert a.ref_cnt == 0 and pool.num_free_blocks == 3
    assert pool.lookup(111, None, [1, 2]) is a  # still cached while free
    pool.touch([a])  # a hit on a free cached block takes it off the free list
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2


def test_lookup_verifies_tokens_and_parent():
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    assert pool.cache_block(a, 7, 5, [1, 2])
    assert pool.lookup(7, 5, [1, 2]) is a
    assert pool.lookup(7, 5, [1, 3]) is None  # same hash, different ids: a miss
    assert pool.lookup(7, 6, [1, 2]) is None  # same hash, different parent: a miss
    assert pool.lookup(8, 5, [1, 2]) is None
    (b,) = pool.allocate(1)
    assert not pool.cache_block(b, 7, 5, [1, 2])  # hash already held: b stays uncached
    assert b.block_hash is None


def test_caching_disabled():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, 7, None, [1])
    assert pool.lookup(7, None, [1]) is None


def test_lru_eviction_only_when_needed():
    pool = BlockPool(6)  # usable 1..5
    blocks = pool.allocate(5)
    b1, b2, b3, b4, b5 = blocks
    for i, b in enumerate([b1, b2, b3]):
        pool.cache_block(b, 100 + i, None, [i])
    # Free order: b2, b4 (uncached), b1, b5 (uncached), b3.
    for b in [b2, b4, b1, b5, b3]:
        pool.free([b])
    assert pool.num_cached_blocks == 3 and pool.num_evictions == 0
    # Uncached blocks are reused first (most recently freed uncached at the very front), no eviction.
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [b5.block_id, b4.block_id]
    assert pool.num_cached_blocks == 3 and pool.num_evictions == 0
    # Then cached blocks, least recently freed first: b2, then b1, then b3.
    (x,) = pool.allocate(1)
    assert x is b2 and pool.lookup(101, None, [1]) is None and pool.num_evictions == 1
    assert x.block_hash is None and x.token_ids is None
    assert pool.lookup(100, None, [0]) is b1 and pool.lookup(102, None, [2]) is b3
    (y,) = pool.allocate(1)
    assert y is b1


def test_hit_refreshes_lru_position():
    pool = BlockPool(4)  # usable 1..3
    a, b, c = pool.allocate(3)
    for i, blk in enumerate([a, b, c]):
        pool.cache_block(blk, i, None, [i])
    pool.free([a])
    pool.free([b])
    pool.free([c])
    pool.touch([a])  # reused by a hit, then freed again: now the most recently freed
    pool.free([a])
    assert [blk.block_id for blk in pool.allocate(3)] == [b.block_id, c.block_id, a.block_id]
