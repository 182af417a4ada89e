"""Per-sequence block tables on top of the block pool: prefix hits, slot allocation, forks, caching, freeing.

Forks share blocks copy-on-write. A forked sequence (``n > 1``, see ``Request.fork``) starts with its
parent's whole table, every block referenced once more. Only one block of a sequence can ever be written:
the one holding its next slot. Full blocks are read-only, and blocks past the computed tokens were allocated
for this sequence alone. So before a sequence writes, ``allocate`` looks at that one block: when others
share it (``ref_count > 1``, only ever a fork's partly filled last prompt block), the sequence gets a fresh
block in its place and a ``(source, destination)`` block copy is queued. The engine applies the step's
copies to the KV tensors before the forward pass (``take_copies``), reading every source before writing any
destination, so a source freed and handed out again during the same ``schedule()`` still holds its content.
The last sibling to write finds the block no longer shared and writes in place: n sequences copy n - 1 times.

For a sliding-window model (every layer windowed), blocks that fell entirely behind the window of a
sequence's next token are released as it goes, so a long generation holds about ``window / block_size``
blocks. Their table entries become ``None`` (positions stay aligned; the kernels never read them); the
released blocks stay cached, so a later request with the same prefix can still hit them.

With a swap space (``replica/swap.py``), a preempted sequence whose blocks are cheaper to move than to
recompute is swapped out: its computed blocks are copied to host memory, its device blocks freed, and on
readmission ``swap_in`` copies them back into fresh device blocks, so it resumes where it stopped.
"""

from __future__ import annotations

import numpy as np

from kvmesh.core.hashing import BlockHash
from kvmesh.replica.block_pool import Block, BlockPool
from kvmesh.replica.request import Request
from kvmesh.replica.swap import SwapSpace


class BlockTables:
    """Every sequence's block ids in one int32 array, a row per sequence that holds blocks, kept current by
    each change to its table: a step's batch preparation gathers its rows in one numpy operation instead of
    building a table per sequence. Rows and columns grow on demand; entries past a sequence's blocks are
    stale but always valid block ids (attention never reads past a sequence's length)."""

    def __init__(self, rows: int = 16, cols: int = 16) -> None:
        self.array = np.zeros((rows, cols), dtype=np.int32)
        self._free = list(range(rows - 1, -1, -1))

    def acquire(self) -> int:
        if not self._free:
            rows = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def release(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        end = start + len(block_ids)
        if end > self.array.shape[1]:
            grown = np.zeros((self.array.shape[0], max(end, 2 * self.array.shape[1])), dtype=np.int32)
            grown[:, : self.array.shape[1]] = self.array
            self.array = grown
        self.array[row, start:end] = block_ids


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        *,
        sliding_window: int | None = None,
        swap: SwapSpace | None = None,
        max_seqs: int = 16,
        max_blocks_per_seq: int = 16,
    ) -> None:
        """Tables over ``pool`` (prefix caching as the pool has it). ``sliding_window``: the window every layer
        attends within (None if any layer attends to the whole context). ``swap``: the host tier, if any.
        ``max_seqs`` x ``max_blocks_per_seq``: the block tables' first size (they grow on demand)."""
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = pool.enable_caching
        self.sliding_window = sliding_window
        # Keyed by the sequence itself: the n sequences of a forked request share its request id.
        self.req_blocks: dict[Request, list[Block | None]] = {}
        self._num_cached_blocks: dict[Request, int] = {}
        self._copies: list[tuple[int, int]] = []
        self.swap = swap
        self._swapped: dict[Request, tuple[list[int], list[int]]] = {}
        """Swapped-out sequences: the table positions their saved blocks came from, and the host blocks."""
        self.tables = BlockTables(max_seqs, max_blocks_per_seq)
        """The same tables as ``req_blocks``, as ids, one row per sequence (``Request.kv_row``)."""

    def computed_blocks_allowed(self, request: Request) -> bool:
        """Whether ``request`` may start from cached blocks (not when it wants every prompt position's logits)."""
        return self.enable_prefix_caching and request.params.prompt_logprobs is None

    def computed_blocks(self, request: Request) -> list[Block]:
        """Leading blocks of ``request`` already in the cache, stopping at the first miss.

        The hit never covers the last token: its logits are needed to sample, so at least that token (in
        practice its whole block, since only full blocks are cached) is recomputed.
        """
        if not self.computed_blocks_allowed(request):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def host_hits(self, request: Request, device_hits: int) -> list[BlockHash]:
        """The blocks of ``request``'s prefix that continue past its ``device_hits`` in the host tier, or on disk
        below it (worth loading there), capped like ``computed_blocks`` so the last token is still computed."""
        tiers = self.swap is not None and (self.swap.num_cached or self.swap.disk is not None)
        if not tiers or not self.computed_blocks_allowed(request):
            return []
        chain = request.block_hashes[device_hits : (request.num_tokens - 1) // self.block_size]
        # A later block may still be on the device (tails are evicted first): the lower tiers stop before it,
        # so no block is read from disk into the host tier while the device holds it.
        chain = chain[: next((i for i, h in enumerate(chain) if self.pool.lookup(h) is not None), len(chain))]
        return chain[: self.swap.cached_prefix(chain, self.block_size)]

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        hits: list[Block] | None = None,
        loads: list[BlockHash] | None = None,
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens; False (no change) if the pool is short.

        ``hits`` are prefix-cache blocks for a request being admitted; they are pinned here. ``loads`` are
        the host-tier blocks that follow them (``host_hits``): each gets a new device block and a queued
        copy in. The caller advances ``num_computed_tokens`` past both. A shared block about to be written
        is replaced by a private copy (copy-on-write), which costs one block more.
        """
        hits = hits or []
        loads = loads or []
        blocks = self.req_blocks.get(request, [])
        num_computed = request.num_computed_tokens + (len(hits) + len(loads)) * self.block_size
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(blocks) - len(hits)
        write_at = request.num_computed_tokens // self.block_size
        copy_on_write = write_at < len(blocks) and blocks[write_at].ref_count > 1
        # Hits sitting in the LRU free queue stop being allocatable once pinned.
        pinned_free = sum(1 for b in hits if b.ref_count == 0)
        if needed + pinned_free + copy_on_write > self.pool.num_free:
            return False
        host_ids = self.swap.claim(loads) if loads else []  # before allocating: evictions may offload here
        self.pool.touch(hits)
        if request.kv_row < 0:
            request.kv_row = self.tables.acquire()
        if copy_on_write:
            shared, (own,) = blocks[write_at], self.pool.allocate(1)
            self._copies.append((shared.block_id, own.block_id))
            self.pool.free([shared])  # the siblings keep it
            blocks[write_at] = own
            self.tables.write(request.kv_row, write_at, [own.block_id])
        new = self.pool.allocate(max(needed, 0))
        if loads:
            loaded = new[: len(loads)]
            self.swap.swap_in(host_ids, [b.block_id for b in loaded])
            first = len(blocks) + len(hits)
            for i, block in enumerate(loaded, start=first):
                self._cache(request, block, i)
        self.req_blocks[request] = blocks + hits + new
        if hits or new:
            self.tables.write(request.kv_row, len(blocks), [b.block_id for b in hits + new])
        if hits or loads:
            self._num_cached_blocks[request] = len(hits) + len(loads)
        self._release_behind_window(request, num_computed)
        return True

    def has_room_for_one(self, request: Request) -> bool:
        """Whether one more token fits ``request``'s blocks with nothing to allocate or copy (``allocate``
        would change nothing): the check a decode step makes for most running sequences."""
        blocks = self.req_blocks.get(request)
        pos = request.num_computed_tokens
        return (
            blocks is not None
            and self.sliding_window is None
            and pos < len(blocks) * self.block_size
            and blocks[pos // self.block_size].ref_count == 1
        )

    def _release_behind_window(self, request: Request, next_position: int) -> None:
        """Free the blocks no query from ``next_position`` on can see (all their keys are out of window)."""
        if self.sliding_window is None:
            return
        blocks = self.req_blocks[request]
        behind = max(0, next_position - self.sliding_window + 1) // self.block_size
        released = [b for b in blocks[:behind] if b is not None]
        if released:
            blocks[:behind] = [None] * behind
            self.tables.write(request.kv_row, 0, [0] * behind)
            self.pool.free(reversed(released))

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` every block of ``parent`` (one more reference each; no block is allocated)."""
        blocks = self.req_blocks[parent]
        self.pool.touch([b for b in blocks if b is not None])
        self.req_blocks[child] = list(blocks)
        child.kv_row = self.tables.acquire()
        self.tables.write(child.kv_row, 0, self.block_ids(child))
        if parent in self._num_cached_blocks:  # the shared full blocks are published already
            self._num_cached_blocks[child] = self._num_cached_blocks[parent]

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(source, destination)`` block copies queued since the last call, for the model runner."""
        copies, self._copies = self._copies, []
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Publish blocks whose KV is now completely computed (prompt or generated tokens alike)."""
        if not self.enable_prefix_caching:
            return
        start = self._num_cached_blocks.get(request, 0)
        end = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        blocks = self.req_blocks[request]
        for i in range(start, end):
            if blocks[i] is None:  # released behind a sliding window (after it was cached)
                continue
            self._cache(request, blocks[i], i)
        self._num_cached_blocks[request] = max(start, end)

    def _cache(self, request: Request, block: Block, i: int) -> None:
        """Publish ``request``'s block ``i`` under its hash, with what its KV event names: parent, tokens, salt,
        adapter."""
        size = self.block_size
        self.pool.cache_block(
            block,
            request.block_hashes[i],
            request.block_hashes[i - 1] if i else None,
            request.all_token_ids[i * size : (i + 1) * size],
            None if i else request.cache_salt,
            request.lora.name if request.lora is not None else None,
        )

    def is_swapped(self, request: Request) -> bool:
        return request in self._swapped

    @property
    def num_swapped_blocks(self) -> int:
        return sum(len(host) for _, host in self._swapped.values())

    def swap_out(self, request: Request, force: bool = False) -> bool:
        """Move ``request``'s computed blocks to the swap space and free its device blocks; False (nothing
        changed) without a swap space, when it is full, or when recomputing is cheaper (unless ``force``)."""
        if self.swap is None:
            return False
        blocks = self.req_blocks.get(request, [])
        computed = -(-request.num_computed_tokens // self.block_size)
        saved = [(i, b.block_id) for i, b in enumerate(blocks[:computed]) if b is not None]
        if not saved or len(saved) > self.swap.num_free:
            return False
        if not force and not self.swap.worth_it(request.num_computed_tokens, len(saved)):
            return False
        host = self.swap.swap_out([block_id for _, block_id in saved])
        self.free(request)
        self._swapped[request] = ([i for i, _ in saved], host)
        return True

    def swap_in(self, request: Request) -> None:
        """Queue the copy of a swapped sequence's blocks into the device blocks ``allocate`` just gave it."""
        positions, host = self._swapped.pop(request)
        blocks = self.req_blocks[request]
        self.swap.swap_in(host, [blocks[i].block_id for i in positions])

    def free(self, request: Request) -> None:
        """Release every block of ``request``, tail first so its tail is evicted before its head."""
        if request in self._swapped:  # aborted while swapped out
            self.swap.discard(self._swapped.pop(request)[1])
        blocks = self.req_blocks.pop(request, [])
        self._num_cached_blocks.pop(request, None)
        self.pool.free(reversed([b for b in blocks if b is not None]))
        if request.kv_row >= 0:
            self.tables.release(request.kv_row)
            request.kv_row = -1

    def block_ids(self, request: Request) -> list[int]:
        """The sequence's block table; released entries read as block 0, which attention masks out."""
        return [0 if b is None else b.block_id for b in self.req_blocks[request]]
