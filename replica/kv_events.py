"""KV cache events: what a replica tells the global index after each engine step.

They are emitted at the granularity of block hashes, not physical blocks: ``BlockStored`` when a hash
becomes present in this replica's cache (its first copy), ``BlockRemoved`` when its last copy is evicted,
``AllBlocksCleared`` on a prefix-cache reset. Replaying them in order mirrors the set of cached hashes
exactly, which is all a publisher needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    """``None`` for block 0 of a chain."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
