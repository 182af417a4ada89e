"""The host-memory tier: preempted sequences' KV blocks, and prefix blocks evicted from the device pool.

Preemption frees a running sequence's device blocks when the pool runs dry. Recomputing its tokens later
costs a prefill of all of them; copying its blocks out to host memory and back costs two copies of its
bytes. ``SwapSpace.worth_it`` compares the two with this replica's own numbers (the host copy bandwidth
measured at start-up, the engine's measured prefill rate), so long sequences swap and short ones, for
which a recompute is nearly free, do not.

The same host blocks hold a prefix cache (``host_cache_bytes``): a full cached block the device pool
evicts is copied here instead of dropped, and a later request whose prefix continues past the device
hits into this tier loads those blocks back before its prefill, when loading is cheaper than recomputing.
Host-cached blocks are LRU and exclusive with the device (a loaded or recomputed block leaves the tier);
swapped sequences take precedence and evict them. Without ``host_cache_bytes`` nothing is cached here.
With a disk tier under it (``replica/disk_tier.py``) the blocks this tier evicts are written to
files, and a chain that continues past the host hits onto disk is read back into host blocks first (when
reading and copying in beats recomputing), then loaded like any host hit.

Copies are queued during scheduling and run by the engine before the step's forward pass: copies out
first (their device blocks may already be handed to other sequences this step, but nothing writes them
before the forward pass), then copy-on-write copies, then copies in, into freshly allocated blocks. They
run where the step runs (``replica/device_queue.py``), after every step launched before it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.core.hashing import BlockHash
from kvmesh.kernels.quant import as_bytes
from kvmesh.replica.context import LayerCache
from kvmesh.replica.disk_tier import DiskTier
from kvmesh.replica.kv_events import HOST, BlockRemoved, BlockStored, KVEventLog
from kvmesh.router.prefix_lru import leading


def block_bytes(device_caches: list[LayerCache]) -> int:
    """Bytes of one block of every tensor a block copy moves: what a host or disk block holds."""
    return sum(t[0].numel() * t.element_size() for layer in device_caches for t in layer.per_block())


@dataclass
class SwapCopies:
    """One step's swap copies: ``(device ids, host ids)`` out, then ``(host ids, device ids)`` in."""

    outs: list[tuple[list[int], list[int]]]
    ins: list[tuple[list[int], list[int]]]


class SwapSpace:
    def __init__(
        self,
        device_caches: list[LayerCache],
        num_blocks: int,
        *,
        prefill_tok_s: Callable[[], float],
        events: KVEventLog,
        cache_blocks: int = 0,
        disk: DiskTier | None = None,
    ) -> None:
        """``prefill_tok_s``: the engine's measured prefill rate, read when a copy is priced against a recompute.
        ``events``: the engine's KV event log (this tier's events carry medium ``host``). ``disk``: the tier
        below (blocks of ``block_bytes``), which gets what this one evicts; it needs ``cache_blocks``."""
        if num_blocks < 1:
            raise ValueError(f"a swap space needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache_blocks = min(cache_blocks, num_blocks)
        """How many host blocks evicted prefix blocks may hold (0: no host prefix cache)."""
        self._cached: OrderedDict[BlockHash, int] = OrderedDict()
        """Host prefix cache: block hash -> host block, least recently stored first."""
        self._device = [[as_bytes(t) for t in layer.per_block()] for layer in device_caches]
        pin = self._device[0][0].is_cuda
        self._host = [
            [torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in layer]
            for layer in self._device
        ]
        self.block_bytes = block_bytes(device_caches)
        self.disk = disk
        self._free = list(range(num_blocks - 1, -1, -1))
        self._outs: list[tuple[list[int], list[int]]] = []
        self._offloads: dict[int, int] = {}
        """Offload copies not yet in ``_outs``, host id -> device id: one batched copy per step, not one per
        block; a host block reused within the batch keeps only its last copy."""
        self._ins: list[tuple[list[int], list[int]]] = []
        self._emit = events.emit
        self._in_flight: Counter[int] = Counter()
        """Queued copies not yet run, per host block they write or read (the step runs them later, maybe on
        another thread): the disk tier neither saves such a block's bytes nor reads into it."""
        self._in_flight_lock = threading.Lock()
        self.disk_blocks_read = 0
        self._prefill_tok_s = prefill_tok_s
        self.copy_bytes_s = self._measure_bandwidth()

    @property
    def num_free(self) -> int:
        """Host blocks a swap-out may take: empty ones and those holding cached prefix blocks."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def load_tok_s(self, block_size: int) -> float:
        """Tokens per second of KV this tier copies back to the device (what routers price a host hit at)."""
        return block_size * self.copy_bytes_s / self.block_bytes

    def disk_load_tok_s(self, block_size: int) -> float:
        """Tokens per second of KV the disk tier reads back and this tier copies to the device."""
        return block_size / (self.disk.load_s() + self.block_bytes / self.copy_bytes_s)

    def worth_it(self, num_tokens: int, num_blocks: int) -> bool:
        """Whether moving ``num_blocks`` out and back is cheaper than recomputing ``num_tokens`` (and fits)."""
        swap_s = 2 * num_blocks * self.block_bytes / self.copy_bytes_s
        return num_blocks <= self.num_free and swap_s < num_tokens / self._prefill_tok_s()

    def swap_out(self, device_ids: list[int]) -> list[int]:
        """Reserve host blocks for ``device_ids`` and queue the copy out; returns the host block ids."""
        host_ids = [self._take() for _ in device_ids]
        self._flush_offloads()  # queued before: a host block they target may be one taken here
        self._outs.append((device_ids, host_ids))
        self._queued(host_ids, 1)
        return host_ids

    def _take(self) -> int:
        """An empty host block, evicting the least recently stored cached prefix block if there is none."""
        if self._free:
            return self._free.pop()
        return self._evict_oldest()

    def _evict_oldest(self) -> int:
        block_hash, host_id = self._cached.popitem(last=False)
        self._to_disk(block_hash, host_id)
        self._emit(BlockRemoved(block_hash, HOST))
        return host_id

    def _queued(self, host_ids: list[int], n: int) -> None:
        with self._in_flight_lock:
            for host_id in host_ids:
                self._in_flight[host_id] += n

    def _busy(self, host_id: int) -> bool:
        """Whether a queued copy has still to write or read ``host_id``."""
        return host_id in self._offloads or self._in_flight[host_id] > 0

    def spill(self, device_blocks: list[tuple[BlockHash, int]]) -> None:
        """Write every cached block to the disk tier, the host tier's and ``device_blocks`` (hash, device block
        id) alike, waiting for room in its queue: a replica shutting down keeps its cache for the next one."""
        for block_hash, host_id in self._cached.items():
            self._to_disk(block_hash, host_id, wait=True)
        for block_hash, device_id in device_blocks:
            self.disk.put(block_hash, self._block_bytes(self._device, device_id), wait=True)

    def _block_bytes(self, tensors: list[list[torch.Tensor]], index: int) -> bytes:
        """Block ``index`` of every tensor, as the disk tier stores it (layer by layer, tensor by tensor)."""
        return b"".join(t[index].view(torch.uint8).reshape(-1).cpu().numpy().tobytes() for lay in tensors for t in lay)

    def _to_disk(self, block_hash: BlockHash, host_id: int, wait: bool = False) -> None:
        """Keep an evicted host block's bytes on disk: from the host block, or, while the copy that fills it
        is still queued this step, from the device block it copies (free, so nothing writes it). A block whose
        copy is already handed to a step is not saved."""
        if self.disk is None:
            return
        if host_id in self._offloads:
            tensors, index = self._device, self._offloads[host_id]
        elif self._in_flight[host_id] > 0:
            return
        else:
            tensors, index = self._host, host_id
        self.disk.put(block_hash, self._block_bytes(tensors, index), wait)

    def _from_disk(self, host_id: int, payload: bytes) -> None:
        data, offset = torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0
        for t in (t for layer in self._host for t in layer):
            row = t[host_id].view(torch.uint8).reshape(-1)
            row.copy_(data[offset : offset + row.numel()])
            offset += row.numel()

    # ------------------------------------------------------------------ host prefix cache
    def offload(self, device_id: int, block_hash: BlockHash) -> None:
        """A full cached block the device pool is evicting: keep its KV here (queued copy out) if the tier
        caches at all; the oldest cached block makes room once the cache's share is used."""
        if not self.cache_blocks or block_hash in self._cached:
            return
        if self._free and len(self._cached) < self.cache_blocks:
            host_id = self._free.pop()
        elif self._cached:
            host_id = self._evict_oldest()
        else:
            return
        self._cached[block_hash] = host_id
        self._emit(BlockStored(block_hash, None, HOST))
        self._offloads.pop(host_id, None)
        self._offloads[host_id] = device_id

    def _flush_offloads(self) -> None:
        if self._offloads:
            self._outs.append((list(self._offloads.values()), list(self._offloads)))
            self._queued(list(self._offloads), 1)
            self._offloads = {}

    def cached_prefix(self, block_hashes: list[BlockHash], block_size: int) -> int:
        """How many of ``block_hashes`` (a chain continuing past the device hits) the tier holds in a row,
        after reading from disk those that continue it there; 0 when copying a block in costs more than
        recomputing its ``block_size`` tokens (reading it from disk first counts for those)."""
        recompute_s, copy_s = block_size / self._prefill_tok_s(), self.block_bytes / self.copy_bytes_s
        if copy_s >= recompute_s:
            return 0
        n = leading(block_hashes, self._cached) if self._cached else 0
        if self.disk is None or n == len(block_hashes) or copy_s + self.disk.load_s() >= recompute_s:
            return n
        for h in block_hashes[:n]:  # the chain's host blocks are not the ones to evict for its disk blocks
            self._cached.move_to_end(h)
        return n + self._read_disk(block_hashes[n : self.cache_blocks], set(block_hashes[:n]))

    def _read_disk(self, block_hashes: list[BlockHash], keep: set[BlockHash]) -> int:
        """Read the leading ``block_hashes`` the disk holds into host blocks (those the host tier holds count as
        read); how many the host tier now holds in a row."""
        read = 0
        for h in block_hashes:
            if h in self._cached:  # the chain goes on in the host tier itself
                self._cached.move_to_end(h)
                keep.add(h)
                read += 1
                continue
            if h not in self.disk:
                break
            host_id = self._block_for_disk(keep)
            if host_id is None:
                break
            payload = self.disk.read(h)
            if payload is None:  # failed its checks: recomputed instead
                self._free.append(host_id)
                break
            self._from_disk(host_id, payload)
            self.disk_blocks_read += 1
            self._cached[h] = host_id
            keep.add(h)
            self._emit(BlockStored(h, None, HOST))
            read += 1
        return read

    def _block_for_disk(self, keep: set[BlockHash]) -> int | None:
        """A host block to read a disk block into: a free one while the cache has room, else the least
        recently stored cached block that is neither in ``keep`` nor waiting for a queued copy."""
        if len(self._cached) < self.cache_blocks:
            free = next((j for j in range(len(self._free) - 1, -1, -1) if not self._busy(self._free[j])), None)
            if free is not None:
                return self._free.pop(free)
        victim = next((h for h, i in self._cached.items() if h not in keep and not self._busy(i)), None)
        if victim is None:
            return None
        host_id = self._cached.pop(victim)
        self._to_disk(victim, host_id)
        self._emit(BlockRemoved(victim, HOST))
        return host_id

    def claim(self, block_hashes: list[BlockHash]) -> list[int]:
        """Take cached ``block_hashes`` out of the tier to load them (``swap_in`` queues the copy): the device
        holds them from now on; their host blocks free once the copy has run."""
        for h in block_hashes:
            self._emit(BlockRemoved(h, HOST))
        return [self._cached.pop(h) for h in block_hashes]

    def drop(self, block_hash: BlockHash) -> None:
        """The device holds ``block_hash`` again (recomputed, not loaded): free its host copy, so each hash
        lives in one tier and the device's evictions find room here."""
        host_id = self._cached.pop(block_hash, None)
        if host_id is not None:
            self._free.append(host_id)
            self._emit(BlockRemoved(block_hash, HOST))

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def read_cached(self, block_hash: BlockHash) -> torch.Tensor | None:
        """A host-cached block's bytes, one uint8 row in the disk tier's layout (a peer exports it); None if
        the tier does not hold it or the copy that fills it has not run yet."""
        host_id = self._cached.get(block_hash)
        if host_id is None or self._busy(host_id):
            return None
        return torch.frombuffer(bytearray(self._block_bytes(self._host, host_id)), dtype=torch.uint8)

    def clear_cache(self) -> None:
        """Forget every cached prefix block, on disk too (a prefix-cache reset, whose ``AllBlocksCleared``
        covers them)."""
        self._free += self._cached.values()
        self._cached.clear()
        if self.disk is not None:
            self.disk.clear()

    def swap_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Queue the copy of ``host_ids`` back into ``device_ids``; the host blocks free once it has run."""
        self._ins.append((host_ids, device_ids))
        self._queued(host_ids, 1)

    def discard(self, host_ids: list[int]) -> None:
        """Give back the host blocks of a swapped sequence that will never come back (aborted)."""
        self._free += host_ids

    def take(self) -> SwapCopies:
        """The copies queued since the last call, to run in order before the step's forward pass. The host
        blocks swapped in are free again from here: a later swap-out may take them, and its copy runs after."""
        self._flush_offloads()
        copies = SwapCopies(self._outs, self._ins)
        self._outs, self._ins = [], []
        for host_ids, _ in copies.ins:
            self._free += host_ids
        return copies

    def copy_out(self, copies: SwapCopies) -> None:
        """Device work, before anything writes the blocks the swapped sequences leave."""
        for device_ids, host_ids in copies.outs:
            self._copy(self._device, device_ids, self._host, host_ids)
            self._queued(host_ids, -1)

    def copy_in(self, copies: SwapCopies) -> None:
        """Device work, into the blocks the readmitted sequences were just given."""
        for host_ids, device_ids in copies.ins:
            self._copy(self._host, host_ids, self._device, device_ids)
            self._queued(host_ids, -1)

    def check_integrity(self, held: int) -> None:
        """Free + cached + held by swapped sequences == total, with no block counted twice."""
        owned = self._free + list(self._cached.values())
        assert len(set(owned)) == len(owned), "host block both free and cached, or cached twice"
        assert len(owned) + held == self.num_blocks, f"{len(owned)} free or cached + {held} swapped"
        assert len(self._cached) <= self.cache_blocks

    @staticmethod
    def _copy(src: list[list[torch.Tensor]], src_ids: list[int], dst: list[list[torch.Tensor]], dst_ids: list[int]):
        src_index = torch.tensor(src_ids, device=src[0][0].device)
        dst_index = torch.tensor(dst_ids, device=dst[0][0].device)
        # Asynchronous only towards the device: a non-blocking copy to the host returns before its bytes
        # arrive, and index_copy_ on the host would read them at once.
        to_device = dst[0][0].is_cuda
        for src_layer, dst_layer in zip(src, dst, strict=True):
            for s, d in zip(src_layer, dst_layer, strict=True):
                d.index_copy_(0, dst_index, s.index_select(0, src_index).to(d.device, non_blocking=to_device))
        if dst[0][0].is_cuda or src[0][0].is_cuda:
            torch.cuda.current_stream().synchronize()

    def _measure_bandwidth(self, repeats: int = 5) -> float:
        """Host copy bandwidth (bytes/s) of a swap-sized copy: one block out of every tensor, the fastest of
        ``repeats`` timings, so a moment the process spent descheduled (a busy core) is not taken for the
        copy's speed: routers and the swap decision price every host-tier load by it."""
        n = min(self.num_blocks, self._device[0][0].shape[0], 8)  # the host may hold more blocks than the device
        ids = list(range(n))
        self._copy(self._device, ids, self._host, ids)  # first touch of the host pages is not a copy's cost
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            self._copy(self._device, ids, self._host, ids)
            fastest = min(fastest, time.perf_counter() - start)
        return max(n * self.block_bytes / max(fastest, 1e-6), 1e6)
