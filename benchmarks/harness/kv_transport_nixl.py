"""NIXL's half of ``kvmesh bench kv_transport``, and what every transport's processes there share.

Run by the python of a virtualenv holding ``nixl`` (never a kvmesh dependency, never in kvmesh's
environment), so it imports nothing of kvmesh and needs only numpy besides:

    VENV/bin/python benchmarks/harness/kv_transport_nixl.py recv HOST MAX_BYTES
    VENV/bin/python benchmarks/harness/kv_transport_nixl.py send HOST PORT MAX_BYTES

The receiver registers a preallocated DRAM buffer with NIXL's UCX backend and prints one JSON line when
ready (``{"port": P, ...}``); the sender connects, and for each byte count it reads on stdin WRITEs that
many bytes of its own registered buffer into the receiver's (one descriptor: an RMA put, which UCX carries
over the transports it picks, or those ``UCX_TLS`` allows) and prints ``{"seconds": s, "ok": bool}``: the
time until the receiver, having seen the transfer's notification and checked the bytes, acknowledged it.
While a transfer is in flight both sides poll UCX (its progress model); between transfers both block.
Agent metadata, the buffer's address, each transfer's announcement and its acknowledgement go over a plain
TCP socket between the two. kv_transport.py's TCP and ZeroMQ processes speak the same protocol to the
benchmark, with the functions above ``agent``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable

import numpy as np

PERIOD = 251
"""Byte i of every sent buffer is ``i % PERIOD``; a prime, so data landing at a shifted offset shows."""
STRIDE = 4099
"""The receiver checks every STRIDE-th byte (and the last) after each transfer, then wipes them to 255."""


def source(max_bytes: int) -> np.ndarray:
    """The sender's buffer: the pattern, written (so its pages are resident) before anything is timed."""
    return np.resize(np.arange(PERIOD, dtype=np.uint8), max_bytes)


class Landing:
    """The receiver's preallocated buffer (every page touched up front), and the check of each transfer."""

    def __init__(self, max_bytes: int) -> None:
        self.buf = np.full(max_bytes, 255, dtype=np.uint8)

    def check(self, n: int) -> bool:
        """Whether the sampled bytes of the first ``n`` hold the pattern; then wipes them for the next one."""
        idx = np.append(np.arange(0, n, STRIDE), n - 1)
        ok = bool(np.array_equal(self.buf[idx], (idx % PERIOD).astype(np.uint8)))
        self.buf[idx] = 255
        return ok


class Protocol:
    """The JSON lines to the benchmark, on what was stdout: fd 1 itself then goes to stderr, so that log
    lines UCX and NIXL print there (they do) cannot garble them. Made first thing in a role's process."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def reply(self, **fields) -> None:
        """The receiver's ``port`` when ready; the sender's ``seconds`` and ``ok`` per transfer."""
        self.out.write(json.dumps(fields) + "\n")


def serve_requests(out: Protocol, transfer: Callable[[int], bool]) -> None:
    """The sender's loop: a byte count per stdin line, one timed transfer each, one JSON line back."""
    for line in sys.stdin:
        n = int(line)
        start = time.perf_counter()
        ok = transfer(n)
        out.reply(seconds=time.perf_counter() - start, ok=ok)


def send_blob(conn: socket.socket, blob: bytes) -> None:
    conn.sendall(struct.pack("!Q", len(blob)) + blob)


def recv_blob(conn: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = conn.recv(n - len(out))
            if not chunk:
                raise EOFError("the peer closed the connection")
            out += chunk
        return bytes(out)

    return exactly(struct.unpack("!Q", exactly(8))[0])


def agent(name: str):
    """A NIXL agent on UCX without NIXL's progress thread: that thread spins (a core each, idle or not,
    which would starve the other transports' turns on a small machine); we progress it while we wait."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def nixl_receiver(out: Protocol, host: str, max_bytes: int) -> None:
    from importlib.metadata import version

    landing = Landing(max_bytes)
    me = agent("receiver")
    me.register_memory([(landing.buf.ctypes.data, max_bytes, 0, "")], "DRAM")
    server = socket.create_server((host, 0))
    out.reply(port=server.getsockname()[1], nixl=version("nixl"))
    conn, _ = server.accept()
    peer = me.add_remote_agent(recv_blob(conn)).decode()
    send_blob(conn, json.dumps({"addr": landing.buf.ctypes.data}).encode())
    send_blob(conn, me.get_agent_metadata())
    while True:  # a transfer is announced on the socket (so we block, not spin, between transfers) ...
        try:
            n = int(recv_blob(conn))
        except EOFError:
            return
        while not me.check_remote_xfer_done(peer, str(n).encode()):  # ... and lands with its notification
            pass
        send_blob(conn, b"ok" if landing.check(n) else b"bad")


def nixl_sender(out: Protocol, host: str, port: int, max_bytes: int) -> None:
    buf = source(max_bytes)
    me = agent("sender")
    me.register_memory([(buf.ctypes.data, max_bytes, 0, "")], "DRAM")
    conn = socket.create_connection((host, port))
    send_blob(conn, me.get_agent_metadata())
    addr = json.loads(recv_blob(conn))["addr"]
    peer = me.add_remote_agent(recv_blob(conn)).decode()
    handles = {}

    def transfer(n: int) -> bool:
        if n not in handles:  # prepared once per size, as a KV mover would keep its block lists prepared
            local = me.get_xfer_descs([(buf.ctypes.data, n, 0)], "DRAM")
            remote = me.get_xfer_descs([(addr, n, 0)], "DRAM")
            handles[n] = me.initialize_xfer("WRITE", local, remote, peer, str(n).encode())
        send_blob(conn, str(n).encode())
        state = me.transfer(handles[n])
        while state == "PROC":
            state = me.check_xfer_state(handles[n])
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer of {n} bytes: {state}")
        return recv_blob(conn) == b"ok"

    serve_requests(out, transfer)


if __name__ == "__main__":
    protocol = Protocol()
    role, host, *rest = sys.argv[1:]
    if role == "recv":
        nixl_receiver(protocol, host, int(rest[0]))
    else:
        nixl_sender(protocol, host, int(rest[0]), int(rest[1]))
