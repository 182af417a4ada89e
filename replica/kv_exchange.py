"""An engine's side of moving KV between replicas: pinning a prefix to export it, adopting one imported.

Both run between engine steps (``AsyncLLM.between_steps``), on the engine's own thread, and are cheap there:
exporting pins the prefix's device blocks (a reference each, so no step evicts or reuses them) and copies
the few it finds only in the host or disk tier; the bulk copy of device blocks (``gather``) then runs on
another thread while the engine steps, once every step launched before the pin has run (``ready``: under
asynchronous scheduling a block is published before the step that fills it). Adopting is the same in three
steps: ``reserve`` free device blocks (between steps), ``fill`` them with validated bytes (on another thread,
through the device queue: after every step in flight, like a swap-in), ``commit`` them as cached prefix blocks
(between steps), published in the KV events and so in the index. The copy never holds up a step, nor the
receiver's socket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvmesh.core.hashing import BlockHash
from kvmesh.replica.block_pool import Block, BlockPool
from kvmesh.replica.device_queue import DeviceQueue, StepHandle, StepResult
from kvmesh.replica.kv_transfer import BlockBytes
from kvmesh.replica.swap import SwapSpace


@dataclass
class Export:
    """A prefix pinned for export: its leading ``hashes`` this engine holds, each served from a pinned device
    block or from host bytes copied when it was pinned (host and disk tiers)."""

    hashes: list[BlockHash]
    device: dict[int, Block] = field(default_factory=dict)
    """Position in ``hashes`` -> pinned device block."""
    host: dict[int, torch.Tensor] = field(default_factory=dict)
    """Position in ``hashes`` -> the block's bytes (one row)."""
    ready: StepHandle | None = None
    """Done once every step launched before the pin has run: the device blocks' bytes are final."""


@dataclass
class Reservation:
    """Free device blocks taken for imported ones: per hash reserved for, the block it goes into (None where
    this engine held it, or once committed); ``len(slots)`` leading hashes fit."""

    slots: list[Block | None]
    ready: StepHandle
    committed: int = 0
    """Blocks before this one are committed."""


def _marker() -> tuple[torch.Tensor, dict, None]:
    return torch.empty(0, dtype=torch.long), {}, None


class KVExchange:
    """Export and adoption of prefix blocks for one engine's pool, host tier and device queue."""

    def __init__(
        self,
        pool: BlockPool,
        swap: SwapSpace | None,
        blocks: BlockBytes,
        device: DeviceQueue,
        flush_events: Callable[[], None],
    ) -> None:
        """``flush_events``: hands the engine's KV events to its sinks (adopted blocks are announced at once,
        not at the next step, which an idle replica may not take for a while)."""
        self.pool, self.swap, self.blocks, self.device = pool, swap, blocks, device
        self.flush_events = flush_events

    def local_depth(self, hashes: list[BlockHash]) -> int:
        """How many leading ``hashes`` the device pool holds (an estimate when read off the engine's thread)."""
        for i, h in enumerate(hashes):
            if self.pool.lookup(h) is None:
                return i
        return len(hashes)

    def pin(self, hashes: list[BlockHash]) -> Export:
        """Pin the leading ``hashes`` this engine holds in any tier (between steps); ``unpin`` when done."""
        export = Export([])
        for i, h in enumerate(hashes):
            block = self.pool.lookup(h)
            if block is not None:
                export.device[i] = block
            else:
                row = self._from_tiers(h)
                if row is None:
                    break
                export.host[i] = row
            export.hashes.append(h)
        self.pool.touch(export.device.values())
        export.ready = self.device.submit(_marker)
        return export

    def _from_tiers(self, block_hash: BlockHash) -> torch.Tensor | None:
        """A block's bytes from the host tier, else the disk tier; None if neither holds it."""
        if self.swap is None:
            return None
        row = self.swap.read_cached(block_hash)
        if row is None and self.swap.disk is not None:
            payload = self.swap.disk.read(block_hash)
            row = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None else None
        return row

    def gather(self, export: Export, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Bytes of ``export``'s blocks ``start:end`` (off the engine's thread, once ``ready``), into ``out``'s
        leading rows when given."""
        on_device = [i for i in range(start, end) if i in export.device]
        ids = [export.device[i].block_id for i in on_device]
        if len(on_device) == end - start:  # the usual case: one gather, no reassembly
            return self.blocks.gather(ids, out)
        rows = torch.empty((end - start, self.blocks.block_bytes), dtype=torch.uint8) if out is None else out
        rows = rows[: end - start]
        for row, i in zip(self.blocks.gather(ids) if ids else [], on_device, strict=False):
            rows[i - start] = row
        for i in range(start, end):
            if i in export.host:
                rows[i - start] = export.host[i]
        return rows

    def unpin(self, export: Export) -> None:
        """Release the pinned device blocks (between steps)."""
        self.pool.free(reversed(list(export.device.values())))
        export.device.clear()

    def reserve(self, hashes: list[BlockHash]) -> Reservation:
        """Free device blocks for those of the leading ``hashes`` this engine lacks, as many as fit (between
        steps); ``commit`` them as they are filled, ``release`` the rest. Taking only free blocks, adopting never
        takes room a request could have. Write into them once ``ready``: a step launched before may still read
        a block freed since."""
        room = self.pool.num_free
        slots, new = [], []
        for h in hashes:
            if self.pool.lookup(h) is None:
                if len(new) == room:
                    break
                new.append(len(slots))
            slots.append(None)
        blocks = self.pool.allocate(len(new)) if new else []
        for i, block in zip(new, blocks, strict=True):
            slots[i] = block
        return Reservation(slots, ready=self.device.submit(_marker))

    def landing(self, reservation: Reservation, start: int, end: int, scratch: torch.Tensor) -> list[list]:
        """Where the blocks ``start:end`` of a reservation land on a ``direct`` cache: each reserved block's rows
        in the cache, a row of ``scratch`` for one already held (its bytes are checked, then dropped)."""
        rows = scratch.numpy()
        slots = reservation.slots[start:end]
        return [self.blocks.views(b.block_id) if b is not None else [rows[i]] for i, b in enumerate(slots)]

    def fill(self, reservation: Reservation, start: int, payload: torch.Tensor) -> None:
        """Copy ``payload``'s rows (blocks ``start:start+len(payload)`` of the reservation) into the blocks reserved
        for them, after every step launched before (a cache that is not ``direct``); returns once copied (call
        it off the engine's thread)."""
        slots = reservation.slots[start : start + len(payload)]
        rows = [i for i, b in enumerate(slots) if b is not None]
        if not rows:
            return
        ids = [slots[i].block_id for i in rows]
        rows = payload[: len(rows)] if rows[-1] == len(rows) - 1 else payload[rows]

        def copy_in() -> StepResult:
            self.blocks.scatter(ids, rows)
            if self.device.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            return _marker()

        self.device.submit(copy_in).result()

    def commit(
        self,
        reservation: Reservation,
        end: int,
        hashes: list[BlockHash],
        parent: BlockHash | None,
        token_ids: list[list[int]] | None = None,
        cache_salt: str | None = None,
        chained: bool = True,
        lora_name: str | None = None,
    ) -> int:
        """Publish the filled blocks ``reservation.committed:end`` (``hashes`` are the reservation's) as cached
        prefix blocks continuing the chain after ``parent`` (between steps); how many of the leading ``hashes``
        this engine now holds. They stay free (evictable, freshest last). ``token_ids`` (each block's tokens)
        and ``cache_salt`` (block 0's) only travel in the KV events. ``chained`` False: ``hashes`` are separate
        hot blocks, not one chain (a hand-off or warm-up); their events name no parent."""
        done = []
        for i in range(reservation.committed, end):
            block = reservation.slots[i]
            if block is None:
                continue
            prev = (hashes[i - 1] if i else parent) if chained else None
            tokens = token_ids[i] if token_ids is not None else ()
            salt = cache_salt if chained and prev is None else None
            self.pool.cache_block(block, hashes[i], prev, tokens, salt, lora_name)
            reservation.slots[i] = None
            done.append(block)
        reservation.committed = end
        self.pool.free(reversed(done))
        self.flush_events()
        return self.local_depth(hashes[:end])

    def release(self, reservation: Reservation) -> None:
        """Give back the blocks reserved and not committed (between steps): plain free blocks, no content."""
        left = [b for b in reservation.slots if b is not None]
        self.pool.free(reversed(left))
        reservation.slots = [None] * len(reservation.slots)
