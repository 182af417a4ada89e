"""Prefix blocks between replicas over TCP: each replica serves its cached blocks and fetches a peer's.

A fetch is one connection: the receiver (``replica/kv_receive.py``) reserves room, sends the chained hashes it
wants (those of its own prompt it lacks, ``KVFetch`` from the router), the holder pins the leading ones it
holds between two steps, copies them off its engine thread and streams them in chunks of at most
``chunk_bytes`` (``replica/kv_transfer.py``'s format); TCP's flow control bounds what is in flight to a chunk
and the sockets' buffers. Whatever goes wrong (unreachable, too slow, refused, corrupt, foreign, the holder
gone mid-transfer, no room) ends the fetch with a counted fallback: the request then recomputes what it
lacks, with no error to its client. Plain TCP (``replica/kv_link.py``), not ZMQ or NIXL: the measurement that
chose it is in ``benchmarks/results/kv_transfer.md``. Scaling rides on the same server (``hot``, ``take``:
``replica/kv_scaling.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvmesh.core.hashing import BlockHash
from kvmesh.core.messages import EngineStats, KVFetch
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.replica.async_llm import AsyncLLM
from kvmesh.replica.kv_link import ChunkBuffers, Link, probe_chain
from kvmesh.replica.kv_receive import Adoption, Progress, Receiver
from kvmesh.replica.kv_transfer import (
    END,
    TransferRejected,
    check_chunk,
    encode_chunk,
    end_frame,
    parse_header,
    prefilled_frame,
    refusal,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 << 20
"""Most bytes of blocks in one chunk: what the holder copies at once and the receiver checks at once."""
RATE_WEIGHT = 0.3
"""Weight of the newest fetch in the moving average of the transfer rate routers are told."""


@dataclass
class TransferStats:
    """Counters since start: what this replica fetched and served, and why fetches fell back."""

    fetches: int = 0
    prefills: int = 0
    """Prompts this replica prefilled for a peer that decodes them (conditional disaggregation)."""
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0
    served_blocks: int = 0
    served_bytes: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    bytes_s: float | None = None
    """Moving average of the fetch rate (bytes per second of blocks adopted); None before any."""


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
        self.chunk_blocks = max(1, chunk_bytes // max(1, self.block_bytes))  # 0 bytes: a simulated engine
        self.buffers = ChunkBuffers(self.chunk_blocks, self.block_bytes)
        self.receiver = Receiver(llm, self.buffers)
        self.host, self.port, self.advertise = host, port, advertise or host
        self.stats = TransferStats()
        self.draining = False
        """Set once this replica hands its blocks off: it takes no peer's blocks any more."""
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._serving: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"tcp://{self.advertise}:{self.port}"

    async def start(self) -> str:
        """Listen for peers and measure a first transfer rate (``probe``); the address peers fetch from."""
        family, both = (socket.AF_INET6, self.host == "::") if ":" in self.host else (socket.AF_INET, False)
        self._listener = socket.create_server(
            (self.host, self.port), family=family, backlog=64, dualstack_ipv6=both and socket.has_dualstack_ipv6()
        )
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        await self.probe()
        return self.address

    async def probe(self, address: str | None = None, blocks: int | None = None) -> float:
        """Bytes per second of ``blocks`` zero blocks (default: one chunk) from the peer at ``address`` (default:
        this one), sent, received and checksummed as a fetch's are but without pinning, copying or adopting any.
        At start, from itself: the rate routers price a fetch at before this replica has made one (real fetches
        then replace it in the moving average); loopback, so an upper bound for a peer on another node."""
        began = time.perf_counter()
        link = await Link.open(address or self.address)
        try:
            ask = {"fingerprint": self.fingerprint.hex(), "probe": blocks or self.chunk_blocks}
            await link.send(json.dumps(ask).encode())
            received, buffer = 0, torch.empty((self.chunk_blocks, self.block_bytes), dtype=torch.uint8)
            while True:
                status, count, entries = parse_header(await link.frame(), self.fingerprint, self.block_bytes)
                if status == END:
                    break
                await link.read_into(memoryview(buffer[:count].numpy()).cast("B"))
                await asyncio.to_thread(check_chunk, entries, buffer[:count], probe_chain(count), None)
                received += count * self.block_bytes
        finally:
            link.close()
        rate = received / max(time.perf_counter() - began, 1e-6)
        if address is None:
            self.stats.bytes_s = rate
        return rate

    async def take(self, address: str, hashes: list[BlockHash], timeout_s: float = 30.0) -> int:
        """Fetch the hot blocks ``hashes`` (not one chain) from the peer at ``address``; how many it now holds."""
        plan = KVFetch(holder=address, address=address, num_blocks=len(hashes))
        return await self.fetch(plan, hashes, timeout_s=timeout_s, chained=False)

    async def ask(self, address: str, request: dict, timeout_s: float = 60.0) -> Any:
        """A peer's JSON answer to ``request`` (``hot``: its hottest hashes; ``take``: fetch blocks from us)."""
        async with asyncio.timeout(timeout_s):
            link = await Link.open(address)
            try:
                await link.send(json.dumps({"fingerprint": self.fingerprint.hex(), **request}).encode())
                return json.loads(await link.frame())
            finally:
                link.close()

    def stop(self) -> None:
        """Stop taking new transfers (those under way end when their connections do)."""
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()

    def with_transfers(self, stats: EngineStats) -> EngineStats:
        """``stats`` with this peer's transfer rate (tokens per second, for routers) and counters."""
        s = self.stats
        rate = s.bytes_s * self.engine.block_size / self.block_bytes if s.bytes_s else None
        return replace(
            stats,
            fetch_tok_s=rate,
            kv_fetches=s.fetches,
            kv_prefills=s.prefills,
            kv_fetched_blocks=s.fetched_blocks,
            kv_fetched_bytes=s.fetched_bytes,
            kv_fetch_seconds=s.fetch_seconds,
            kv_served_blocks=s.served_blocks,
            kv_served_bytes=s.served_bytes,
            kv_fetch_fallbacks=dict(s.fallbacks),
        )

    # ------------------------------------------------------------------ the holder's side
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            task = loop.create_task(self._serve(Link.over(sock)))
            self._serving.add(task)  # a reference, so the task is not collected mid-transfer
            task.add_done_callback(self._serving.discard)

    async def _serve(self, link: Link) -> None:
        try:
            ask = json.loads(await link.frame())
            if bytes.fromhex(ask["fingerprint"]) != self.fingerprint:
                await link.send(refusal(self.fingerprint, "another model or cache layout"))
            elif "probe" in ask:
                await self._send_zeros(link, int(ask["probe"]))
            elif "hot" in ask:
                hot = await self.llm.between_steps(lambda: self.engine.pool.hottest(int(ask["hot"])))
                await link.send(json.dumps([h.hex() for h in hot]).encode())
            elif "take" in ask and self.draining:  # it is leaving too: the blocks must go to a survivor
                await link.send(json.dumps({"draining": True}).encode())
            elif "take" in ask:
                took = await self.take(ask["take"]["address"], [bytes.fromhex(h) for h in ask["take"]["hashes"]])
                await link.send(json.dumps({"took": took}).encode())
            else:
                if "prefill" in ask:  # conditional disaggregation: compute the prompt here first
                    prefill = ask["prefill"]
                    computed = await self._prefill(
                        prefill["tokens"], prefill.get("cache_salt"), prefill.get("lora_name")
                    )
                    await link.send(prefilled_frame(self.fingerprint, computed))
                parent = bytes.fromhex(ask["parent"]) if ask.get("parent") else None
                await self._stream(link, [bytes.fromhex(h) for h in ask["hashes"]], parent)
        except (OSError, ValueError, KeyError) as exc:
            log.info("KV transfer to %s ended: %r", link.peer, exc)
        finally:
            link.close()

    async def _prefill(self, tokens: list[int], cache_salt: str | None, lora_name: str | None) -> int:
        """Compute ``tokens``' KV (on adapter ``lora_name``) into this engine's prefix cache (one greedy token,
        dropped) for a peer that decodes the request; counted in ``prefills``. How many of them it computed
        (the rest were cached)."""
        params, cached, rid = SamplingParams(max_tokens=1, temperature=0), 0, f"prefill-{uuid.uuid4().hex}"
        async for out in self.llm.generate(tokens, params, request_id=rid, cache_salt=cache_salt, lora_name=lora_name):
            cached = out.num_cached_tokens
        self.stats.prefills += 1
        return len(tokens) - cached

    async def _send_zeros(self, link: Link, blocks: int) -> None:
        """A probe's answer: ``blocks`` zero blocks in chunks, then the end frame."""
        zeros = torch.zeros((min(blocks, self.chunk_blocks), self.block_bytes), dtype=torch.uint8)
        for start in range(0, blocks, len(zeros)):
            count = min(len(zeros), blocks - start)
            chain = probe_chain(count)
            head, payload = encode_chunk(self.fingerprint, chain, [None, *chain[:-1]], zeros[:count])
            await link.send(head)
            await link.write(payload)
        await link.send(end_frame(self.fingerprint))

    async def _stream(self, link: Link, hashes: list[BlockHash], parent: BlockHash | None) -> None:
        """Pin the leading ``hashes`` held here, send them chunk by chunk (the next one copied into a second
        buffer while this one is sent), unpin them; then the end frame."""
        export = await self.llm.between_steps(lambda: self.exchange.pin(hashes))
        buffers = [self.buffers.take(), self.buffers.take()]
        upcoming: asyncio.Future | None = None
        try:
            await asyncio.to_thread(export.ready.result)
            held = export.hashes

            def frames(start: int) -> list:
                end = min(start + self.chunk_blocks, len(held))
                parents = [held[start - 1] if start else parent, *held[start : end - 1]]
                payload = self.exchange.gather(export, start, end, buffers[start // self.chunk_blocks % 2])
                return encode_chunk(self.fingerprint, held[start:end], parents, payload)

            starts = range(0, len(held), self.chunk_blocks)
            upcoming = asyncio.ensure_future(asyncio.to_thread(frames, 0)) if held else None
            for start in starts:
                head, payload = await upcoming
                if start + self.chunk_blocks < len(held):
                    upcoming = asyncio.ensure_future(asyncio.to_thread(frames, start + self.chunk_blocks))
                await link.send(head)
                await link.write(payload)
                count = min(self.chunk_blocks, len(held) - start)
                self.stats.served_blocks += count
                self.stats.served_bytes += count * self.block_bytes
            await link.send(end_frame(self.fingerprint))
        finally:
            if upcoming is not None and not upcoming.done():
                await asyncio.wait([upcoming])  # its copy reads pinned blocks: done before they are unpinned
            await self.llm.between_steps(lambda: self.exchange.unpin(export))
            for buffer in buffers:
                self.buffers.give(buffer)

    # ------------------------------------------------------------------ the receiver's side
    async def fetch(
        self,
        plan: KVFetch,
        hashes: list[BlockHash],
        *,
        token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        timeout_s: float = 5.0,
        chained: bool = True,
    ) -> int:
        """Pull the blocks of ``hashes[:plan.num_blocks]`` this engine lacks from ``plan``'s holder and adopt
        them, for at most ``timeout_s``; how many leading blocks this engine then holds. Never raises for the
        transfer: a failure is counted under its reason and the rest is recomputed by the request.
        ``chained`` False: separate hot blocks, not a prompt's chain (``take``). ``lora_name``: the adapter whose KV
        the blocks are (their events name it)."""
        adoption = Adoption(token_ids, cache_salt, chained, lora_name=lora_name)
        return (await self._fetch(plan, hashes, adoption, timeout_s))[0]

    async def fetch_prefilled(
        self,
        plan: KVFetch,
        hashes: list[BlockHash],
        token_ids: list[int],
        cache_salt: str | None,
        timeout_s: float,
        lora_name: str | None = None,
    ) -> int:
        """``fetch`` with the holder computing the prompt ``token_ids`` first (conditional disaggregation): how
        many prompt tokens the holder computed for it (its cache hits excluded: the request's usage counts
        those as cached; 0 if the prefill did not complete)."""
        adoption = Adoption(token_ids, cache_salt, True, prefill=True, lora_name=lora_name)
        return (await self._fetch(plan, hashes, adoption, timeout_s))[1]

    async def _fetch(
        self, plan: KVFetch, hashes: list[BlockHash], adoption: Adoption, timeout_s: float
    ) -> tuple[int, int]:
        wanted = hashes[: plan.num_blocks]
        start = self.exchange.local_depth(wanted)
        if start >= len(wanted):
            return start, 0
        stats, began, progress = self.stats, time.perf_counter(), Progress()
        stats.fetches += 1
        try:
            async with asyncio.timeout(timeout_s):
                await self.receiver.pull(plan.address, wanted, start, progress, adoption)
        except TransferRejected as exc:
            self._fell_back(exc.reason, plan, exc)
        except TimeoutError as exc:
            self._fell_back("timeout", plan, exc)
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._fell_back("holder_lost" if progress.connected else "unreachable", plan, exc)
        now, got = time.perf_counter(), progress.blocks
        stats.fetch_seconds += now - began
        if got:
            stats.fetched_blocks += got
            stats.fetched_bytes += got * self.block_bytes
            # The rate routers price fetches at is the transfer's, not the holder's prefill before it.
            rate = got * self.block_bytes / max(now - (progress.prefilled_at or began), 1e-6)
            stats.bytes_s = rate if stats.bytes_s is None else (1 - RATE_WEIGHT) * stats.bytes_s + RATE_WEIGHT * rate
        return start + got, progress.computed

    def _fell_back(self, reason: str, plan: KVFetch, exc: BaseException) -> None:
        self.stats.fallbacks[reason] += 1
        log.info("KV fetch from %s (%s) fell back to recompute: %s: %r", plan.holder, plan.address, reason, exc)
