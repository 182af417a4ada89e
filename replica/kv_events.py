"""KV cache events: what a replica tells the global index after each engine step.

They are emitted at the granularity of block hashes, not physical blocks: ``BlockStored`` when a hash
becomes present in this replica's cache (its first copy), ``BlockRemoved`` when its last copy is evicted,
``AllBlocksCleared`` on a prefix-cache reset (both media). Replaying them in order mirrors the set of
cached hashes exactly, which is all a publisher needs. Each carries the ``medium`` holding the block:
``device`` (the block pool), ``host`` (the host prefix tier, ``replica/swap.py``) or ``disk`` (the disk
tier under it, ``replica/disk_tier.py``). A hash is in at most one of device and host: the host tier
takes a block the device evicts and gives it back when a request loads it. The disk tier keeps its copy
when a block is read back, so a hash on disk may also be in one of the others.
The index publisher (``router/index_publisher.py``) reads them by their ``kind``, ``block_hash`` and
``medium`` only, so the router never imports the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvmesh.core.hashing import BlockHash

DEVICE = "device"
HOST = "host"
DISK = "disk"


@dataclass(frozen=True, slots=True)
class BlockStored:
    kind: ClassVar[str] = "stored"
    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    """``None`` for block 0 of a chain, and in host-tier events (the tier keeps no chain links)."""
    medium: str = DEVICE
    token_ids: Sequence[int] = ()
    """The block's tokens (device events; vLLM's wire format carries them, ``replica/kv_event_publisher.py``)."""
    cache_salt: str | None = None
    """Block 0's tenant salt, if its chain has one."""
    lora_name: str | None = None
    """The LoRA adapter whose KV the block holds (device events; None: the base model)."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    kind: ClassVar[str] = "removed"
    block_hash: BlockHash
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    kind: ClassVar[str] = "cleared"


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """One engine's KV events, every tier's (device pool, host tier, disk tier) in the order they happened.

    Each tier is given the log when it is built and ``emit``s into it (a list's ``append``: no per-event
    indirection); the engine ``take``s the lot after each step and hands it to its sinks."""

    __slots__ = ("_events", "emit")

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self.emit = self._events.append

    def take(self) -> list[KVEvent]:
        """The events emitted since the last call, oldest first."""
        events = self._events[:]
        self._events.clear()
        return events
