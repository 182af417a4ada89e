"""What simulated engines cost the machine: resident memory, idle CPU and start-up time per engine.

    kvmesh bench sim_footprint [--engines 1,16,64] [--idle-s 10] [--router-periods 1,0.25]

For each count, one ``kvmesh engine --simulate --engines N`` process (KV events on): the seconds until every
engine answers ``/health``, its resident memory, and the CPU it takes over ``--idle-s`` seconds with no
request, then the same after one request per engine. Over the largest fleet, a ``kvmesh router`` following
every engine's events, idle, for each ``--load-period-s`` of ``--router-periods``: its CPU and the fleet's.
Writes ``benchmarks/results/sim_footprint.json``.
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
        row = {
            "engines": n,
            "ready_s": ready_s,
            "rss_mib": rss / 2**20,
            "idle_core_share": idle,
            "idle_after_requests_core_share": _cpu_share(proc, args.idle_s),
        }
        if n == max(_counts(args)) and args.router_periods:
            urls = [f"http://127.0.0.1:{port + rank},kv_events={events['endpoint']}" for rank in range(n)]
            urls = [u + (f"_{rank}" if rank else "") for rank, u in enumerate(urls)]
            periods = [float(p) for p in args.router_periods.split(",")]
            row["router_idle"] = [_router_idle(urls, period, proc, args) for period in periods]
        return row
    finally:
        child.stop()


def _counts(args: argparse.Namespace) -> list[int]:
    return [int(n) for n in args.engines.split(",")]


def _router_idle(workers: list[str], period: float, fleet: psutil.Process, args: argparse.Namespace) -> dict:
    """A ``kvmesh router`` over ``workers`` reading their load every ``period`` s, idle: its CPU and the fleet's."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "router", "--model", args.model, "--port", str(port)]
    cmd += ["--load-period-s", str(period), *(a for w in workers for a in ("--worker", w))]
    router = Child(f"router{period}", cmd, f"http://127.0.0.1:{port}", "/health")
    try:
        router.wait_ready(120)
        time.sleep(3.0)  # each worker's first replay and reads are done
        before = sum(fleet.cpu_times()[:2])
        share = _cpu_share(psutil.Process(router.proc.pid), args.idle_s)
        fleet_share = (sum(fleet.cpu_times()[:2]) - before) / args.idle_s
        return {"load_period_s": period, "router_core_share": share, "fleet_core_share": fleet_share}
    finally:
        router.stop()


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
    ap.add_argument("--router-periods", default="1,0.25", help="load periods of the idle router over the largest fleet")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sim-footprint-") as tmp:
        rows = [measure(n, args, Path(tmp)) for n in _counts(args)]
    base = rows[0]
    table = []
    for r in rows:
        extra = (r["rss_mib"] - base["rss_mib"]) / (r["engines"] - base["engines"]) if r is not base else None
        r["mib_per_extra_engine"] = extra
        per = r["idle_core_share"] / r["engines"]
        table.append([r["engines"], r["ready_s"], r["rss_mib"], r["rss_mib"] / r["engines"], extra or "-", 100 * per])
    print_table(["engines", "ready s", "RSS MiB", "MiB / engine", "MiB / extra engine", "idle % core / engine"], table)
    idle = [(rows[-1]["engines"], r) for r in rows[-1].get("router_idle", [])]
    if idle:
        print_table(
            ["engines", "router load period s", "router idle % core", "fleet % core meanwhile"],
            [[n, r["load_period_s"], 100 * r["router_core_share"], 100 * r["fleet_core_share"]] for n, r in idle],
        )
    write_json("sim_footprint", {"args": vars(args) | {"json": str(args.json)}, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
