"""Hit-rate bounds a routing policy is judged against, computed from the trace alone (no timing).

Two references:

- **pooled LRU**: one LRU of ``replicas x capacity`` blocks serving every request. It counts a shared prefix
  once, however many replicas its readers are spread over.
- **replicated**: each replica's cache is its own, and no replica may serve more than ``imbalance`` x the
  mean number of requests. A block read by ``s`` requests is then computed on at least
  ``ceil(s / cap)`` replicas, where ``cap`` is the most requests one replica may take; summed over blocks
  that is a lower bound on the misses of *any* placement (exact with unbounded caches up to the packing
  gap below). The ceiling reported is that bound, never above the pooled LRU's hit rate (the capacity
  reference). From below, an explicit placement any offline router could make: requests in trie order
  (sorted by their block chains, so every prefix's readers are contiguous) cut into consecutive groups,
  one per replica, each replayed through its own LRU of ``capacity`` blocks. The optimum lies between the
  two; ``tests/test_cache_bounds.py`` checks both against brute force on small traces.

On a real cluster's run (``kvmesh bench run``), ``pooled_bound`` is the pooled LRU's hit rate by tokens over
the prompts and replies as sent and received, counted as the engine counts hits.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.router.prefix_lru import PrefixLRU

Row = tuple[float, Sequence[bytes], int]
"""A simulator trace row: arrival seconds, the request's block chain, its decode steps."""

BLOCK_TOKENS = 16


def lru_hit_rate(rows: Sequence[Row], capacity: int | None, prefill_tok_s: float) -> tuple[float, float]:
    """Block hit rate and prefill seconds of the trace on one LRU of ``capacity`` blocks (None: infinite)."""
    cache = PrefixLRU(capacity)
    hit = total = 0
    for _, chain, _ in rows:
        hit += cache.leading(chain)
        total += len(chain)
        cache.touch(chain)
    return hit / total, (total - hit) * BLOCK_TOKENS / prefill_tok_s


def per_replica_cap(requests: int, replicas: int, imbalance: float) -> int:
    """The most requests one replica may serve when the busiest may take ``imbalance`` x the mean (at
    least the even share, rounded up: someone must take the remainder)."""
    if imbalance < 1:
        raise ValueError("imbalance must be >= 1 (the busiest replica serves at least the mean)")
    mean = requests / replicas
    return max(math.ceil(mean - 1e-9), math.floor(imbalance * mean + 1e-9))


def replication_misses(rows: Sequence[Row], cap: int) -> int:
    """A lower bound on the blocks any placement computes when no replica serves more than ``cap`` requests:
    each block once on every replica its readers must be spread over (``ceil(readers / cap)``)."""
    readers = Counter(h for _, chain, _ in rows for h in chain)
    return sum(-(-s // cap) for s in readers.values())


def packed_placement(rows: Sequence[Row], replicas: int, group: int) -> list[int]:
    """Per request, a replica: requests sorted by their chains (trie order) in consecutive runs of ``group``,
    so that each prefix's readers share as few replicas as the group size allows."""
    if group * replicas < len(rows):
        raise ValueError(f"{replicas} groups of {group} cannot hold {len(rows)} requests")
    order = sorted(range(len(rows)), key=lambda i: tuple(rows[i][1]))
    placement = [0] * len(rows)
    for rank, i in enumerate(order):
        placement[i] = rank // group
    return placement


def placed_hit_rate(rows: Sequence[Row], placement: Sequence[int], replicas: int, capacity: int | None) -> float:
    """The trace replayed in order with each request on its ``placement``, every replica its own LRU."""
    caches = [PrefixLRU(capacity) for _ in range(replicas)]
    hit = total = 0
    for (_, chain, _), r in zip(rows, placement, strict=True):
        hit += caches[r].leading(chain)
        total += len(chain)
        caches[r].touch(chain)
    return hit / total


@dataclass(frozen=True)
class ReplicatedBound:
    """The best hit rate of per-replica caches under a load cap, bounded from both sides."""

    ceiling: float
    """No router beats it where replication binds; where capacity binds, the pooled LRU's rate."""
    placed: float
    """What the trie-order placement reaches: some router reaches at least this."""
    cap: int
    """Requests one replica may serve."""
    imbalance: float


def replicated_bound(
    rows: Sequence[Row], replicas: int, capacity: int | None, imbalance: float, pooled: float
) -> ReplicatedBound:
    """Bounds on the hit rate of ``replicas`` caches of ``capacity`` blocks each when the busiest replica may
    serve ``imbalance`` x the mean; ``pooled`` is the pooled LRU's hit rate of the same fleet."""
    cap = per_replica_cap(len(rows), replicas, imbalance)
    total = sum(len(chain) for _, chain, _ in rows)
    # Larger groups split fewer prefixes; even ones use every replica's cache: take the better.
    even = per_replica_cap(len(rows), replicas, 1.0)
    placed = max(
        placed_hit_rate(rows, packed_placement(rows, replicas, group), replicas, capacity) for group in {even, cap}
    )
    # The pooled LRU is a reference, not a proof (an LRU is not an optimal cache): a placement beating it
    # raises the ceiling to what was placed.
    ceiling = max(min(1.0 - replication_misses(rows, cap) / total, pooled), placed)
    return ReplicatedBound(ceiling, placed, cap, imbalance)


def _prefix_keys(ids: list[int], block_size: int, blocks: int) -> list[tuple[int, ...]]:
    """The first ``blocks`` full blocks of ``ids``, each keyed by its whole prefix, as the hash chain keys it."""
    return [tuple(ids[: (j + 1) * block_size]) for j in range(blocks)]


def pooled_bound(
    sent: list[tuple[list[int], list[int]]],
    block_size: int,
    capacity_blocks: int,
    prefill: list[tuple[list[int], list[int]]] = (),
) -> float:
    """Hit rate by tokens of one pooled LRU over (prompt ids, reply ids) in send order, counted as the
    engine counts hits (full blocks only, the last prompt token always recomputed). ``prefill`` (the
    warm-up's requests) enters the cache first without being counted, as it does on the replicas."""
    lru = PrefixLRU(capacity_blocks)
    hit = total = 0
    for k, (prompt, reply) in enumerate([*prefill, *sent]):
        n = lru.leading(_prefix_keys(prompt, block_size, (len(prompt) - 1) // block_size))
        if k >= len(prefill):
            hit += n * block_size
            total += len(prompt)
        seq = prompt + reply
        lru.touch(_prefix_keys(seq, block_size, len(seq) // block_size))
    return hit / total if total else 0.0
