"""KV blocks between replicas: their bytes, their wire format and the checks an importer makes.

A block travels as its bytes in the layout the disk tier stores (``replica/disk_tier.py``: every per-block
tensor of every layer, layer by layer), under a header naming the cache's fingerprint (the disk tier's:
model, weight sample, dtypes, block size, layout), then one entry per block: its chained hash, its parent's
hash and an xxh3 checksum of its bytes. An importer adopts a block only if the fingerprint is its own, the
hash is the one it asked for at that position of its own chain, the parent is the block before it, and the
bytes match the checksum: nothing is ever served from bytes that failed one of these.

``BlockBytes`` moves a batch of blocks between the device cache and one ``[n, block_bytes]`` uint8 tensor
with one gather or scatter per cache tensor, not one copy per block.
"""

from __future__ import annotations

import struct

import torch
import xxhash

from kvmesh.core.hashing import BlockHash
from kvmesh.kernels.quant import as_bytes
from kvmesh.replica.context import LayerCache

MAGIC = b"KVMESHX1"
CHUNK = struct.Struct("<8sB32sIQ")
"""A chunk's header: magic, status, the sender's cache fingerprint, block count, bytes per block."""
ENTRY = struct.Struct("<16s16sQ")
"""Per block, after the header: its hash, its parent's hash (zeros for block 0), xxh3_64 of its bytes."""
NO_PARENT = bytes(16)

OK, END, REFUSED, PREFILLED = 0, 1, 2, 3
"""Chunk statuses: blocks follow; the transfer is complete; the holder refuses (its reason follows); the
holder prefilled the prompt asked for, computing ``count`` of its tokens (the rest it had cached)."""


class TransferRejected(ValueError):
    """A transfer failed a check; ``reason`` is the fallback it is counted under, ``passed`` how many blocks of
    the chunk before the failure passed every check (its receiver may adopt those)."""

    def __init__(self, reason: str, detail: str, passed: int = 0) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.passed = reason, passed


def encode_chunk(fingerprint: bytes, hashes: list[BlockHash], parents: list[BlockHash | None], payload) -> list:
    """The frames of one chunk: its header and entries, then the blocks' bytes (``payload``: ``[n, block_bytes]``
    uint8, contiguous, on the host)."""
    rows = payload.numpy()
    digest = xxhash.xxh3_64_intdigest
    entries = b"".join(ENTRY.pack(h, p or NO_PARENT, digest(r)) for h, p, r in zip(hashes, parents, rows, strict=True))
    header = CHUNK.pack(MAGIC, OK, fingerprint, len(hashes), rows.shape[1] if len(hashes) else 0)
    return [header + entries, memoryview(rows).cast("B")]


def end_frame(fingerprint: bytes) -> bytes:
    return CHUNK.pack(MAGIC, END, fingerprint, 0, 0)


def prefilled_frame(fingerprint: bytes, computed_tokens: int) -> bytes:
    return CHUNK.pack(MAGIC, PREFILLED, fingerprint, computed_tokens, 0)


def refusal(fingerprint: bytes, why: str) -> bytes:
    return CHUNK.pack(MAGIC, REFUSED, fingerprint, 0, 0) + why.encode()


def parse_header(head: bytes, fingerprint: bytes, block_bytes: int) -> tuple[int, int, bytes]:
    """A chunk header's status and block count, and what follows it (entries, or a refusal's reason); raises
    ``TransferRejected`` for a foreign cache or a malformed header."""
    if len(head) < CHUNK.size:
        raise TransferRejected("malformed", f"a {len(head)}-byte header")
    magic, status, theirs, count, size = CHUNK.unpack_from(head)
    if magic != MAGIC:
        raise TransferRejected("malformed", "not a kvmesh KV transfer")
    if theirs != fingerprint:
        raise TransferRejected("foreign", "the holder's cache fingerprint differs (model, weights, dtypes or layout)")
    if status == OK and size != block_bytes:
        raise TransferRejected("malformed", f"{size}-byte blocks, this cache's are {block_bytes}")
    return status, count, head[CHUNK.size :]


def read_entries(
    entries: bytes, count: int, expected: list[BlockHash], parent: BlockHash | None
) -> tuple[list[int], int]:
    """A chunk's per-block checksums, and how many of its leading blocks are the hashes ``expected`` names at
    their positions, each following its parent (``parent`` for the first): checked before its bytes arrive."""
    if len(entries) != count * ENTRY.size or count > len(expected):
        raise TransferRejected("malformed", f"{len(entries)} bytes of entries for {count} blocks of {len(expected)}")
    checksums, chained = [], count
    for i in range(count):
        h, p, checksum = ENTRY.unpack_from(entries, i * ENTRY.size)
        if chained == count and (h != expected[i] or (p if p != NO_PARENT else None) != parent):
            chained = i
        checksums.append(checksum)
        parent = h
    return checksums, chained


def verify(checksums: list[int], digests: list[int], chained: int) -> None:
    """Raise ``TransferRejected`` at a chunk's first block that fails a check: its checksum (``digests``: its
    bytes' xxh3_64), or its place in the chain (from ``chained`` on); with the count that passed before it."""
    for i, (want, got) in enumerate(zip(checksums[:chained], digests, strict=False)):
        if want != got:
            raise TransferRejected("corrupt", f"block {i} fails its checksum", i)
    if chained < len(checksums):
        raise TransferRejected("wrong_chain", f"block {chained} is not the one asked for at its position", chained)


def row_digests(payload: torch.Tensor) -> list[int]:
    """xxh3_64 of each row of ``payload`` (``[n, block_bytes]`` uint8 on the host)."""
    return [xxhash.xxh3_64_intdigest(r) for r in payload.numpy()]


def check_chunk(entries: bytes, payload: torch.Tensor, expected: list[BlockHash], parent: BlockHash | None) -> None:
    """Check every block of a chunk received into ``payload``: each must be the hash ``expected`` names at its
    position, follow its parent (``parent`` for the first) and match its checksum (``TransferRejected`` at
    the first that does not, with the count of those before it that passed)."""
    checksums, chained = read_entries(entries, payload.shape[0], expected, parent)
    verify(checksums, row_digests(payload), chained)


class BlockBytes:
    """Batches of blocks between a runner's device cache and host bytes (``[n, block_bytes]`` uint8).

    Each cache tensor is moved as the widest integer type that tiles its row (int64 for most): torch's
    gathers and scatters go element by element, several times faster on 8-byte elements than on bytes.
    A cache in host memory is also ``direct``: a block's bytes are its rows in each tensor (``views``), which a
    socket can read into with no copy after it."""

    def __init__(self, kv_caches: list[LayerCache]) -> None:
        cache = [t for layer in kv_caches for t in layer.per_block()]
        rows = [as_bytes(t).view(torch.uint8).flatten(1) for t in cache]
        self.block_bytes = sum(r.shape[1] for r in rows)
        self.spans: list[tuple[int, int, torch.dtype]] = []
        """Per tensor: its bytes' offset and width in a block's row, and the type it moves as."""
        self.tensors: list[torch.Tensor] = []
        offset = 0
        for row in rows:
            width = row.shape[1]
            unit = next(u for u in (8, 4, 2, 1) if width % u == offset % u == self.block_bytes % u == 0)
            dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[unit]
            self.tensors.append(row.view(dtype))
            self.spans.append((offset, width, dtype))
            offset += width
        views = all(r.data_ptr() == t.data_ptr() and r.is_contiguous() for r, t in zip(rows, cache, strict=True))
        self.direct = bool(rows) and rows[0].device.type == "cpu" and views  # no rows: a simulated engine
        self._host_rows = [r.numpy() for r in rows] if self.direct else []

    def views(self, block_id: int) -> list:
        """A host cache's block as its rows in each tensor (writable arrays), in the wire's order."""
        return [rows[block_id] for rows in self._host_rows]

    @staticmethod
    def digest(views: list) -> int:
        """xxh3_64 of a block's bytes given as ``views``: the same as of its bytes in one row."""
        h = xxhash.xxh3_64()
        for v in views:
            h.update(v)
        return h.intdigest()

    def gather(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' bytes on the host, one row per block, in the disk tier's layout: ``out``'s leading rows
        when given (a host buffer reused from chunk to chunk costs no page faults), else a new tensor. From a
        CPU cache each tensor is gathered straight into its columns: one copy."""
        index = torch.tensor(block_ids, device=self.tensors[0].device)
        if out is None:
            out = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8)
        rows = out[: len(block_ids)]
        if index.device.type != "cpu":
            return rows.copy_(torch.cat([t.index_select(0, index).view(torch.uint8) for t in self.tensors], dim=1))
        for t, (offset, width, dtype) in zip(self.tensors, self.spans, strict=True):
            torch.index_select(t, 0, index, out=rows[:, offset : offset + width].view(dtype))
        return rows

    def scatter(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Write ``payload``'s rows into the blocks ``block_ids``."""
        device = self.tensors[0].device
        index = torch.tensor(block_ids, device=device)
        payload = payload.to(device)
        for t, (offset, width, dtype) in zip(self.tensors, self.spans, strict=True):
            t.index_copy_(0, index, payload[:, offset : offset + width].view(dtype))
