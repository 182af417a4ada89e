"""Which transport should move KV blocks between replica processes: TCP, ZeroMQ and NIXL side by side.

    kvmesh bench kv_transport [--sizes-mb 16,64,256] [--repeats 5] [--nixl-python VENV/bin/python]
        [--transports tcp,tcp_into,zmq,nixl,nixl_tcp] [--chunk-kib 1024] [--netns] [--json OUT.json]

kvmesh will move KV blocks (CPU memory for now: uint8 tensors of n_blocks x block_bytes; a 16-token block
of SmolLM2-135M in fp32 is ~0.7 MB, an 8k-token prefix ~360 MB) from one replica's process to another's.
Each transport gets a receiver process and a sender process (on 127.0.0.1, or with ``--netns`` in two
network namespaces joined by a veth pair, as two hosts); the sender moves the first N bytes of its buffer
into the receiver's preallocated buffer, and the time is taken until the receiver, having checked sampled
bytes, acknowledged. The transports:

  tcp       asyncio streams: ``write`` + ``drain`` per 1 MiB (backpressure); ``readexactly`` per 1 MiB, copied in
  tcp_into  the same sender; the receiver an asyncio ``BufferedProtocol``: the socket reads into the buffer
  zmq       pyzmq DEALER -> ROUTER over tcp://: one multipart message of 1 MiB frames, ``copy=False``;
            the frames copied in
  nixl      NIXL's UCX backend, a WRITE into the receiver's registered memory, transports as UCX picks them
            (on one host: TCP for small messages, cross-memory attach for bulk: not what crosses hosts)
  nixl_tcp  the same with ``UCX_TLS=tcp``: what UCX does between hosts without RDMA

NIXL is never a kvmesh dependency: it runs in its own virtualenv (``--nixl-python``; ``python -m venv
VENV && VENV/bin/pip install nixl numpy``), through benchmarks/harness/kv_transport_nixl.py, which also
holds what every transport's processes share. Each transport moves each size once untimed (connections,
first touches), then ``--repeats`` rounds, each moving every size through every transport in turn (A, B, C,
A, B, C, ...), so they are measured side by side. Throughput in GB/s (10^9 bytes/s; sizes in MiB): the
median with the min and max over rounds, and against tcp the median of per-round ratios; and the CPU time
the two processes spent (all their threads, on the CPU) per GB moved. Prints a table; writes
``benchmarks/results/kv_transport.json`` (or ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import select
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.bench.harness.kv_transport_nixl import Landing, Protocol, serve_requests, source
from kvmesh.bench.harness.report import machine, median, print_table, write_json

MIB = 1 << 20
NIXL_SIDE = Path(__file__).parent / "harness" / "kv_transport_nixl.py"
TIMEOUT_S = 120.0


@dataclass
class Transport:
    name: str
    python: str
    script: list[str]
    """What the python runs, the role and its arguments after it: ``-m kvmesh.bench.kv_transport tcp CHUNK``
    (this module's ``role``) or the NIXL side's path."""
    env: dict[str, str] = field(default_factory=dict)

    def command(self, role: str, *args) -> list[str]:
        return [self.python, *self.script, role, *map(str, args)]


def transports(args: argparse.Namespace) -> tuple[list[Transport], dict[str, str]]:
    """The transports asked for, and why any of them cannot run here."""
    ours = {name: ["-m", "kvmesh.bench.kv_transport", name, str(args.chunk_kib * 1024)] for name in OURS}
    nixl = [str(NIXL_SIDE)]
    ucx = {"UCX_LOG_LEVEL": "info"}  # UCX then logs the transports it picked: recorded in the JSON
    known = {
        **{name: Transport(name, sys.executable, script) for name, script in ours.items()},
        "nixl": Transport("nixl", args.nixl_python or "", nixl, ucx),
        "nixl_tcp": Transport("nixl_tcp", args.nixl_python or "", nixl, {**ucx, "UCX_TLS": "tcp"}),
    }
    chosen, missing = [], {}
    for name in args.transports.split(","):
        if name not in known:
            raise SystemExit(f"no transport {name!r}: one of {', '.join(known)}")
        t = known[name]
        if t.python:
            chosen.append(t)
        else:
            missing[name] = "no --nixl-python (a virtualenv with `pip install nixl numpy`)"
    return chosen, missing


class Pair:
    """One transport's receiver and sender processes (their stderr in ``log``), and its transfers."""

    def __init__(self, t: Transport, max_bytes: int, logdir: Path, netns) -> None:
        self.t, self.netns, self.procs = t, netns, []
        self.log = logdir / f"{t.name}.log"
        host = netns.ips["head"] if netns else "127.0.0.1"
        try:
            ready = self._line(self._start("head", t.command("recv", host, max_bytes)))
            self.info = {k: v for k, v in ready.items() if k != "port"}
            self.sender = self._start("worker", t.command("send", host, ready["port"], max_bytes))
        except BaseException:
            self.stop()
            raise

    def _start(self, node: str, cmd: list[str]) -> subprocess.Popen:
        cmd = self.netns.command(node, cmd, **self.t.env) if self.netns else cmd
        env = None if self.netns else {**os.environ, **self.t.env}
        with self.log.open("a") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.procs.append(proc)
        return proc

    def _line(self, proc: subprocess.Popen) -> dict:
        if not select.select([proc.stdout], [], [], TIMEOUT_S)[0]:
            raise RuntimeError(f"{self.t.name}: no answer in {TIMEOUT_S:.0f} s; {self.log_tail()}")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.t.name}: a process exited; {self.log_tail()}")
        return json.loads(line)

    def transfer(self, n: int) -> tuple[float, float]:
        """Seconds (the sender's clock) and CPU seconds (both processes, all their threads) of one transfer."""
        cpu = -self.cpu_seconds()
        self.sender.stdin.write(f"{n}\n")
        self.sender.stdin.flush()
        out = self._line(self.sender)
        if not out["ok"]:
            raise RuntimeError(f"{self.t.name}: {n} bytes arrived wrong")
        return out["seconds"], cpu + self.cpu_seconds()

    def cpu_seconds(self) -> float:
        """On-CPU time of every thread of both processes, from the scheduler (ns; /proc's ticks are 10 ms)."""
        ns = 0
        for proc in self.procs:
            for task in Path(f"/proc/{proc.pid}/task").iterdir():
                with contextlib.suppress(FileNotFoundError):  # a thread that just ended
                    ns += int((task / "schedstat").read_text().split()[0])
        return ns / 1e9

    def log_tail(self) -> str:
        return "its log ends: " + self.log.read_text()[-1500:]

    def ucx_choices(self) -> list[str]:
        """The transports UCX logged for each of its endpoint configurations (with UCX_LOG_LEVEL=info)."""
        found = re.findall(r"UCX\s+INFO\s+(.*cfg#\d+.*)", self.log.read_text())
        return sorted({" ".join(line.split()) for line in found})

    def close(self) -> None:
        """The sender ends at the end of its stdin; the receiver (ZeroMQ's never sees the peer go) is told."""
        self.sender.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.sender.wait(timeout=10)
        self.stop()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def measure(args: argparse.Namespace, pairs: list[Pair], failed: dict[str, str]) -> dict[str, dict[int, list]]:
    """(seconds, CPU seconds) per transport per size: a warm-up round (dropped), then ``--repeats`` rounds."""
    sizes = [int(mb) for mb in args.sizes_mb.split(",")]
    samples = {p.t.name: {mb: [] for mb in sizes} for p in pairs}
    for r in range(args.repeats + 1):
        for mb in sizes:
            for p in [p for p in pairs if p.t.name not in failed]:
                try:
                    sample = p.transfer(mb * MIB)
                except (RuntimeError, OSError, ValueError) as exc:
                    failed[p.t.name] = str(exc)
                    continue
                if r:
                    samples[p.t.name][mb].append(sample)
            print(f"  round {r}/{args.repeats} ({'warm-up' if r == 0 else 'timed'}): {mb} MiB", file=sys.stderr)
    return samples


def summarize(samples: dict[str, dict[int, list]]) -> list[dict]:
    rows = []
    base = samples.get("tcp", {})
    for mb in next(iter(samples.values()), {}):
        for name, by_size in samples.items():
            if not by_size[mb]:
                continue
            ts, cpus = zip(*by_size[mb], strict=True)
            gbs = [mb * MIB / t / 1e9 for t in ts]
            # Per round: tcp's time over this one's (a transport that failed stops in every later round).
            ratios = [b / t for (b, _), t in zip(base.get(mb, []), ts, strict=False)]
            rows.append(
                {
                    "size_mib": mb,
                    "transport": name,
                    "gb_s_median": median(gbs),
                    "gb_s_min": min(gbs),
                    "gb_s_max": max(gbs),
                    "ms_median": 1000 * median(ts),
                    "cpu_s_per_gb_median": median([c / (mb * MIB / 1e9) for c in cpus]),
                    "vs_tcp_median": median(ratios) if ratios else None,
                    "vs_tcp_range": [min(ratios), max(ratios)] if ratios else None,
                    "seconds": ts,
                    "cpu_seconds": cpus,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in {t for t, _ in ROLES}:
        return role(argv)
    ap = argparse.ArgumentParser(
        prog="kvmesh bench kv_transport", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes-mb", default="16,64,256", help="buffer sizes in MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transports", default="tcp,tcp_into,zmq,nixl,nixl_tcp")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="TCP writes and reads, ZeroMQ frames (KiB)")
    ap.add_argument("--nixl-python", help="the python of a virtualenv with nixl and numpy (never ours)")
    ap.add_argument("--netns", action="store_true", help="receiver and sender in two network namespaces (root)")
    ap.add_argument("--json", type=Path, help="where to write the JSON (default benchmarks/results/kv_transport.json)")
    args = ap.parse_args(argv)
    chosen, failed = transports(args)
    load = {"before": [round(x, 2) for x in os.getloadavg()]}
    samples, info = run(args, chosen, failed)
    load["after"] = [round(x, 2) for x in os.getloadavg()]
    rows = summarize(samples)
    where = "two network namespaces (veth)" if args.netns else "127.0.0.1"
    m = machine()
    print(f"\n{m['cpu']}, {m['logical_cores']} logical cores; sender process -> receiver process, {where}")
    print(f"GB/s: median (min-max) of {args.repeats} alternated rounds; load average before: {load['before']}")
    headers = ["MiB", "transport", "GB/s", "min-max", "ms", "vs tcp (per round)", "CPU s/GB"]
    print_table(headers, [table_row(r) for r in rows])
    for name, why in failed.items():
        print(f"{name}: not measured: {why}")
    config = {**{k: v for k, v in vars(args).items() if k != "json"}, "where": where, "load_average": load}
    payload = {"config": config, "transports": info, "not_measured": failed, "results": rows}
    write_json("kv_transport", payload, args.json)


def run(args: argparse.Namespace, chosen: list[Transport], failed: dict[str, str]) -> tuple[dict, dict]:
    """Every transport's processes started (a failure to start noted in ``failed``), measured, stopped."""
    max_bytes = max(int(mb) for mb in args.sizes_mb.split(",")) * MIB
    pairs, netns, info = [], None, {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-kvt-") as tmp:
        try:
            if args.netns:
                from kvmesh.bench.harness.netns_cluster import NetnsCluster

                netns = NetnsCluster(Path(tmp)).create()
            for t in chosen:
                try:
                    pairs.append(Pair(t, max_bytes, Path(tmp), netns))
                except (RuntimeError, OSError, ValueError) as exc:
                    failed[t.name] = str(exc)
            samples = measure(args, pairs, failed)
            for p in pairs:
                ucx = p.ucx_choices() if "nixl" in p.t.name else []
                info[p.t.name] = {"env": p.t.env, "python": p.t.python, **p.info, **({"ucx": ucx} if ucx else {})}
        finally:
            for p in pairs:
                p.close()
            if netns:
                netns.teardown()
    return samples, info


def table_row(r: dict) -> list:
    vs = r["vs_tcp_median"]
    return [
        r["size_mib"],
        r["transport"],
        f"{r['gb_s_median']:.2f}",
        f"{r['gb_s_min']:.2f}-{r['gb_s_max']:.2f}",
        f"{r['ms_median']:.1f}",
        f"{vs:.2f}x ({r['vs_tcp_range'][0]:.2f}-{r['vs_tcp_range'][1]:.2f})" if vs else "",
        f"{r['cpu_s_per_gb_median']:.2f}",
    ]


# ---------------------------------------------------------------- the TCP and ZeroMQ processes


def role(argv: list[str]) -> None:
    """``TRANSPORT CHUNK recv HOST MAX_BYTES`` or ``TRANSPORT CHUNK send HOST PORT MAX_BYTES`` (``Pair``'s)."""
    out = Protocol()
    transport, chunk, which, host, *nums = argv
    ROLES[transport, which](out, int(chunk), host, *map(int, nums))


def tcp_receiver(out: Protocol, chunk: int, host: str, max_bytes: int) -> None:
    async def go() -> None:
        landing, closed = Landing(max_bytes), asyncio.Event()
        view = memoryview(landing.buf)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    n = int.from_bytes(await reader.readexactly(8), "big")
                    for off in range(0, n, chunk):
                        view[off : min(off + chunk, n)] = await reader.readexactly(min(chunk, n - off))
                    writer.write(b"\1" if landing.check(n) else b"\0")
                    await writer.drain()
            except asyncio.IncompleteReadError:
                closed.set()

        server = await asyncio.start_server(serve, host, 0)
        out.reply(port=server.sockets[0].getsockname()[1])
        await closed.wait()

    asyncio.run(go())


def tcp_into_receiver(out: Protocol, chunk: int, host: str, max_bytes: int) -> None:
    """The socket reads straight into the landing buffer (``recv_into``): no bytes objects, no copies."""
    landing, closed = Landing(max_bytes), asyncio.Event()
    view = memoryview(landing.buf)

    class Into(asyncio.BufferedProtocol):
        def __init__(self) -> None:
            self.header, self.n, self.got = bytearray(8), None, 0

        def connection_made(self, transport: asyncio.Transport) -> None:
            self.transport = transport

        def get_buffer(self, sizehint: int) -> memoryview:
            return memoryview(self.header)[self.got :] if self.n is None else view[self.got : self.n]

        def buffer_updated(self, nbytes: int) -> None:
            self.got += nbytes
            if self.n is None and self.got == 8:
                self.n, self.got = int.from_bytes(self.header, "big"), 0
            elif self.got == self.n:
                self.transport.write(b"\1" if landing.check(self.n) else b"\0")
                self.n, self.got = None, 0

        def connection_lost(self, exc: Exception | None) -> None:
            closed.set()

    async def go() -> None:
        server = await asyncio.get_running_loop().create_server(Into, host, 0)
        out.reply(port=server.sockets[0].getsockname()[1])
        await closed.wait()

    asyncio.run(go())


def tcp_sender(out: Protocol, chunk: int, host: str, port: int, max_bytes: int) -> None:
    view = memoryview(source(max_bytes))
    loop = asyncio.new_event_loop()
    reader, writer = loop.run_until_complete(asyncio.open_connection(host, port))

    async def transfer(n: int) -> bool:
        writer.write(n.to_bytes(8, "big"))
        for off in range(0, n, chunk):
            writer.write(view[off : min(off + chunk, n)])
            await writer.drain()  # waits while the socket is full: the receiver sets the pace
        return await reader.readexactly(1) == b"\1"

    serve_requests(out, lambda n: loop.run_until_complete(transfer(n)))


def zmq_receiver(out: Protocol, chunk: int, host: str, max_bytes: int) -> None:
    import zmq

    landing = Landing(max_bytes)
    view = memoryview(landing.buf)
    sock = zmq.Context().socket(zmq.ROUTER)
    out.reply(port=sock.bind_to_random_port(f"tcp://{host}"), pyzmq=zmq.__version__, libzmq=zmq.zmq_version())
    while True:
        peer, header, *frames = sock.recv_multipart(copy=False)
        off = 0
        for f in frames:
            view[off : off + len(f)] = f.buffer
            off += len(f)
        n = int(header.bytes)
        sock.send_multipart([peer, b"ok" if off == n and landing.check(n) else b"bad"])


def zmq_sender(out: Protocol, chunk: int, host: str, port: int, max_bytes: int) -> None:
    import zmq

    view = memoryview(source(max_bytes))
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(f"tcp://{host}:{port}")

    def transfer(n: int) -> bool:
        frames = [view[off : min(off + chunk, n)] for off in range(0, n, chunk)]
        sock.send_multipart([str(n).encode(), *frames], copy=False)  # zero-copy: frames point into view
        return sock.recv() == b"ok"

    serve_requests(out, transfer)


OURS = ("tcp", "tcp_into", "zmq")
ROLES = {
    ("tcp", "recv"): tcp_receiver,
    ("tcp", "send"): tcp_sender,
    ("tcp_into", "recv"): tcp_into_receiver,
    ("tcp_into", "send"): tcp_sender,
    ("zmq", "recv"): zmq_receiver,
    ("zmq", "send"): zmq_sender,
}


if __name__ == "__main__":
    main()
