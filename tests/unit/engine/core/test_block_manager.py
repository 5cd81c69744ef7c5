"""Unit tests of the paged KV block manager: ref counts, LRU free list, prefix cache, stats."""

from __future__ import annotations

import pytest

import stages.engine.core.block_manager as block_manager_module
from stages.engine.core.block_manager import BlockManager
from stages.engine.core.request import Request
from stages.transport.messages import SamplingParams
from tests.fakes import check_block_manager

BS = 4


def req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams())


def computed(bm: BlockManager, r: Request, cached: list[int] | None = None) -> Request:
    """Admit ``r`` (with its prefix hits) for all its tokens, mark them computed and cache its blocks."""
    cached = bm.find_cached_prefix(r) if cached is None else cached
    r.num_computed_tokens = len(cached) * bm.block_size
    assert bm.allocate_slots(r, r.num_tokens - r.num_computed_tokens, cached)
    r.num_computed_tokens = r.num_tokens
    bm.cache_full_blocks(r)
    return r


def snapshot(bm: BlockManager, *reqs: Request):
    return ([(b.ref_count, b.block_hash, b.token_ids) for b in bm.blocks], list(bm._free),
            dict(bm._hash_to_block), [list(r.block_table) for r in reqs])


# -- allocation and ref counts ------------------------------------------------------------------
def test_allocate_and_free_ref_counts():
    bm = BlockManager(8, BS)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    r = req(range(10))
    assert bm.allocate_slots(r, 10)
    assert len(r.block_table) == 3 == bm.blocks_needed(10)
    assert all(bm.blocks[b].ref_count == 1 for b in r.block_table)
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    check_block_manager(bm, [r])
    # Growing by tokens that still fit in the last block takes no new block.
    r.num_computed_tokens = 10
    assert bm.allocate_slots(r, 2)
    assert len(r.block_table) == 3
    assert bm.allocate_slots(r, 3)
    assert len(r.block_table) == 4 and bm.num_free_blocks == 4
    table = list(r.block_table)
    bm.free(r)
    assert r.block_table == [] and r.chain_blocks == []
    assert all(bm.blocks[b].ref_count == 0 for b in table)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    check_block_manager(bm, [])


def test_double_free_raises():
    bm = BlockManager(4, BS)
    r = req(range(6))
    assert bm.allocate_slots(r, 6)
    table = list(r.block_table)
    bm.free(r)
    r.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(r)


def test_shared_blocks_are_freed_only_by_their_last_holder():
    bm = BlockManager(8, BS)
    a = computed(bm, req([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    b = req([1, 2, 3, 4, 5, 6, 7, 8, 0, 0], "b")
    hit = bm.find_cached_prefix(b)
    assert hit == a.block_table[:2]
    computed(bm, b, hit)
    assert [bm.blocks[x].ref_count for x in hit] == [2, 2]
    assert bm.num_free_blocks == 8 - 3 - 1
    check_block_manager(bm, [a, b])
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in hit] == [1, 1]
    assert all(x not in bm._free for x in hit)
    assert bm.num_free_blocks == 8 - 3
    check_block_manager(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 8
    check_block_manager(bm, [])


def test_allocate_short_returns_false_and_changes_nothing():
    bm = BlockManager(4, BS)
    a = req(range(9), "a")
    assert bm.allocate_slots(a, 9)  # 3 blocks
    b = req(range(8), "b")
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(b, 8)  # needs 2, 1 free
    assert snapshot(bm, a, b) == before
    assert bm.allocate_slots(b, 4)  # exactly the last block
    assert bm.num_free_blocks == 0
    a.num_computed_tokens = 9
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(a, 4)
    assert snapshot(bm, a, b) == before


def test_allocate_short_with_reclaimable_hits_changes_nothing():
    """Hits sitting in the free list count against the free blocks they occupy."""
    bm = BlockManager(4, BS)
    a = computed(bm, req([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    bm.free(a)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    b = req([1, 2, 3, 4, 5, 6, 7, 8] + list(range(10, 19)), "b")  # 17 tokens: 5 blocks
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 2
    b.num_computed_tokens = 8
    before = snapshot(bm, b)
    assert not bm.allocate_slots(b, 9, hit)
    assert snapshot(bm, b) == before
    assert all(bm.blocks[x].ref_count == 0 for x in hit)
    # 16 tokens: 2 hits + 2 new blocks = the whole pool, and the hits are not reclaimed for it.
    c = req([1, 2, 3, 4, 5, 6, 7, 8] + list(range(10, 18)), "c")
    hit = bm.find_cached_prefix(c)
    c.num_computed_tokens = 8
    assert bm.allocate_slots(c, 8, hit)
    assert c.block_table[:2] == hit and bm.num_free_blocks == 0
    assert bm.num_cached_blocks == 2
    check_block_manager(bm, [c])


# -- free list order ----------------------------------------------------------------------------
def test_free_list_is_lru_and_requests_free_tail_first():
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    a = req(range(12), "a")
    assert bm.allocate_slots(a, 12)
    assert a.block_table == [0, 1, 2]
    b = req(range(4), "b")
    assert bm.allocate_slots(b, 4)
    assert b.block_table == [3]
    bm.free(a)  # frees 2, 1, 0 in that order
    bm.free(b)  # then 3
    assert list(bm._free) == [4, 5, 2, 1, 0, 3]
    c = req(range(20), "c")
    assert bm.allocate_slots(c, 20)
    assert c.block_table == [4, 5, 2, 1, 0]


def test_prompt_head_survives_longest():
    """Reclaiming memory takes the least recently freed block, so a freed prompt loses its tail first."""
    bm = BlockManager(4, BS)
    a = computed(bm, req(range(13), "a"))  # 3 full cached blocks + 1
    head = a.block_table[0]
    bm.free(a)
    assert bm.num_cached_blocks == 3
    b = req([40] * 12, "b")
    assert bm.allocate_slots(b, 12)  # reclaims 3 of the 4 blocks
    assert head not in b.block_table
    assert bm.num_cached_blocks == 1
    again = req(list(range(13)), "again")
    assert bm.find_cached_prefix(again) == [head]


# -- prefix cache -------------------------------------------------------------------------------
def test_prefix_hits_follow_chained_hashes():
    bm = BlockManager(16, BS)
    a = computed(bm, req(list(range(12)) + [99], "a"))
    assert bm.num_cached_blocks == 3
    same_two = req(list(range(8)) + [7, 7, 7, 7, 7], "b")
    assert bm.find_cached_prefix(same_two) == a.block_table[:2]
    # Same second and third blocks but a different first one: chaining makes them different blocks.
    other_head = req([9, 9, 9, 9] + list(range(4, 12)) + [1], "c")
    assert bm.find_cached_prefix(other_head) == []
    # A hit is a prefix: a mismatch in block 1 stops it even if block 2 would match.
    gap = req([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 5], "d")
    assert bm.find_cached_prefix(gap) == a.block_table[:1]


def test_hit_never_covers_the_last_token():
    bm = BlockManager(16, BS)
    a = computed(bm, req(list(range(12)) + [99], "a"))
    exact = req(list(range(12)), "exact")  # exactly 3 blocks
    assert bm.find_cached_prefix(exact) == a.block_table[:2]
    one_more = req(list(range(12)) + [5], "more")
    assert bm.find_cached_prefix(one_more) == a.block_table[:3]
    single = req([0, 1, 2, 3], "single")
    assert bm.find_cached_prefix(single) == []


def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(16, BS)
    a = req(range(10), "a")
    assert bm.allocate_slots(a, 10)
    a.num_computed_tokens = 7  # one full computed block; block 1 only partly computed
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 1
    assert bm.blocks[a.block_table[0]].token_ids == (0, 1, 2, 3)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert bm.num_cached_blocks == 2
    assert bm.blocks[a.block_table[2]].block_hash is None  # partial block: never cached
    check_block_manager(bm, [a])


def test_hash_collision_never_serves_wrong_blocks(monkeypatch):
    """With every chained hash equal, token-id confirmation must stop every wrong hit."""
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(16, BS)
    a = computed(bm, req([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    assert bm.num_cached_blocks == 1  # one hash: only the first block could register
    assert bm.find_cached_prefix(req([5, 6, 7, 8, 1, 2, 3, 4, 0], "b")) == []
    # Block 1 has the same tokens as the cached block 0, but a different prefix and position.
    hit = bm.find_cached_prefix(req([1, 2, 3, 4, 1, 2, 3, 4, 0], "c"))
    assert hit == a.block_table[:1]


def test_collision_ignoring_the_parent_never_serves_wrong_blocks(monkeypatch):
    """A collision on the chain (same block tokens, different prefix) must not be served."""
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: hash(tokens))
    bm = BlockManager(16, BS)
    a = computed(bm, req([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    assert bm.num_cached_blocks == 2
    # Block 0 of ``b`` equals block 1 of ``a``: a hit would serve position 4..7 K/V at 0..3.
    assert bm.find_cached_prefix(req([5, 6, 7, 8, 0], "b")) == []
    assert bm.find_cached_prefix(req([9, 9, 9, 9, 5, 6, 7, 8, 0], "c")) == []
    # Genuine hits are still served.
    assert bm.find_cached_prefix(req([1, 2, 3, 4, 5, 6, 7, 8, 0], "d")) == a.block_table[:2]


def test_cached_blocks_reclaimed_only_when_needed_then_leave_the_cache():
    bm = BlockManager(6, BS)
    a = computed(bm, req(list(range(12)) + [50], "a"))  # blocks 0..3, three cached
    cached_ids = a.block_table[:3]
    bm.free(a)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 6
    # Two never-used blocks are free: they go first and the cache is untouched.
    b = req([30] * 8, "b")
    assert bm.allocate_slots(b, 8)
    assert set(b.block_table) == {4, 5}
    assert bm.num_cached_blocks == 3
    probe = req(list(range(12)) + [1], "probe")
    assert bm.find_cached_prefix(probe) == cached_ids
    # Now memory is needed: the uncached tail block (3) goes, then the cached tail (2).
    c = req([31] * 8, "c")
    assert bm.allocate_slots(c, 8)
    assert c.block_table == [3, cached_ids[2]]
    assert bm.num_cached_blocks == 2
    assert bm.blocks[cached_ids[2]].block_hash is None and bm.blocks[cached_ids[2]].token_ids == ()
    assert bm.find_cached_prefix(req(list(range(12)) + [1], "probe2")) == cached_ids[:2]
    check_block_manager(bm, [b, c])


def test_registered_hash_is_not_duplicated():
    """Two requests that computed the same block separately: only the first copy is registered."""
    bm = BlockManager(8, BS)
    a = req([1, 2, 3, 4, 5], "a")
    b = req([1, 2, 3, 4, 6], "b")
    for r in (a, b):  # both admitted before either computed anything: no hits
        assert bm.allocate_slots(r, 5)
    for r in (a, b):
        r.num_computed_tokens = 5
        bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 1
    assert bm.blocks[b.block_table[0]].block_hash is None
    bm.free(a)
    bm.free(b)
    check_block_manager(bm, [])


def test_a_prefix_computed_twice_keeps_what_follows_findable():
    """Two prompts sharing a first block, both scheduled before either cached it: the second's
    copy of that block is not registered, and its later blocks must still be found after the
    registered copy (a conversation's history after a shared system prompt)."""
    bm = BlockManager(16, BS)
    a = req([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    b = req([1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27, 28], "b")
    for r in (a, b):
        assert bm.allocate_slots(r, r.num_tokens)
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
    assert bm.blocks[b.block_table[0]].block_hash is None  # a's copy is the registered one
    probe = req([1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27, 0], "probe")
    assert bm.find_cached_prefix(probe) == [a.block_table[0], *b.block_table[1:3]]
    check_block_manager(bm, [a, b])


def test_a_shared_block_at_another_position_is_never_a_parent(monkeypatch):
    """With hashes that ignore the prefix, a block registered after a same-tokens block at another
    position must not be served after the real one."""
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda parent, tokens: hash(tokens))
    bm = BlockManager(32, BS)
    computed(bm, req([1, 2, 3, 4, 5, 6, 7, 8, 0], "a"))  # (5, 6, 7, 8) registered at position 1
    computed(bm, req([5, 6, 7, 8, 5, 6, 7, 8, 9, 9, 9, 9, 0], "w"))  # (9, 9, 9, 9) after it, at 2
    hit = bm.find_cached_prefix(req([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 0], "q"))
    assert len(hit) == 2, "w's third block was computed after another prefix"


def test_reset_prefix_cache():
    bm = BlockManager(8, BS)
    a = computed(bm, req(range(9), "a"))
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(req(range(9), "b")) == []
    check_block_manager(bm, [a])


# -- stats ---------------------------------------------------------------------------------------
def test_stats_count_tokens_via_record_lookup():
    bm = BlockManager(8, BS)
    a = computed(bm, req(range(9), "a"))
    b = req(list(range(8)) + [3, 3], "b")
    hit = bm.find_cached_prefix(b)
    assert bm.stats.queries == 0 and bm.stats.hits == 0  # finding is not counting
    bm.record_lookup(b.num_tokens, len(hit) * BS)
    assert (bm.stats.queries, bm.stats.hits) == (10, 8)
    bm.record_lookup(9, 0)
    assert (bm.stats.queries, bm.stats.hits) == (19, 8)
    check_block_manager(bm, [a])


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    computed(bm, req(range(9), "a"))
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(req(range(9), "b")) == []
    bm.record_lookup(9, 0)
    assert (bm.stats.queries, bm.stats.hits) == (0, 0)


def test_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)
