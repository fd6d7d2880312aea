"""KVCacheManager: paged allocation, prefix hits (whole blocks, last token recomputed, verified ids)."""

from core_sim import make_request

from ladle.core.kv_cache_manager import KVCacheManager

BS = 4


def _prefill(kv: KVCacheManager, req) -> int:
    """Schedule the whole request in one go, as the scheduler would; returns the hit tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return num_hit


def test_allocation_is_ceil_and_free_returns_everything():
    kv = KVCacheManager(BS, 10)
    req = make_request("a", list(range(9)))
    assert kv.allocate_slots(req, 9)
    assert len(kv.get_block_ids("a")) == 3  # ceil(9 / 4)
    req.num_computed_tokens = 9
    assert kv.allocate_slots(req, 3)  # 12 tokens still fit 3 blocks
    assert len(kv.get_block_ids("a")) == 3
    assert kv.allocate_slots(req, 4)  # 13 tokens: a 4th block
    assert len(kv.get_block_ids("a")) == 4 and kv.num_free_blocks == 5
    kv.free(req)
    assert kv.num_free_blocks == 9 and kv.get_block_ids("a") == []


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(BS, 4)  # 3 usable
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = make_request("b", list(range(100, 108)))
    assert not kv.allocate_slots(b, 8)
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1


def test_shared_prefix_hit_and_last_token_recomputed():
    kv = KVCacheManager(BS, 32)
    prefix = list(range(1, 9))  # two full blocks
    a = make_request("a", prefix + [50, 51, 52])
    assert _prefill(kv, a) == 0
    a_blocks = kv.get_block_ids("a")
    b = make_request("b", prefix + [60, 61])
    assert _prefill(kv, b) == 8
    assert kv.get_block_ids("b")[:2] == a_blocks[:2]  # shared physical blocks
    assert kv.pool.blocks[a_blocks[0]].ref_cnt == 2
    # A prompt that is exactly the cached 8 tokens: the last block holds the last token, so only 1 block hits.
    c = make_request("c", list(prefix))
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 4 and [h.block_id for h in hits] == a_blocks[:1]
    # 9 tokens whose first 8 are cached: both blocks hit, token 8 is computed.
    d = make_request("d", prefix + [99])
    assert kv.get_computed_blocks(d)[1] == 8


def test_hit_stops_at_first_mismatch_and_needs_whole_blocks():
    kv = KVCacheManager(BS, 32)
    _prefill(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]))
    # Second block differs in one token: only the first block hits, even though the third block matches.
    b = make_request("b", [1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13])
    assert kv.get_computed_blocks(b)[1] == 4
    # A partial first block never hits.
    assert kv.get_computed_blocks(make_request("c", [1, 2, 3, 7, 7]))[1] == 0


def test_hash_collision_is_a_miss():
    """With a hash that ignores token ids every block collides; the stored ids decide."""
    kv = KVCacheManager(BS, 32, hash_fn=lambda parent, tokens, extra: 42 if parent is None else 43)
    _prefill(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(other) == ([], 0)
    same = make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert kv.get_computed_blocks(same)[1] == 8


def test_no_hits_when_disabled_or_prompt_logprobs():
    kv = KVCacheManager(BS, 32, enable_prefix_caching=False)
    _prefill(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    assert kv.pool.num_cached_blocks == 0

    kv = KVCacheManager(BS, 32)
    _prefill(kv, make_request("a", list(range(9))))
    assert kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1))[1] == 0
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 8


def test_freed_cached_blocks_hit_until_evicted():
    kv = KVCacheManager(BS, 5)  # 4 usable
    a = make_request("a", list(range(9)))  # 3 blocks, 2 full (cached)
    _prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2
    # Free list now: a's uncached tail block and the never-used block 4 at the front, then a's block 1
    # (freed before block 0, so least recently freed), then a's block 0. A 3-block request evicts only one.
    b = make_request("b", list(range(100, 112)))
    assert kv.allocate_slots(b, 12)
    assert kv.pool.num_cached_blocks == 1 and kv.pool.num_evictions == 1
    c = make_request("c", list(range(9)))
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 4 and kv.num_free_blocks == 1 and hits[0].ref_cnt == 0
    # The free cached hit block counts against the free list: 1 hit + 2 new blocks > 1 free.
    assert not kv.allocate_slots(c, 9 - num_hit, hits)
    assert hits[0].ref_cnt == 0 and kv.num_free_blocks == 1 and kv.get_block_ids("c") == []
    kv.free(b)
    assert kv.allocate_slots(c, 9 - num_hit, hits)
    assert kv.get_block_ids("c")[0] == hits[0].block_id and hits[0].ref_cnt == 1
    assert kv.num_free_blocks == 1
