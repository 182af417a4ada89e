"""What simulated engines cost the machine: resident memory, idle CPU and start-up time per engine.

    kvmesh bench sim_footprint [--engines 1,16,64] [--idle-s 10]

For each count, one ``kvmesh engine --simulate --engines N`` process (KV events on): the seconds until every
engine answers ``/health``, its resident memory, and the CPU it takes over ``--idle-s`` seconds with no
request, then the same after one request per engine. Writes ``benchmarks/results/sim_footprint.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from kvmesh.bench.harness.peer_fleet import MODEL, Child
from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.cluster.launch.embedded_redis import free_port


def measure(n: int, args: argparse.Namespace, tmp: Path) -> dict:
    port = free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp}/f{n}.pub"}
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", args.model, "--simulate"]
    cmd += ["--engines", str(n), "--port", str(port), "--kv-events-config", json.dumps(events)]
    started = time.perf_counter()
    child = Child(f"sim{n}", cmd, f"http://127.0.0.1:{port}", "/health")
    try:
        child.wait_ready(600)
        ready_s = time.perf_counter() - started
        proc = psutil.Process(child.proc.pid)
        time.sleep(2.0)
        idle = _cpu_share(proc, args.idle_s)
        for rank in range(n):
            body = {"model": args.model, "prompt": [1000 + rank] * 64, "max_tokens": 4}
            httpx.post(f"http://127.0.0.1:{port + rank}/v1/completions", json=body, timeout=60).raise_for_status()
        rss = proc.memory_info().rss
        return {
            "engines": n,
            "ready_s": ready_s,
            "rss_mib": rss / 2**20,
            "idle_core_share": idle,
            "idle_after_requests_core_share": _cpu_share(proc, args.idle_s),
        }
    finally:
        child.stop()


def _cpu_share(proc: psutil.Process, seconds: float) -> float:
    """The share of one core ``proc`` used over the next ``seconds``."""
    before = sum(proc.cpu_times()[:2])
    time.sleep(seconds)
    return (sum(proc.cpu_times()[:2]) - before) / seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench sim_footprint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engines", default="1,16,64")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sim-footprint-") as tmp:
        rows = [measure(int(n), args, Path(tmp)) for n in args.engines.split(",")]
    base = rows[0]
    table = []
    for r in rows:
        extra = (r["rss_mib"] - base["rss_mib"]) / (r["engines"] - base["engines"]) if r is not base else None
        r["mib_per_extra_engine"] = extra
        per = r["idle_core_share"] / r["engines"]
        table.append([r["engines"], r["ready_s"], r["rss_mib"], r["rss_mib"] / r["engines"], extra or "-", 100 * per])
    print_table(["engines", "ready s", "RSS MiB", "MiB / engine", "MiB / extra engine", "idle % core / engine"], table)
    write_json("sim_footprint", {"args": vars(args) | {"json": str(args.json)}, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
