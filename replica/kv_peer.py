"""Prefix blocks between replicas over TCP: each replica serves its cached blocks and fetches a peer's.

A fetch is one connection: the receiver sends the chained hashes it wants (those of its own prompt it lacks,
``KVFetch`` from the router), the holder pins the leading ones it holds between two steps, copies them off
its engine thread and streams them in chunks of at most ``chunk_bytes`` (``replica/kv_transfer.py``'s
format); TCP's flow control bounds what is in flight to a chunk and the sockets' buffers. The receiver checks
each chunk (fingerprint, chain, checksums) and adopts what passed between two of its steps, so a failure
part-way keeps what came before it. Whatever goes wrong (unreachable, too slow, refused, corrupt, foreign,
the holder gone mid-transfer, no room) ends the fetch with a counted fallback: the request then recomputes
what it lacks, with no error to its client. Asyncio streams, not ZMQ or NIXL: the measurement that chose
them is in ``benchmarks/results/kv_transfer.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import torch
import xxhash

from kvmesh.core.hashing import BlockHash
from kvmesh.core.messages import EngineStats, KVFetch
from kvmesh.replica.async_llm import AsyncLLM
from kvmesh.replica.kv_transfer import (
    END,
    NO_PARENT,
    REFUSED,
    TransferRejected,
    check_chunk,
    encode_chunk,
    end_frame,
    parse_header,
    refusal,
)

log = logging.getLogger(__name__)

LENGTH = struct.Struct("<I")
CHUNK_BYTES = 16 << 20
"""Most bytes of blocks in one chunk: what the holder copies at once and the receiver checks at once."""
MAX_REQUEST = 1 << 22
"""Largest fetch request read (hashes of ~250k blocks)."""
RATE_WEIGHT = 0.3
"""Weight of the newest fetch in the moving average of the transfer rate routers are told."""


@dataclass
class TransferStats:
    """Counters since start: what this replica fetched and served, and why fetches fell back."""

    fetches: int = 0
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    served_blocks: int = 0
    served_bytes: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    bytes_s: float | None = None
    """Moving average of the fetch rate (bytes per second of blocks adopted); None before any."""


@dataclass
class _Progress:
    """How far a fetch got: connected to the holder, and blocks adopted."""

    connected: bool = False
    blocks: int = 0


class KVPeer:
    """Serves ``llm``'s blocks to peers at ``address`` and fetches theirs into it."""

    def __init__(
        self,
        llm: AsyncLLM,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise: str | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        """Listens on ``host``:``port`` (0: any free port); peers are told ``advertise`` (default ``host``), the
        address they reach it at when it listens on every interface."""
        self.llm, self.engine, self.exchange = llm, llm.engine, llm.engine.exchange
        self.fingerprint = self.engine.kv_fingerprint
        self.block_bytes = self.exchange.blocks.block_bytes
        self.chunk_blocks = max(1, chunk_bytes // self.block_bytes)
        self.host, self.port, self.advertise = host, port, advertise or host
        self.stats = TransferStats()
        self._server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        return f"tcp://{self.advertise}:{self.port}"

    async def start(self) -> str:
        """Listen for peers and measure a first transfer rate (``probe``); the address peers fetch from."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        await self.probe()
        return self.address

    async def probe(self) -> float:
        """Bytes per second of a chunk of zero blocks from this peer's own server, received and checksummed as
        a fetch's are: the rate routers price a fetch at before this replica has made one (real fetches then
        replace it in the moving average). Loopback: an upper bound for a peer on another node."""
        url = urlsplit(self.address)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        try:
            began = time.perf_counter()
            _send(writer, json.dumps({"fingerprint": self.fingerprint.hex(), "probe": self.chunk_blocks}).encode())
            (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
            _, count, _ = parse_header(await reader.readexactly(size), self.fingerprint, self.block_bytes)
            data = await reader.readexactly(count * self.block_bytes)
            await asyncio.to_thread(
                lambda: [
                    xxhash.xxh3_64_intdigest(data[i : i + self.block_bytes])
                    for i in range(0, len(data), self.block_bytes)
                ]
            )
            self.stats.bytes_s = len(data) / max(time.perf_counter() - began, 1e-6)
        finally:
            writer.close()
        return self.stats.bytes_s

    def stop(self) -> None:
        """Stop taking new transfers (those under way end when their connections do)."""
        if self._server is not None:
            self._server.close()

    def with_transfers(self, stats: EngineStats) -> EngineStats:
        """``stats`` with this peer's transfer rate (tokens per second, for routers) and counters."""
        s = self.stats
        rate = s.bytes_s * self.engine.block_size / self.block_bytes if s.bytes_s else None
        return replace(
            stats,
            fetch_tok_s=rate,
            kv_fetches=s.fetches,
            kv_fetched_blocks=s.fetched_blocks,
            kv_fetched_bytes=s.fetched_bytes,
            kv_fetch_seconds=s.fetch_seconds,
            kv_served_blocks=s.served_blocks,
            kv_served_bytes=s.served_bytes,
            kv_fetch_fallbacks=dict(s.fallbacks),
        )

    # ------------------------------------------------------------------ the holder's side
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
            if size > MAX_REQUEST:
                raise ValueError(f"a {size}-byte request")
            ask = json.loads(await reader.readexactly(size))
            if bytes.fromhex(ask["fingerprint"]) != self.fingerprint:
                _send(writer, refusal(self.fingerprint, "another model or cache layout"))
            elif "probe" in ask:
                zeros = torch.zeros((min(int(ask["probe"]), self.chunk_blocks), self.block_bytes), dtype=torch.uint8)
                head, payload = encode_chunk(self.fingerprint, [NO_PARENT] * len(zeros), [None] * len(zeros), zeros)
                _send(writer, head)
                writer.write(payload)
            else:
                parent = bytes.fromhex(ask["parent"]) if ask.get("parent") else None
                await self._stream(writer, [bytes.fromhex(h) for h in ask["hashes"]], parent)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ValueError, KeyError) as exc:
            log.info("KV transfer to %s ended: %r", writer.get_extra_info("peername"), exc)
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, hashes: list[BlockHash], parent: BlockHash | None) -> None:
        """Pin the leading ``hashes`` held here, send them chunk by chunk, unpin them; then the end frame."""
        export = await self.llm.between_steps(lambda: self.exchange.pin(hashes))
        try:
            await asyncio.to_thread(export.ready.result)
            held = export.hashes
            for start in range(0, len(held), self.chunk_blocks):
                end = min(start + self.chunk_blocks, len(held))
                parents = [held[start - 1] if start else parent, *held[start : end - 1]]
                frames = await asyncio.to_thread(
                    lambda s=start, e=end, p=parents: encode_chunk(
                        self.fingerprint, held[s:e], p, self.exchange.gather(export, s, e)
                    )
                )
                _send(writer, frames[0])
                writer.write(frames[1])
                await writer.drain()
                self.stats.served_blocks += end - start
                self.stats.served_bytes += (end - start) * self.block_bytes
            _send(writer, end_frame(self.fingerprint))
        finally:
            await self.llm.between_steps(lambda: self.exchange.unpin(export))

    # ------------------------------------------------------------------ the receiver's side
    async def fetch(
        self,
        plan: KVFetch,
        hashes: list[BlockHash],
        *,
        token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        timeout_s: float = 5.0,
    ) -> int:
        """Pull the blocks of ``hashes[:plan.num_blocks]`` this engine lacks from ``plan``'s holder and adopt
        them, for at most ``timeout_s``; how many leading blocks this engine then holds. Never raises for the
        transfer: a failure is counted under its reason and the rest is recomputed by the request."""
        wanted = hashes[: plan.num_blocks]
        start = self.exchange.local_depth(wanted)
        if start >= len(wanted):
            return start
        stats, began, progress = self.stats, time.perf_counter(), _Progress()
        stats.fetches += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self._pull(plan.address, wanted, start, progress, token_ids, cache_salt)
        except TransferRejected as exc:
            self._fell_back(exc.reason, plan, exc)
        except TimeoutError as exc:
            self._fell_back("timeout", plan, exc)
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._fell_back("holder_lost" if progress.connected else "unreachable", plan, exc)
        got, seconds = progress.blocks, time.perf_counter() - began
        stats.fetch_seconds += seconds
        if got:
            stats.fetched_blocks += got
            stats.fetched_bytes += got * self.block_bytes
            rate = got * self.block_bytes / max(seconds, 1e-6)
            stats.bytes_s = rate if stats.bytes_s is None else (1 - RATE_WEIGHT) * stats.bytes_s + RATE_WEIGHT * rate
        return start + got

    def _fell_back(self, reason: str, plan: KVFetch, exc: BaseException) -> None:
        self.stats.fallbacks[reason] += 1
        log.info("KV fetch from %s (%s) fell back to recompute: %s: %r", plan.holder, plan.address, reason, exc)

    async def _pull(
        self,
        address: str,
        wanted: list[BlockHash],
        start: int,
        progress: _Progress,
        token_ids: list[int] | None,
        cache_salt: str | None,
    ) -> None:
        """Fetch ``wanted[start:]`` and adopt each checked chunk, counting in ``progress`` (it outlives a failure
        part-way)."""
        url = urlsplit(address)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        progress.connected = True
        try:
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            parent = wanted[start - 1] if start else None
            ask = {"fingerprint": self.fingerprint.hex(), "hashes": [h.hex() for h in wanted[start:]]}
            ask["parent"] = parent.hex() if parent else None
            _send(writer, json.dumps(ask).encode())
            while True:
                (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                status, count, rest = parse_header(await reader.readexactly(size), self.fingerprint, self.block_bytes)
                if status == END:
                    return
                if status == REFUSED:
                    raise TransferRejected("refused", rest.decode(errors="replace"))
                data = bytearray(await reader.readexactly(count * self.block_bytes))
                payload = torch.frombuffer(data, dtype=torch.uint8).view(count, self.block_bytes)
                first = start + progress.blocks
                try:
                    await asyncio.to_thread(check_chunk, rest, payload, wanted[first:], parent)
                    passed, failure = count, None
                except TransferRejected as exc:
                    passed, failure = exc.passed, exc
                held = await self._adopt(wanted, first, passed, payload, parent, token_ids, cache_salt)
                progress.blocks += held
                if failure is not None:
                    raise failure
                if held < passed:
                    raise TransferRejected("no_room", f"{passed - held} blocks found no free KV block")
                parent = wanted[first + passed - 1]
        finally:
            writer.close()

    async def _adopt(self, wanted, first, count, payload, parent, token_ids, cache_salt) -> int:
        """Adopt ``count`` checked blocks ``wanted[first:]`` between two steps; how many were adopted."""
        if not count:
            return 0
        size = self.engine.block_size
        tokens = None
        if token_ids is not None:
            tokens = [token_ids[i * size : (i + 1) * size] for i in range(first, first + count)]
        hashes = wanted[first : first + count]
        return await self.llm.between_steps(
            lambda: self.exchange.adopt(hashes, parent, payload[:count], token_ids=tokens, cache_salt=cache_salt)
        )


def _send(writer: asyncio.StreamWriter, frame: bytes) -> None:
    writer.write(LENGTH.pack(len(frame)) + frame)
