import random

from kvmesh.replica.block_pool import BlockPool
from kvmesh.router.prefix_lru import PrefixLRU


def serve_on_pool(pool: BlockPool, chain: list[int]) -> int:
    """One request through the engine's block pool, alone: reuse its cached prefix, compute the rest,
    publish every block, finish (freeing tail-first, as the engine does). Returns the prefix hit."""
    hit = []
    for h in chain:
        block = pool.lookup(h)
        if block is None:
            break
        hit.append(block)
    pool.touch(hit)
    new = pool.allocate(len(chain) - len(hit))
    blocks = hit + new
    for i in range(len(hit), len(chain)):
        pool.cache_block(blocks[i], chain[i], chain[i - 1] if i else None)
    pool.free(reversed(blocks))
    return len(hit)


def test_prefix_lru_hits_what_the_engines_block_pool_hits():
    # Conversations that grow turn by turn over a few shared system prompts, in a pool far smaller than
    # all of them: the simulator's cache must keep and lose the same prefixes as the engine's.
    rng = random.Random(0)
    capacity = 24
    pool, lru = BlockPool(capacity), PrefixLRU(capacity)
    convs = [[1000 * s + 1, 1000 * s + 2] for s in range(3)]  # system prompts of 2 blocks
    convs = [list(convs[rng.randrange(3)]) for _ in range(12)]
    hits = []
    for k in range(400):
        c = rng.randrange(len(convs))
        chain = convs[c]
        chain.extend(rng.randrange(1 << 30) for _ in range(rng.randint(1, 3)))
        if len(chain) > 10:  # conversation over: a new one on a shared prompt
            convs[c] = chain = chain[:2]
            chain.append(rng.randrange(1 << 30))
        expected = serve_on_pool(pool, chain)
        assert lru.leading(chain) == expected, f"request {k}"
        lru.touch(chain)
        hits.append(expected)
        pool.check_integrity()
    assert len(lru) == capacity
    assert 0 < sum(h > 2 for h in hits) < len(hits)  # histories were both kept and lost


def test_pressure_shortens_a_prefix_from_its_end():
    lru = PrefixLRU(3)
    assert lru.touch([1, 2, 3, 4]) == [4]  # the tail goes first: the head stays reachable
    assert lru.leading([1, 2, 3, 4]) == 3
    assert lru.touch([5]) == [3]
    assert lru.leading([1, 2, 3]) == 2 and lru.leading([5]) == 1
    unbounded = PrefixLRU()
    unbounded.touch(range(1000))
    assert len(unbounded) == 1000
