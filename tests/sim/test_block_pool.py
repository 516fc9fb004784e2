"""The pure block pool: reference counts, the free queue's LRU order, the prefix cache."""

from __future__ import annotations

import pytest

from gateway.sim.block_pool import BlockPool, hash_block

H1 = hash_block(None, [1, 2, 3, 4])
H2 = hash_block(H1, [5, 6, 7, 8])
H3 = hash_block(H2, [9, 10, 11, 12])


def test_hashes_chain_from_the_start_of_the_sequence() -> None:
    assert hash_block(None, [1, 2, 3, 4]) == H1  # deterministic
    # The same tokens after a different parent are a different block.
    assert hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8]) != H2
    assert hash_block(None, [1, 2, 3, 4], ["cache_salt:a"]) != H1
    assert hash_block(None, [1, 2, 3, 4], ["cache_salt:a"]) != hash_block(
        None, [1, 2, 3, 4], ["cache_salt:b"]
    )
    # Token boundaries are part of the encoding: [1, 23] is not [12, 3].
    assert hash_block(None, [1, 23]) != hash_block(None, [12, 3])


def test_allocation_takes_from_the_head_and_freeing_appends_to_the_tail() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.free_queue() == (1, 2, 3, 4, 5)
    a = pool.allocate(2)
    assert a == [1, 2] and pool.num_used == 2 and pool.num_free == 3
    pool.free(reversed(a))  # a request's tail block goes first
    assert pool.free_queue() == (3, 4, 5, 2, 1)
    assert pool.allocate(3) == [3, 4, 5]
    pool.audit()


def test_eviction_is_least_recently_freed_first_and_only_when_a_block_is_needed() -> None:
    pool = BlockPool(3, enable_caching=True)
    first, second, third = pool.allocate(3)
    for block_id, block_hash in ((first, H1), (second, H2), (third, H3)):
        pool.cache(block_id, block_hash)
    pool.free([first])
    pool.free([second])
    pool.free([third])
    # Free but still cached: every block can be hit.
    assert pool.num_free == 3 and pool.num_evictable == 3 and pool.num_used == 0
    assert pool.longest_hit([H1, H2, H3]) == [first, second, third]
    # One new block evicts the least recently freed one, and only it.
    (taken,) = pool.allocate(1)
    assert taken == first and pool.block_hash(first) is None
    assert pool.longest_hit([H1, H2]) == []  # the chain is broken at its first block
    assert pool.num_cached == 2 and pool.num_evictable == 2
    pool.audit()


def test_touch_shares_a_cached_block_and_it_stays_used_until_every_holder_frees_it() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.allocate(1)
    pool.cache(block, H1)
    pool.touch([block])  # a second request hits it
    assert pool.ref_count(block) == 2 and pool.num_used == 1
    pool.free([block])
    assert pool.ref_count(block) == 1 and block not in pool.free_queue()
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.free_queue()[-1] == block
    # Touching a free cached block takes it out of the free queue.
    pool.touch([block])
    assert block not in pool.free_queue() and pool.num_used == 1
    pool.audit()


def test_a_hash_held_by_two_blocks_hits_the_first_cached() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache(a, H1)
    pool.cache(b, H1)  # the same content computed twice (vLLM does not de-duplicate)
    assert pool.longest_hit([H1]) == [a]
    pool.free([a])
    pool.allocate(3)  # evicts a (head of the free queue is 3, 4, then a)
    assert pool.longest_hit([H1]) == [b]
    pool.audit()


def test_longest_hit_stops_at_the_first_miss() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache(a, H1)
    pool.cache(b, H3)  # not H2: the chain breaks after the first block
    assert pool.longest_hit([H1, H2, H3]) == [a]


def test_without_caching_nothing_is_kept_or_found() -> None:
    pool = BlockPool(3, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.cache(block, H1)
    assert pool.block_hash(block) is None and pool.longest_hit([H1]) == []
    pool.free([block])
    assert pool.num_free == 3 and pool.num_cached == 0


def test_misuse_is_refused() -> None:
    pool = BlockPool(2, enable_caching=True)
    with pytest.raises(ValueError, match="cannot allocate 3"):
        pool.allocate(3)
    (block,) = pool.allocate(1)
    pool.cache(block, H1)
    with pytest.raises(ValueError, match="already cached"):
        pool.cache(block, H2)
    pool.free([block])
    with pytest.raises(ValueError, match="not referenced"):
        pool.free([block])
