"""The receiving end of a KV fetch: reserve room, read each chunk, check it and adopt it between steps.

Free blocks for the whole fetch are reserved before the holder is asked (what does not fit falls back as
``no_room``), so on a host cache (``BlockBytes.direct``) each chunk is read from the socket straight into the
reserved blocks' rows and checksummed where it lies: no buffer, no copy after the read. A device cache is
read into a reused host buffer and copied in after the check. A chunk is checked and committed while the
next one arrives; a failure part-way keeps the blocks committed before it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.core.hashing import BlockHash
from kvmesh.replica.async_llm import AsyncLLM
from kvmesh.replica.kv_exchange import Reservation
from kvmesh.replica.kv_link import ChunkBuffers, Link
from kvmesh.replica.kv_transfer import (
    END,
    PREFILLED,
    REFUSED,
    BlockBytes,
    TransferRejected,
    parse_header,
    read_entries,
    row_digests,
    verify,
)


@dataclass
class Adoption:
    """What a fetch's blocks are adopted with: the prompt's tokens, salt and adapter (for the KV events), whether
    they form one chain."""

    token_ids: list[int] | None
    cache_salt: str | None
    chained: bool
    prefill: bool = False
    """The holder computes the prompt (``token_ids``) first (on the adapter ``lora_name``)."""
    lora_name: str | None = None


@dataclass
class Progress:
    """How far a fetch got: connected to the holder, and blocks adopted."""

    connected: bool = False
    blocks: int = 0
    computed: int = 0
    """Prompt tokens the holder computed for this fetch (a prefill asked for), not cache hits there."""
    prefilled_at: float | None = None
    """When the holder said its prefill was done: the transfer's own time starts there."""


class Receiver:
    """Fetches a holder's blocks into ``llm``'s engine, reading chunks into ``buffers`` where it must."""

    def __init__(self, llm: AsyncLLM, buffers: ChunkBuffers) -> None:
        self.llm, self.exchange, self.buffers = llm, llm.engine.exchange, buffers
        self.fingerprint, self.block_size = llm.engine.kv_fingerprint, llm.engine.block_size
        self.block_bytes = self.exchange.blocks.block_bytes

    async def pull(
        self,
        address: str,
        wanted: list[BlockHash],
        start: int,
        progress: Progress,
        adoption: Adoption,
    ) -> None:
        """Reserve free blocks for ``wanted[start:]`` (as many as fit), fetch those and adopt each checked chunk,
        counting in ``progress`` (it outlives a failure part-way); what is not committed is released."""
        reservation = await self.llm.between_steps(lambda: self.exchange.reserve(wanted[start:]))
        try:
            fits = len(reservation.slots)
            if fits:
                await asyncio.to_thread(reservation.ready.result)
                hashes, ids, size = wanted[start : start + fits], adoption.token_ids, self.block_size
                tokens = None if ids is None else [ids[i * size : (i + 1) * size] for i in range(start, start + fits)]
                landing = _Landing(reservation, hashes, wanted[start - 1] if start else None, tokens)
                await self._receive(address, landing, progress, adoption)
            if start + fits < len(wanted):
                raise TransferRejected("no_room", f"{len(wanted) - start - fits} blocks found no free KV block")
        finally:
            await self.llm.between_steps(lambda: self.exchange.release(reservation))

    async def _receive(self, address: str, landing: _Landing, progress: Progress, adoption: Adoption) -> None:
        """Ask the holder for ``landing``'s blocks and receive them chunk by chunk, each straight into its
        reserved blocks on a ``direct`` cache (else into a buffer copied in after the check); a chunk is
        checked and committed while the next one arrives."""
        link = await Link.open(address)
        progress.connected = True
        adopting: asyncio.Task | None = None  # the previous chunk's adoption, while this one arrives
        try:
            ask = {"fingerprint": self.fingerprint.hex(), "hashes": [h.hex() for h in landing.hashes]}
            ask["parent"] = landing.parent.hex() if landing.parent else None
            if adoption.prefill:
                ask["prefill"] = {"tokens": adoption.token_ids, "cache_salt": adoption.cache_salt}
                ask["prefill"]["lora_name"] = adoption.lora_name
            await link.send(json.dumps(ask).encode())
            first = 0
            while True:
                status, count, rest = parse_header(await link.frame(), self.fingerprint, self.block_bytes)
                if status == END:
                    return
                if status == REFUSED:
                    raise TransferRejected("refused", rest.decode(errors="replace"))
                if status == PREFILLED:
                    progress.computed, progress.prefilled_at = count, time.perf_counter()
                    continue
                parent = landing.hashes[first - 1] if first else landing.parent
                checksums, chained = read_entries(rest, count, landing.hashes[first:], parent)
                buffer = self.buffers.take(count)
                if self.exchange.blocks.direct:
                    blocks = self.exchange.landing(landing.reservation, first, first + count, buffer)
                    await link.read_into_views([v for block in blocks for v in block])
                else:
                    blocks = buffer[:count]
                    await link.read_into(memoryview(blocks.numpy()).cast("B"))
                await _settle(adopting, progress)
                chunk = _Chunk(first, count, checksums, chained, blocks, buffer)
                adopting = asyncio.ensure_future(self._adopt(landing, chunk, adoption))
                first += count
        finally:
            link.close()
            await _settle(adopting, progress)

    async def _adopt(self, landing: _Landing, chunk: _Chunk, adoption: Adoption) -> tuple[int, TransferRejected | None]:
        """Check a received chunk, copy it into its reserved blocks (a cache that is not ``direct``) and commit
        the blocks that passed (between two steps); the leading blocks of ``landing`` then held, and the
        failure that ends the transfer, if any."""
        digests = await asyncio.to_thread(chunk.digests)
        try:
            verify(chunk.checksums, digests, chunk.chained)
            passed, failure = chunk.count, None
        except TransferRejected as exc:
            passed, failure = exc.passed, exc
        if passed and not self.exchange.blocks.direct:
            await asyncio.to_thread(self.exchange.fill, landing.reservation, chunk.first, chunk.blocks[:passed])
        self.buffers.give(chunk.buffer)
        end = chunk.first + passed
        held = await self.llm.between_steps(
            lambda: self.exchange.commit(
                landing.reservation,
                end,
                landing.hashes,
                landing.parent,
                token_ids=landing.tokens,
                cache_salt=adoption.cache_salt,
                chained=adoption.chained,
                lora_name=adoption.lora_name,
            )
        )
        if failure is None and held < end:
            failure = TransferRejected("no_room", f"{end - held} blocks were evicted before they could be adopted")
        return held, failure


@dataclass
class _Landing:
    """Where a fetch's blocks go: the reservation for ``hashes`` (blocks after ``parent`` in the prompt's chain),
    and each block's ``tokens`` (for the KV events; None where the prompt's are not known)."""

    reservation: Reservation
    hashes: list[BlockHash]
    parent: BlockHash | None
    tokens: list[list[int]] | None


@dataclass
class _Chunk:
    """A received chunk: blocks ``first:first+count`` of its landing, their checksums and chained count
    (``read_entries``), and their bytes: ``blocks`` (per block its views on a ``direct`` cache, else the rows
    of ``buffer``)."""

    first: int
    count: int
    checksums: list[int]
    chained: int
    blocks: Any
    buffer: torch.Tensor

    def digests(self) -> list[int]:
        if isinstance(self.blocks, torch.Tensor):
            return row_digests(self.blocks)
        return [BlockBytes.digest(views) for views in self.blocks]


async def _settle(adopting: asyncio.Task | None, progress: Progress) -> None:
    """Wait for a chunk's adoption, count what is held, raise its failure."""
    if adopting is None:
        return
    held, failure = await adopting
    progress.blocks = held
    if failure is not None:
        raise failure
