"""Soak at twice capacity: every request either completes or is refused at once, memory does not creep,
and no KV block leaks.

    kvmesh bench soak --minutes 10 --overload 2 --json benchmarks/results/soak.json

Starts ``kvmesh serve`` with bounded queues, measures its capacity with a short closed-loop run (requests
per second with every batch slot busy), then offers ``--overload`` times that rate open loop (Poisson, all
on loopback) for ``--minutes``. Every 10 s it records the resident memory of every process of the cluster
(Ray's, the replicas', Redis) and the replicas' KV state. Afterwards, once idle, every replica must hold no
pinned block and run nothing. Reported: completed / refused (429, 503) / failed / hung requests, the
memory trend over the second half of the run (least-squares slope, MiB per minute), and the end state.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from kvmesh.bench.harness.load_client import run_sessions
from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.bench.harness.serve_process import ServeProcess
from kvmesh.bench.harness.workloads import Session, Step


def _requests(seed: int, n: int, rate: float | None, prompt_tokens: int, max_tokens: int) -> list[Session]:
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        ids = [rng.randrange(1000, 40000) for _ in range(prompt_tokens)]
        out.append(Session(f"q{i}", t, [Step(token_ids=ids, max_tokens=max_tokens)], chat=False))
        t += rng.expovariate(rate) if rate else 0.0
    return out


def _rss_mib(server: ServeProcess) -> float:
    server.remember_processes()
    total = 0
    for pid in [server.proc.pid, *server.descendants]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += psutil.Process(pid).memory_info().rss
    return total / 2**20


async def _sample(server: ServeProcess, stop: asyncio.Event, period_s: float, samples: list) -> None:
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        while not stop.is_set():
            try:
                replicas = (await client.get("/status")).json()["replicas"]
            except (httpx.HTTPError, ValueError, KeyError):
                replicas = {}
            samples.append(
                {
                    "t": time.perf_counter() - t0,
                    "rss_mib": _rss_mib(server),
                    "kv_usage": {k: r.get("kv_usage") for k, r in replicas.items()},
                }
            )
            print(f"  [soak] {samples[-1]['t']:6.0f} s: RSS {samples[-1]['rss_mib']:.0f} MiB", file=sys.stderr)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)


async def _soak(server: ServeProcess, model: str, sessions: list[Session], timeout_s: float) -> tuple:
    samples: list = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample(server, stop, 10.0, samples))
    try:
        results, wall = await run_sessions(server.url, model, sessions, progress_label="soak", timeout_s=timeout_s)
    finally:
        stop.set()
        await sampler
    return results, wall, samples


def classify(error: str | None) -> str:
    if error is None:
        return "completed"
    if "HTTP 429" in error or "HTTP 503" in error:
        return "refused"
    if "Timeout" in error:
        return "hung"
    return "failed"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--overload", type=float, default=2.0, help="offered load as a multiple of measured capacity")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-ongoing-requests", type=int, default=12)
    ap.add_argument("--max-queued-requests", type=int, default=8)
    ap.add_argument("--max-inflight-requests", type=int, default=48)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="a request not answered by then has hung")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def run_soak(args: argparse.Namespace) -> tuple[float, float, list, list, dict]:
    """Start the cluster, measure its capacity, offer ``--overload`` times it for ``--minutes``, and read the
    replicas once idle: capacity and offered rate (req/s), the results, the memory samples, the end state."""
    serve_args = [
        "--model",
        args.model,
        "--replicas",
        str(args.replicas),
        "--threads",
        "1",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-ongoing-requests",
        str(args.max_ongoing_requests),
        "--max-queued-requests",
        str(args.max_queued_requests),
        "--max-inflight-requests",
        str(args.max_inflight_requests),
    ]
    with ServeProcess(serve_args) as server:
        server.wait_ready()
        slots = args.replicas * args.max_num_seqs
        probe = _requests(1, 3 * slots, None, args.prompt_tokens, args.max_tokens)
        done, wall = asyncio.run(run_sessions(server.url, args.model, probe, concurrency=slots))
        capacity = sum(r.error is None for r in done) / wall
        rate = args.overload * capacity
        n = int(rate * args.minutes * 60)
        print(
            f"capacity {capacity:.2f} req/s; offering {rate:.2f} req/s for {args.minutes} min ({n} requests)",
            file=sys.stderr,
        )
        results, wall, samples = asyncio.run(
            _soak(server, args.model, _requests(2, n, rate, args.prompt_tokens, args.max_tokens), args.timeout_s)
        )
        time.sleep(5)  # idle: every finished request must have returned its blocks
        end = httpx.get(server.url + "/status", timeout=10).json()["replicas"]
    return capacity, rate, results, samples, end


def summarize(args: argparse.Namespace, capacity: float, rate: float, results: list, samples: list, end: dict) -> dict:
    """Outcomes by kind, the memory trend over the second half, replicas left holding blocks or running."""
    outcomes = {k: 0 for k in ("completed", "refused", "failed", "hung")}
    for r in results:
        outcomes[classify(r.error)] += 1
    half = [s for s in samples if s["t"] >= samples[-1]["t"] / 2] if samples else []
    slope = None
    if len(half) > 2:
        slope = float(np.polyfit([s["t"] / 60 for s in half], [s["rss_mib"] for s in half], 1)[0])
    leaked = {
        rid: {"kv_usage": r["kv_usage"], "num_running": r["num_running"]}
        for rid, r in end.items()
        if r["kv_usage"] > 0 or r["num_running"] or r["num_waiting"]
    }
    refused_latency = [r.e2e_s for r in results if classify(r.error) == "refused" and r.e2e_s is not None]
    summary = {
        "capacity_req_s": capacity,
        "offered_req_s": rate,
        "minutes": args.minutes,
        **outcomes,
        "rss_start_mib": samples[0]["rss_mib"] if samples else None,
        "rss_end_mib": samples[-1]["rss_mib"] if samples else None,
        "rss_slope_second_half_mib_per_min": slope,
        "replicas_with_pinned_blocks_after": leaked,
        "refusal_p99_s": float(np.percentile(refused_latency, 99)) if refused_latency else None,
    }
    return summary


def print_summary(summary: dict) -> None:
    slope = summary["rss_slope_second_half_mib_per_min"]
    print_table(
        [
            "capacity req/s",
            "offered req/s",
            "completed",
            "refused",
            "failed",
            "hung",
            "RSS start MiB",
            "RSS end MiB",
            "RSS slope MiB/min (2nd half)",
            "leaked replicas",
        ],
        [
            [
                summary["capacity_req_s"],
                summary["offered_req_s"],
                summary["completed"],
                summary["refused"],
                summary["failed"],
                summary["hung"],
                summary["rss_start_mib"],
                summary["rss_end_mib"],
                slope if slope is not None else "-",
                len(summary["replicas_with_pinned_blocks_after"]),
            ]
        ],
    )


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    capacity, rate, results, samples, end = run_soak(args)
    summary = summarize(args, capacity, rate, results, samples, end)
    print_summary(summary)
    write_json(
        "soak", {"args": vars(args) | {"json": str(args.json)}, "summary": summary, "samples": samples}, args.json
    )


if __name__ == "__main__":
    main()
