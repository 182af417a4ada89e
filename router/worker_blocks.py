"""A foreign engine's cache in kvmesh's terms: its KV events (vLLM's or SGLang's wire) turned into the set of
kvmesh block hashes it holds, per tier, for the index publisher.

Like Dynamo and llm-d, this never trusts or recomputes the engine's own hashes: it hashes each stored
block's ``token_ids`` with kvmesh's chain (``core/hashing.py``: the model seed, block 0's cache salt),
so the ingress's hashes of a prompt find it. The engine's hashes only link a block to its parent and name
what a removal removes. Engine and kvmesh block sizes may differ: an engine block of 128 tokens holds eight
16-token kvmesh blocks; engine blocks smaller than kvmesh's (SGLang's pages) complete one every few. A
kvmesh block belongs to the engine block in which it completes. Each physical copy of an engine block is
counted (two stores need two removals), per medium, and a kvmesh hash is listed while any copy holds it.
A block whose parent this consumer never saw (it joined late, or events were lost) cannot be placed in
the chain and is skipped, with its descendants: a missed hit, never a wrong one.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from kvmesh.core.hashing import BlockHash, first_block_extra, hash_block
from kvmesh.core.kv_event_wire import HOST_MEDIA, AllCleared, EventBatch, RemovedBlocks, StoredBlocks, WireHash

DEVICE, HOST = "device", "host"


@dataclass(frozen=True, slots=True)
class IndexEvent:
    """What ``router/index_publisher.py`` reads of an event."""

    kind: str  # "stored" | "removed" | "cleared"
    block_hash: BlockHash = b""
    medium: str = DEVICE


@dataclass(slots=True)
class _EngineBlock:
    """What kvmesh knows of one engine block: the chain state after it and the kvmesh blocks it completes."""

    anchor: BlockHash | None
    """kvmesh hash of the last complete kvmesh block up to this engine block's end (None: none yet)."""
    pending: tuple[int, ...]
    """Tokens after ``anchor`` up to this block's end (fewer than a kvmesh block)."""
    owned: tuple[BlockHash, ...]
    copies: Counter
    """Medium -> physical copies the engine reported."""


def medium_of(wire_medium: str | None) -> str | None:
    """The index tier of a wire medium: the device for ``GPU`` (or none given), the host tier for ``CPU``;
    None for tiers the index does not hold (``DISK``, ``EXTERNAL``)."""
    if wire_medium is None or wire_medium == "GPU":
        return DEVICE
    return HOST if wire_medium in HOST_MEDIA else None


class WorkerBlocks:
    """Thread-safe: ``apply`` runs on the subscriber's thread, ``snapshot`` on the index publisher's."""

    def __init__(self, seed: BlockHash, block_size: int) -> None:
        self.seed = seed
        self.block_size = block_size
        self._blocks: dict[WireHash, _EngineBlock] = {}
        self._refs = {DEVICE: Counter(), HOST: Counter()}
        self._lock = threading.Lock()
        self.unlinked = 0
        """Engine blocks skipped because their parent was unknown."""

    def apply(self, batch: EventBatch) -> list[IndexEvent]:
        """Apply one batch; returns the index's changes (kvmesh hashes gained or lost, per tier)."""
        out: list[IndexEvent] = []
        with self._lock:
            for event in batch.events:
                if isinstance(event, StoredBlocks):
                    self._stored(event, out)
                elif isinstance(event, RemovedBlocks):
                    self._removed(event, out)
                elif isinstance(event, AllCleared):
                    out = [IndexEvent("cleared")]
                    self._clear()
        return out

    def clear(self) -> list[IndexEvent]:
        """Forget everything (the engine restarted): the index publisher resynchronises to empty."""
        with self._lock:
            self._clear()
        return [IndexEvent("cleared")]

    def leading(self, block_hashes: list[BlockHash], medium: str = DEVICE, start: int = 0) -> int:
        """How many of ``block_hashes`` from ``start`` on this worker holds in a row in ``medium`` (a lookup in
        this process, as the index answers one)."""
        refs, n = self._refs[medium], 0
        with self._lock:
            for h in block_hashes[start:]:
                if h not in refs:
                    break
                n += 1
        return n

    def snapshot(self, medium: str = DEVICE) -> list[BlockHash]:
        with self._lock:
            return list(self._refs[medium])

    def __len__(self) -> int:
        return len(self._blocks)

    def _clear(self) -> None:
        self._blocks.clear()
        for refs in self._refs.values():
            refs.clear()

    def _stored(self, event: StoredBlocks, out: list[IndexEvent]) -> None:
        medium = medium_of(event.medium)
        if medium is None:
            return
        if event.parent_block_hash is None:
            anchor, pending = None, ()
        else:
            parent = self._blocks.get(event.parent_block_hash)
            if parent is None:
                self.unlinked += len(event.block_hashes)
                return
            anchor, pending = parent.anchor, parent.pending
        size, step = self.block_size, event.block_size
        extra = first_block_extra(event.cache_salt, event.lora_name)
        for i, engine_hash in enumerate(event.block_hashes):
            block = self._blocks.get(engine_hash)
            if block is None:
                tokens = pending + tuple(event.token_ids[i * step : (i + 1) * step])
                owned = []
                while len(tokens) >= size:
                    if anchor is None:
                        anchor = hash_block(self.seed, tokens[:size], extra)
                    else:
                        anchor = hash_block(anchor, tokens[:size])
                    owned.append(anchor)
                    tokens = tokens[size:]
                block = self._blocks[engine_hash] = _EngineBlock(anchor, tokens, tuple(owned), Counter())
            anchor, pending = block.anchor, block.pending
            block.copies[medium] += 1
            refs = self._refs[medium]
            for h in block.owned:
                refs[h] += 1
                if refs[h] == 1:
                    out.append(IndexEvent("stored", h, medium))

    def _removed(self, event: RemovedBlocks, out: list[IndexEvent]) -> None:
        medium = medium_of(event.medium)
        if medium is None:
            return
        refs = self._refs[medium]
        for engine_hash in event.block_hashes:
            block = self._blocks.get(engine_hash)
            if block is None or not block.copies[medium]:
                continue
            block.copies[medium] -= 1
            for h in reversed(block.owned):
                refs[h] -= 1
                if not refs[h]:
                    del refs[h]
                    out.append(IndexEvent("removed", h, medium))
            if not +block.copies:
                del self._blocks[engine_hash]
