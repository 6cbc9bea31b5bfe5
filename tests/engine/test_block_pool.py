"""BlockPool: reference counts, the free queue's order, the prefix cache's hash map."""

from __future__ import annotations

import pytest

from quire.engine.block_pool import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_and_free_count_references():
    pool = BlockPool(4, enable_caching=True)
    a = pool.allocate(3)
    assert [b.ref_cnt for b in a] == [1, 1, 1] and pool.num_used_blocks == 3
    pool.touch(a[:1])
    pool.free(a)
    assert a[0].ref_cnt == 1 and pool.num_used_blocks == 1, "a shared block outlived a free"
    pool.free(a[:1])
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 4


def test_asking_for_more_than_free_names_the_numbers():
    pool = BlockPool(2, enable_caching=False)
    with pytest.raises(RuntimeError, match="asked for 3 KV blocks, 2 free"):
        pool.allocate(3)


def test_freeing_twice_is_caught():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="freed more often than it was taken"):
        pool.free([b])


def test_uncached_blocks_go_out_before_cached_ones_and_cached_ones_in_lru_order():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks[:3]):
        pool.cache_block(b, block_hash=100 + i)
    pool.free([blocks[1]])  # cached, freed first: evicted first
    pool.free([blocks[0]])
    pool.free([blocks[3]])  # uncached: handed out before any cached block
    pool.free([blocks[2]])
    assert pool.num_cached_free == 3
    order = ids(pool.allocate(4))
    assert order == [3, 1, 0, 2], f"eviction order {order}: uncached first, then LRU"
    assert pool.num_evictions == 3 and pool.get_cached_block(100) is None


def test_a_hit_revives_a_cached_free_block():
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 7)
    pool.free([b])
    assert pool.get_cached_block(7) is b and pool.num_free_blocks == 2
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1 and pool.num_cached_free == 0


def test_caching_off_forgets_a_hash_when_the_last_owner_frees():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 7)  # registered while held: siblings may share it
    assert pool.get_cached_block(7) is b
    pool.free([b])
    assert pool.get_cached_block(7) is None and b.block_hash is None
    assert pool.num_cached_free == 0


def test_uncache_and_reset_forget_contents():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, i)
    pool.free(blocks[:2])
    pool.uncache([blocks[0]])
    assert pool.get_cached_block(0) is None and pool.num_cached_free == 1
    pool.reset_prefix_cache()
    assert pool.num_cached_free == 0 and all(b.block_hash is None for b in blocks)
    assert ids(pool.allocate(1)) == [1], "a block whose hash was forgotten goes out first"


@pytest.mark.parametrize("collecting", [True, False])
def test_building_a_pool_leaves_the_garbage_collector_as_it_was(collecting):
    # the pool pauses the collector while it makes its blocks (a large cache's start-up)
    import gc
    was = gc.isenabled()
    try:
        (gc.enable if collecting else gc.disable)()
        pool = BlockPool(1000, enable_caching=True)
        assert gc.isenabled() is collecting
        assert pool.num_free_blocks == 1000 and [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    finally:
        (gc.enable if was else gc.disable)()
