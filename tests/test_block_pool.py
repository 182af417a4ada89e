import pytest

from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.replica.block_pool import BlockPool, OutOfBlocksError
from kvmesh.replica.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

H = hash_blocks(list(range(16 * 8)), 16, model_seed("t"))


def cache(pool, blocks, hashes):
    for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
        pool.cache_block(b, h, hashes[i - 1] if i else None)


def test_fresh_pool_hands_out_distinct_blocks():
    pool = BlockPool(8)
    blocks = pool.allocate(8)
    assert len({b.block_id for b in blocks}) == 8
    assert pool.num_free == 0 and pool.usage == 1.0
    pool.check_integrity()


def test_shared_prefix_is_reused_with_refcount_two_and_freed_by_refcount():
    pool = BlockPool(8)
    a = pool.allocate(2)
    cache(pool, a, H[:2])
    hit = [pool.lookup(h) for h in H[:2]]
    assert hit == a
    pool.touch(hit)
    assert [b.ref_count for b in a] == [2, 2]
    pool.free(reversed(a))
    assert [b.ref_count for b in a] == [1, 1] and pool.num_cached_free == 0
    pool.free(reversed(hit))
    assert pool.num_cached_free == 2 and pool.num_free == 8
    pool.check_integrity()


def test_eviction_is_lru_with_tails_first():
    pool = BlockPool(6)
    first = pool.allocate(3)
    cache(pool, first, H[:3])
    pool.free(reversed(first))  # request finished: tail goes into the queue first
    second = pool.allocate(3)  # takes the 3 empty blocks, evicts nothing
    assert pool.num_cached_free == 3 and not ({b.block_id for b in second} & {b.block_id for b in first})
    pool.take_events()
    evicted = pool.allocate(1)[0]
    assert evicted is first[2]  # the tail of the oldest finished request
    assert pool.take_events() == [BlockRemoved(H[2])]
    assert pool.lookup(H[0]) is first[0] and pool.lookup(H[2]) is None
    pool.check_integrity()


def test_touching_a_cached_block_refreshes_nothing_but_protects_it():
    pool = BlockPool(2)
    a = pool.allocate(2)
    cache(pool, a, H[:2])
    pool.free(reversed(a))
    pool.touch([a[1]])  # a prefix hit pins it: it leaves the free queue
    assert pool.allocate(1)[0] is a[0]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_reused_evicted_block_loses_its_hash():
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    cache(pool, [b], H[:1])
    pool.free([b])
    (again,) = pool.allocate(1)
    assert again is b and b.block_hash is None and pool.lookup(H[0]) is None
    pool.check_integrity()


def test_failed_allocation_has_no_side_effects():
    pool = BlockPool(4)
    a = pool.allocate(2)
    cache(pool, a[:1], H[:1])
    pool.free(a[:1])
    before = (pool.num_free, pool.num_cached_free, [b.ref_count for b in pool.blocks], pool.lookup(H[0]))
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)
    assert before == (pool.num_free, pool.num_cached_free, [b.ref_count for b in pool.blocks], pool.lookup(H[0]))
    pool.check_integrity()


def test_same_content_cached_twice_stays_reachable_after_one_copy_is_evicted():
    pool = BlockPool(3)
    x, y = pool.allocate(2)
    pool.cache_block(x, H[0], None)
    pool.cache_block(y, H[0], None)  # a second request computed the same block before the first cached it
    assert pool.take_events() == [BlockStored(H[0], None)]  # the index hears about the hash once
    pool.free([x])
    pool.free([y])
    pool.allocate(2)  # one empty block, then evicts x (older)
    assert pool.lookup(H[0]) is y and pool.take_events() == []
    pool.allocate(1)
    assert pool.lookup(H[0]) is None and pool.take_events() == [BlockRemoved(H[0])]
    pool.check_integrity()


def test_salt_isolates():
    seed = model_seed("t")
    from kvmesh.core.hashing import first_block_extra

    pool = BlockPool(4)
    a = pool.allocate(1)
    tokens = list(range(16))
    cache(pool, a, hash_blocks(tokens, 16, seed, first_block_extra("alice")))
    assert pool.lookup(hash_blocks(tokens, 16, seed, first_block_extra("bob"))[0]) is None
    assert pool.lookup(hash_blocks(tokens, 16, seed, first_block_extra("alice"))[0]) is a[0]


def test_reset_refuses_while_blocks_are_in_use():
    pool = BlockPool(4)
    a = pool.allocate(2)
    cache(pool, a, H[:2])
    assert pool.reset() is False and pool.lookup(H[0]) is a[0]
    pool.free(reversed(a))
    pool.take_events()
    assert pool.reset() is True
    assert pool.lookup(H[0]) is None and pool.num_cached_free == 0 and pool.num_free == 4
    assert pool.take_events() == [AllBlocksCleared()]
    pool.check_integrity()


def test_double_free_is_an_error():
    pool = BlockPool(1)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_caching_disabled_never_publishes():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.cache_block(b, H[0], None)
    assert b.block_hash is None and pool.lookup(H[0]) is None and pool.take_events() == []


def test_peak_used_is_the_high_water_mark_of_pinned_blocks():
    pool = BlockPool(8)
    a = pool.allocate(3)
    cache(pool, a, H[:3])
    pool.touch([a[0]])  # a second owner: still 3 blocks pinned
    b = pool.allocate(2)
    pool.free(reversed(b))
    assert pool.peak_used == 5 and pool.num_used == 3
    pool.free(reversed(a))
    pool.reset_peak()
    assert pool.peak_used == 1
    pool.touch([pool.lookup(H[1])])  # a prefix hit pins a cached block again
    assert pool.peak_used == 2
