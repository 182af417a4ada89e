"""An LRU of prefix blocks that evicts a chain's tail before its head, as the engine's block pool does.

A cached block is useful only while every block before it is cached too (a hit is the leading run of a
prompt's chain). The engine frees a finished request's blocks tail-first (``replica/block_pool.py``), so
under pressure a prefix shrinks from its end and its shared beginning stays. Refreshing a chain head-first
instead would make its head the oldest entry: the first eviction would cut the whole chain off while its
now unreachable tail kept the space. The simulator's replicas, the pooled-LRU bounds and the approximate
tree baseline all model a prefix cache with this one class.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable, Sequence


def leading(chain: Iterable[Hashable], held: Container[Hashable]) -> int:
    """How many leading blocks of ``chain`` are in ``held``: a prefix hit stops at the first missing block."""
    n = 0
    for key in chain:
        if key not in held:
            break
        n += 1
    return n


class PrefixLRU:
    """Block keys in least- to most-recently used order; ``capacity`` None: unbounded."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def leading(self, chain: Sequence[Hashable]) -> int:
        """How many leading blocks of ``chain`` are cached."""
        return leading(chain, self._keys)

    def touch(self, chain: Sequence[Hashable]) -> list[Hashable]:
        """Cache ``chain`` as just used, its head the most recent, and return what that evicted (oldest
        first)."""
        keys = self._keys
        for key in reversed(chain):
            keys[key] = None
            keys.move_to_end(key)
        evicted = []
        if self.capacity is not None:
            while len(keys) > self.capacity:
                evicted.append(keys.popitem(last=False)[0])
        return evicted

    def discard(self, key: Hashable) -> None:
        self._keys.pop(key, None)
