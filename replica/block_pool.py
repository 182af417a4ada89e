"""The physical KV block pool: reference counts, LRU eviction of cached blocks, and the hash -> block map.

Every block is in exactly one of three states, and ``check_integrity()`` proves it:

- **used**: ``ref_count > 0``, owned by one or more running requests (shared prefixes count once);
- **cached**: ``ref_count == 0`` with a hash, reusable by a prefix hit, evictable in LRU order;
- **empty**: ``ref_count == 0`` with no hash.

Allocation takes empty blocks first and evicts cached ones only when it must, oldest first. Callers free a
request's blocks tail-first, so the tail of a finished request is evicted before its head (heads are the
shared prefixes most likely to be hit again).

Two blocks may hold the same hash (two requests computed the same content before either was cached);
both stay in the map, so evicting one copy leaves the other reachable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.core.hashing import BlockHash
from kvmesh.replica.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventLog


class OutOfBlocksError(RuntimeError):
    """Raised by ``allocate`` when the pool cannot satisfy a request; nothing has changed."""


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class HostTier(Protocol):
    """The tier under the pool (``SwapSpace``, with a host prefix cache): it may keep what the pool evicts."""

    def offload(self, device_id: int, block_hash: BlockHash) -> None:
        """A cached block is being evicted and no other device copy of its hash is left."""

    def drop(self, block_hash: BlockHash) -> None:
        """``block_hash`` got its first device copy: the tier frees its own."""


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        *,
        events: KVEventLog | None = None,
        host_tier: HostTier | None = None,
    ) -> None:
        """``events``: where the pool's KV events go (the engine's log, shared with the other tiers; its own
        when None). ``host_tier``: told of evictions and of first device copies (``HostTier``)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Empty blocks are a stack (any order is fine); cached free blocks are LRU-ordered, oldest first.
        self._empty: list[Block] = list(reversed(self.blocks))
        self._evictable: OrderedDict[int, Block] = OrderedDict()
        self._by_hash: dict[BlockHash, dict[int, Block]] = {}
        self.events = events if events is not None else KVEventLog()
        self._emit = self.events.emit
        self._host_tier = host_tier
        self.peak_used = 0
        """High-water mark of ``num_used`` since creation or ``reset_peak()``: the most a workload pinned,
        including blocks held only within a step (sequences that finish in it free theirs at its end)."""

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty plus evictable cached ones."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_cached_free(self) -> int:
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def fill(self) -> float:
        """Fraction of blocks holding anything (pinned or cached): 1.0 means new blocks now evict cached ones."""
        return 1.0 - len(self._empty) / self.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks pinned by requests (evictable cached blocks count as free)."""
        return self.num_used / self.num_blocks

    def reset_peak(self) -> None:
        self.peak_used = self.num_used

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[Block]:
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._empty:
                block = self._empty.pop()
            else:
                _, block = self._evictable.popitem(last=False)
                block_hash = block.block_hash
                self._drop_hash(block)
                if self._host_tier is not None and block_hash not in self._by_hash:
                    self._host_tier.offload(block.block_id, block_hash)
            block.ref_count = 1
            out.append(block)
        self.peak_used = max(self.peak_used, self.num_used)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks found by a prefix hit, pulling free ones out of the LRU."""
        for block in blocks:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
            block.ref_count += 1
        self.peak_used = max(self.peak_used, self.num_used)

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the given order (pass a request's blocks tail-first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._empty.append(block)
                else:
                    self._evictable[block.block_id] = block

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: BlockHash) -> Block | None:
        copies = self._by_hash.get(block_hash)
        return next(iter(copies.values())) if copies else None

    def cache_block(
        self,
        block: Block,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int] = (),
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Publish a full, computed block under its hash so later requests can reuse it; ``token_ids``,
        ``cache_salt`` (block 0's) and ``lora_name`` (its adapter's) only travel in its KV event."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        copies = self._by_hash.setdefault(block_hash, {})
        if not copies:
            if self._host_tier is not None:
                self._host_tier.drop(block_hash)
            self._emit(
                BlockStored(block_hash, parent_hash, token_ids=token_ids, cache_salt=cache_salt, lora_name=lora_name)
            )
        copies[block.block_id] = block

    def _drop_hash(self, block: Block) -> None:
        copies = self._by_hash[block.block_hash]
        del copies[block.block_id]
        if not copies:
            del self._by_hash[block.block_hash]
            self._emit(BlockRemoved(block.block_hash))
        block.block_hash = None

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash this pool can serve a hit for: what a publisher resynchronises after a reconnect."""
        return list(self._by_hash)

    def hottest(self, limit: int) -> list[BlockHash]:
        """Up to ``limit`` cached hashes, hottest first: those running requests hold, then the evictable ones
        most recently freed first (what a replica hands a peer when it drains, or a new one warms up from)."""
        held = [b.block_hash for b in self.blocks if b.ref_count and b.block_hash is not None]
        recent = [b.block_hash for b in reversed(self._evictable.values())]
        return list(dict.fromkeys(held + recent))[:limit]

    def reset(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use."""
        if self.num_used:
            return False
        for block in self._evictable.values():
            block.block_hash = None
            self._empty.append(block)
        self._evictable.clear()
        self._by_hash.clear()
        self._emit(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events on the pool's log since the last call (the engine takes its shared log's itself)."""
        return self.events.take()

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is in exactly one state and the map agrees."""
        empty_ids = {b.block_id for b in self._empty}
        assert len(empty_ids) == len(self._empty), "block listed twice in the empty stack"
        evictable_ids = set(self._evictable)
        assert not empty_ids & evictable_ids, "block both empty and cached"
        used = 0
        for block in self.blocks:
            if block.ref_count > 0:
                used += 1
                assert block.block_id not in empty_ids and block.block_id not in evictable_ids
            elif block.block_hash is None:
                assert block.block_id in empty_ids, f"leaked empty block {block.block_id}"
            else:
                assert block.block_id in evictable_ids, f"leaked cached block {block.block_id}"
            if block.block_hash is not None:
                assert self._by_hash[block.block_hash].get(block.block_id) is block
        assert used + len(empty_ids) + len(evictable_ids) == self.num_blocks
        mapped = sum(len(c) for c in self._by_hash.values())
        assert mapped == sum(b.block_hash is not None for b in self.blocks), "stale hash map entry"
