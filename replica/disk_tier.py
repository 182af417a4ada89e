"""The disk tier: prefix blocks the host tier evicts, kept in files that outlive the replica.

Below the host prefix tier (``replica/swap.py``): a block the host tier evicts is written here, one
file per block, named by its chained hash, under a directory of the cache's fingerprint (model, weights,
dtypes, block size, hash seed: ``fingerprint``), so a replica only ever sees blocks it could have computed
itself. Writes run on a thread of their own from a bounded queue (a full queue drops the block: the step
never waits for the disk); each file is written whole and renamed into place, with a header carrying the
fingerprint, the block hash and an xxh3 checksum of the payload, checked on every read. A truncated,
corrupted or foreign file is skipped with a log line and deleted, never served. The directory is bounded by
``capacity_bytes``, least recently used first, and locked while a replica uses it: two replicas given the
same directory never share it, the second takes ``slot-1`` under it, the next ``slot-2`` (blocks of one
fingerprint serve any replica, so a restarted replica may adopt any free slot).

A replica that shuts down cleanly first writes what its device pool and host tier still cache (``spill``);
a replica started on a directory that holds blocks of its fingerprint adopts them (warm restart): the host
tier loads them back on a hit exactly as blocks it wrote itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import xxhash

from kvmesh.core.hashing import BlockHash
from kvmesh.replica.kv_events import DISK, BlockRemoved, BlockStored, KVEvent, KVEventLog

if TYPE_CHECKING:
    from kvmesh.core.engine_config import EngineConfig
    from kvmesh.replica.context import LayerCache
    from kvmesh.replica.model_runner import ModelRunner

log = logging.getLogger(__name__)

MAGIC = b"KVMESHD1"
_HEADER = struct.Struct("<8s32s16sQQ")  # magic, fingerprint (sha256), block hash, payload bytes, xxh3_64
SUFFIX = ".kvb"
WRITE_QUEUE = 256
"""Blocks waiting for the writer at most; more are dropped (counted in ``DiskTier.dropped``)."""


def cache_fingerprint(runner: ModelRunner, model_id: str, hash_seed: BlockHash, config: EngineConfig) -> bytes:
    """sha256 of everything that makes a stored block's bytes right for this replica: the model (its name,
    the hash chain's seed, and a sample of its weights, so a changed checkpoint under the same name does
    not match), the compute and cache dtypes, the block size, the cache's tensor layout and the tensors every
    block is read with (fp8 scales, int4's rotation). Disk files and peers' blocks must carry this one."""
    h = hashlib.sha256(MAGIC)
    layout = [[(str(t.dtype), tuple(t.shape[1:])) for t in layer.per_block()] for layer in runner.kv_caches]
    meta = {"model": model_id, "dtype": str(runner.dtype), "kv": config.kv_cache_dtype, "block": config.block_size}
    h.update(json.dumps({**meta, "layout": layout}, sort_keys=True).encode() + hash_seed)
    params = list(runner.model.parameters())
    # fp8's per-head scales and int4's rotation are the same for every block: a block means nothing without them.
    shared = [t for layer in runner.kv_caches for t in _block_independent(layer)]
    for tensor in (params[0], params[len(params) // 2], params[-1], *shared):
        sample = tensor.detach().reshape(-1)[: 1 << 16].float().cpu().contiguous()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.digest()


def _block_independent(layer: LayerCache) -> list[torch.Tensor]:
    """A layer cache's tensors that are not indexed by block (per-head scales, a rotation)."""
    per_block = {id(t) for t in layer.per_block()}
    return [t for t in (layer.k_scale, layer.v_scale, layer.rotation) if t is not None and id(t) not in per_block]


def _ignore(event: KVEvent) -> None:
    """Where a tier used alone sends its events."""


class DiskTierBusy(RuntimeError):
    """Another process holds the directory's lock."""


class DiskTier:
    """Files of KV blocks in ``directory / fingerprint[:32]``, at most ``capacity_bytes``, LRU."""

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        fingerprint: bytes,
        block_bytes: int,
        *,
        events: KVEventLog | None = None,
    ) -> None:
        """``events``: the engine's KV event log; this tier's events (medium ``disk``) are emitted on the engine's
        thread, in order with the other tiers'. Blocks adopted at start-up are in ``hashes()`` (the publisher's
        first snapshot). None: a tier used alone, whose events go nowhere."""
        if capacity_bytes < block_bytes + _HEADER.size:
            raise ValueError(f"disk_cache_bytes {capacity_bytes} holds no block of {block_bytes} bytes")
        if len(fingerprint) != 32:
            raise ValueError("the fingerprint is a 32-byte digest")
        self.root, self._lock_file = self._claim_slot(Path(directory))
        self.dir = self.root / fingerprint.hex()[:32]
        self.dir.mkdir(exist_ok=True)
        self.fingerprint, self.block_bytes = fingerprint, block_bytes
        self.file_bytes = _HEADER.size + block_bytes
        self.num_blocks = capacity_bytes // self.file_bytes
        self._files: OrderedDict[BlockHash, None] = OrderedDict()
        """Blocks on disk or queued for it, least recently used first."""
        self._pending: dict[BlockHash, bytes] = {}
        self._mutex = threading.Lock()
        self.dropped = 0
        """Blocks not kept: the write queue was full or their write failed (``disk_blocks_dropped`` in the stats)."""
        self._emit: Callable[[KVEvent], None] = events.emit if events is not None else _ignore
        self._failed: list[BlockHash] = []
        """Blocks the writer thread could not write, for the engine's thread to announce as removed."""
        self.adopted = self._scan()
        self.read_bytes_s = self._measure_read()
        self._queue: queue.Queue[tuple[BlockHash, bytes] | None] = queue.Queue(WRITE_QUEUE)
        self._writer = threading.Thread(target=self._write_loop, name="kvmesh-disk-tier", daemon=True)
        self._writer.start()

    @staticmethod
    def _claim_slot(directory: Path, slots: int = 64):
        """The first of ``directory``, ``directory/slot-1``, ... no other process holds, and its lock."""
        for i in range(slots):
            root = directory / f"slot-{i}" if i else directory
            root.mkdir(parents=True, exist_ok=True)
            handle = (root / ".lock").open("a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            handle.truncate(0)
            handle.write(f"pid {os.getpid()}")
            handle.flush()
            return root, handle
        raise DiskTierBusy(f"all {slots} slots of disk cache directory {directory} are in use")

    def _scan(self) -> int:
        """Adopt the files a previous replica of this fingerprint left, oldest first, as many as fit; skip broken
        ones. No event: the publisher's first snapshot (``hashes()``) announces them."""
        found = []
        for path in self.dir.glob("*" + SUFFIX):
            try:
                stat = path.stat()
                block_hash = bytes.fromhex(path.stem)
            except (OSError, ValueError):
                continue
            if stat.st_size != self.file_bytes or len(block_hash) != 16:
                self._reject(path, f"{stat.st_size} bytes, a block file has {self.file_bytes}")
                continue
            found.append((stat.st_mtime, block_hash))
        found.sort()
        for _, block_hash in found[: -self.num_blocks]:  # past the capacity: the oldest go, unannounced
            self._path(block_hash).unlink(missing_ok=True)
        for _, block_hash in found[-self.num_blocks :]:
            self._files[block_hash] = None
        return len(self._files)

    def _reject(self, path: Path, why: str) -> None:
        log.warning("disk tier: skipping %s (%s)", path, why)
        path.unlink(missing_ok=True)

    def _measure_read(self) -> float:
        """Bytes/s of one block read from disk, not from the page cache (dropped first where the OS allows)."""
        probe = self.dir / ".probe"
        probe.write_bytes(os.urandom(min(self.block_bytes, 1 << 22)))
        fd = os.open(probe, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            size = len(os.read(fd, 1 << 22))
            elapsed = time.perf_counter() - start
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
        return max(size / max(elapsed, 1e-6), 1e6)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._files

    def __len__(self) -> int:
        return len(self._files)

    def hashes(self) -> list[BlockHash]:
        return list(self._files)

    def load_s(self) -> float:
        """Seconds one block's read takes at the measured bandwidth."""
        return self.file_bytes / self.read_bytes_s

    def put(self, block_hash: BlockHash, payload: bytes, wait: bool = False) -> None:
        """Keep ``payload`` (a block's bytes) for ``block_hash``; written by the writer thread. A full queue
        drops the block, unless ``wait`` (off the step's path: a replica spilling its cache on shutdown)."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(payload)}")
        self._announce_failures()
        if block_hash in self._files:
            self._files.move_to_end(block_hash)
            return
        try:
            self._queue.put((block_hash, payload), block=wait)
        except queue.Full:
            self.dropped += 1
            return
        with self._mutex:
            self._pending[block_hash] = payload
        self._files[block_hash] = None
        self._emit(BlockStored(block_hash, None, DISK))
        self._evict_over_capacity()

    def _announce_failures(self) -> None:
        if self._failed:
            with self._mutex:
                failed, self._failed = self._failed, []
            for block_hash in failed:
                if self._files.pop(block_hash, 0) is None:
                    self._emit(BlockRemoved(block_hash, DISK))

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The block's bytes, or None if it is not here or its file fails a check (then it is gone)."""
        self._announce_failures()
        if block_hash not in self._files:
            return None
        self._files.move_to_end(block_hash)
        with self._mutex:
            payload = self._pending.get(block_hash)
        if payload is not None:
            return payload
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except OSError as exc:
            self._files.pop(block_hash, None)
            self._emit(BlockRemoved(block_hash, DISK))
            log.warning("disk tier: cannot read %s (%s)", path, exc)
            return None
        why = self._check(data, block_hash)
        if why:
            self._files.pop(block_hash, None)
            self._emit(BlockRemoved(block_hash, DISK))
            self._reject(path, why)
            return None
        return data[_HEADER.size :]

    def _check(self, data: bytes, block_hash: BlockHash) -> str | None:
        if len(data) != self.file_bytes:
            return f"truncated: {len(data)} of {self.file_bytes} bytes"
        magic, fingerprint, stored_hash, size, checksum = _HEADER.unpack_from(data)
        if magic != MAGIC or fingerprint != self.fingerprint or stored_hash != block_hash:
            return "not a block of this model and cache layout"
        if size != self.block_bytes or xxhash.xxh3_64_intdigest(memoryview(data)[_HEADER.size :]) != checksum:
            return "checksum mismatch"
        return None

    def clear(self) -> None:
        """Forget every block and delete its file (a prefix-cache reset, whose ``AllBlocksCleared`` covers
        them)."""
        self.flush()
        for block_hash in list(self._files):
            self._path(block_hash).unlink(missing_ok=True)
        self._files.clear()

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._queue.join()

    @property
    def closed(self) -> bool:
        return self._lock_file.closed

    def close(self) -> None:
        """Write what is queued, stop the writer and release the directory."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        if not self._lock_file.closed:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def _evict_over_capacity(self) -> None:
        while len(self._files) > self.num_blocks:
            block_hash, _ = self._files.popitem(last=False)
            self._emit(BlockRemoved(block_hash, DISK))
            with self._mutex:
                queued = self._pending.pop(block_hash, None) is not None
            if not queued:  # a queued one is skipped by the writer (no longer pending)
                self._path(block_hash).unlink(missing_ok=True)

    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                block_hash, payload = item
                with self._mutex:
                    wanted = self._pending.get(block_hash) is payload
                if wanted:
                    self._write(block_hash, payload)
                with self._mutex:
                    if self._pending.get(block_hash) is payload:
                        del self._pending[block_hash]
                    elif wanted and block_hash not in self._files:  # evicted while being written
                        self._path(block_hash).unlink(missing_ok=True)
            except Exception as exc:  # the writer must outlive any one block: flush and close wait for it
                log.warning("disk tier: writing a block failed (%r); it is dropped", exc)
                self.dropped += 1
                with self._mutex:
                    self._pending.pop(item[0], None)
                    self._failed.append(item[0])
            finally:
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, payload: bytes) -> None:
        header = _HEADER.pack(MAGIC, self.fingerprint, block_hash, len(payload), xxhash.xxh3_64_intdigest(payload))
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(header)
            f.write(payload)
        tmp.replace(path)
