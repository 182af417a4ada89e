"""The wire under KV transfers between replicas: length-prefixed frames over a non-blocking socket.

Both ends use ``Link``: it reads straight into the caller's buffers (``recv_into``: no intermediate bytes
objects, about 4x asyncio streams' ``readexactly`` here, ``benchmarks/results/kv_transfer.md``) and writes
straight from them (``sendall``: asyncio's stream transport copies what the socket does not take at once into
a buffer of its own); so the holder's chunk buffers can be reused once ``write`` returns.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from urllib.parse import urlsplit

import torch

from kvmesh.core.hashing import BlockHash
from kvmesh.replica.kv_transfer import TransferRejected

LENGTH = struct.Struct("<I")
MAX_FRAME = 1 << 22
"""Largest request or chunk header read (a request's hashes of ~250k blocks)."""
IOV_MAX = 1024
"""Most buffers one scattered read fills (Linux's limit)."""


def probe_chain(n: int) -> list[BlockHash]:
    """Stand-in hashes of a probe's blocks: a chain no real block has (real ones are xxh3 digests)."""
    return [(i + 1).to_bytes(16, "little") for i in range(n)]


class Link:
    """One end of a transfer (or a request to a peer): a non-blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.loop = sock, asyncio.get_running_loop()

    @classmethod
    async def open(cls, address: str) -> Link:
        url = urlsplit(address)
        infos = await asyncio.get_running_loop().getaddrinfo(url.hostname, url.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, where = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, where)
        except BaseException:
            sock.close()
            raise
        return cls.over(sock)

    @classmethod
    def over(cls, sock: socket.socket) -> Link:
        """A link over a connected socket (one a server accepted)."""
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(sock)

    @property
    def peer(self) -> str:
        try:
            return str(self.sock.getpeername())
        except OSError:
            return "?"

    async def send(self, frame: bytes) -> None:
        """One length-prefixed frame."""
        await self.loop.sock_sendall(self.sock, LENGTH.pack(len(frame)) + frame)

    async def write(self, data) -> None:
        """Raw bytes (any buffer); returns once the kernel has taken them all."""
        await self.loop.sock_sendall(self.sock, data)

    async def read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if not n:
                raise ConnectionResetError(f"the holder closed the transfer after {got} of {len(view)} bytes")
            got += n

    async def read_into_views(self, views: list) -> None:
        """Fill ``views`` (writable buffers) in order from the socket: scattered reads, many buffers per call."""
        views = [memoryview(v).cast("B") for v in views]
        i = 0
        while i < len(views):
            try:
                n = self.sock.recvmsg_into(views[i : i + IOV_MAX])[0]
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            if not n:
                raise ConnectionResetError(f"the holder closed the transfer with {len(views) - i} buffers to fill")
            while n:
                if n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                else:
                    views[i], n = views[i][n:], 0

    async def _readable(self) -> None:
        ready = self.loop.create_future()
        self.loop.add_reader(self.sock.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            self.loop.remove_reader(self.sock.fileno())

    async def frame(self) -> bytes:
        """One length-prefixed frame."""
        size = bytearray(LENGTH.size)
        await self.read_into(memoryview(size))
        (n,) = LENGTH.unpack(size)
        if n > MAX_FRAME:
            raise TransferRejected("malformed", f"a {n}-byte header")
        data = bytearray(n)
        await self.read_into(memoryview(data))
        return bytes(data)

    def close(self) -> None:
        self.sock.close()


class ChunkBuffers:
    """Host buffers of one chunk each, reused from chunk to chunk and transfer to transfer: a fresh 16 MiB
    tensor per chunk cost a page fault per 4 KiB on both sides, about a memory copy's worth of CPU. At most
    ``keep`` idle ones are kept; ``take`` and ``give`` may be called from any thread."""

    def __init__(self, blocks: int, block_bytes: int, keep: int = 4) -> None:
        self.shape, self.keep = (blocks, block_bytes), keep
        self._idle: list[torch.Tensor] = []

    def take(self, blocks: int = 0) -> torch.Tensor:
        """A buffer of at least ``blocks`` rows (a chunk's by default; a peer may send larger chunks)."""
        if blocks > self.shape[0]:
            return torch.empty((blocks, self.shape[1]), dtype=torch.uint8)
        try:
            return self._idle.pop()
        except IndexError:
            return torch.empty(self.shape, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        if buffer.shape == self.shape and len(self._idle) < self.keep:
            self._idle.append(buffer)
