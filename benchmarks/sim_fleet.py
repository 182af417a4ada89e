"""Routers head to head on fleets of simulated engines (``kvmesh engine --simulate``), side by side in one run.

    kvmesh bench sim_fleet --smg SMG_VENV/bin/smg --vllm-router VLLM_ROUTER_VENV/bin/vllm-router \\
        [--engines 16,32] [--workloads multi_turn,rag,mooncake,agentic] [--repeats 2] \\
        [--timing PATH[:SPEEDUP] | name=value,...] [--kvmesh-args '--load-period-s 1']

One process runs the largest fleet's simulated engines (``--timing``: by default the CPU engine ``kvmesh bench
calibrate`` measured, ``benchmarks/results/calibration.json``, so each simulated engine is as fast as one real
engine of ``kvmesh bench peer_routers``); a smaller fleet is its first N engines. For each fleet size, repeat,
workload and router, in rotating order: empty the fleet's prefix caches, start the router (or three instances of
it, which the load client takes in turn, as a round-robin balancer in front of an HA deployment spreads
requests), run the workload and read the engines' own counters (hit rate by tokens as the engines saw them).
The workloads are ``kvmesh bench peer_routers``' 3-engine workloads scaled to N engines: N/3 times the sessions
(or RAG requests and documents) at N/3 times the arrival rate, so each engine's share of the load stays put;
``mooncake`` replays the real Mooncake conversation trace's first rows the same way (N/3 times the requests at
N/3 times its pace; ``benchmarks/workloads/mooncake``); ``agentic`` sends agent steps whose sub-agents fork in
bursts on their parent's context (``trace_workloads.agentic``), scaled as RAG is.

Routers: ``kvmesh_router`` (one process) and ``kvmesh_router_x3`` (three, each following every engine's events and
sharing what each routes through one Redis, ``--redis-url``; ``kvmesh_router_x3_alone``: without it),
``smg_cache_aware`` and ``smg_x3``, ``vllm_router_cache_aware``, ``round_robin`` (``smg --policy round_robin``);
the peers run from their own virtualenvs and are left out when their command is not given. Prints medians over
the repeats per cell, then kvmesh's mean and P90 TTFT over the best peer's, pair by pair (each repeat's runs of
one cell), and writes ``benchmarks/results/sim_fleet.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from kvmesh.bench.harness.load_client import run_sessions
from kvmesh.bench.harness.peer_fleet import MODEL, Child, add_workload_args, cpu_seconds, start_router, workload
from kvmesh.bench.harness.report import print_table, results_dir, write_json
from kvmesh.bench.peer_routers import engine_counters, reset_caches
from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis, free_port

INSTANCES = {
    "kvmesh_router_x3": ("kvmesh_router", 3),
    "kvmesh_router_x3_alone": ("kvmesh_router", 3),
    "smg_x3": ("smg_cache_aware", 3),
}
"""Kinds that run several instances of another kind behind the client's round robin."""
SHARED = ("kvmesh_router_x3",)
"""Kinds whose instances share what each routes through one Redis (``kvmesh router --redis-url``), its CPU
counted with theirs."""
SUMMARY_KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_rate", "router_cpu_s", "errors")
OURS = ("kvmesh_router", "kvmesh_router_x3", "kvmesh_router_x3_alone")


def start_fleet(n: int, tmp: Path, args: argparse.Namespace) -> tuple[Child, list[tuple[SimpleNamespace, dict]]]:
    """One process of ``n`` simulated engines; each engine as ``start_router`` takes it (url, event sockets)."""
    port, base = free_port(), f"ipc://{tmp}/sim"
    config = {"enable_kv_cache_events": True, "endpoint": f"{base}.pub", "replay_endpoint": f"{base}.replay"}
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", args.model, "--simulate"]
    cmd += [args.timing, "--engines", str(n), "--port", str(port), "--kv-events-config", json.dumps(config)]
    cmd += ["--num-kv-blocks", str(args.kv_blocks), "--max-num-seqs", str(args.max_num_seqs)]
    child = Child("simulated-engines", cmd, f"http://127.0.0.1:{port}", "/health")  # fails if a port is taken
    child.wait_ready(600)
    engines = []
    for rank in range(n):
        suffix = f"_{rank}" if rank else ""
        events = {"kv_events": f"{base}.pub{suffix}", "replay": f"{base}.replay{suffix}"}
        engines.append((SimpleNamespace(name=f"sim{rank}", url=f"http://127.0.0.1:{port + rank}"), events))
    for engine, _ in engines:  # one server process: each engine's routes are up once the first answers
        httpx.get(engine.url + "/health", timeout=10).raise_for_status()
    return child, engines


def scaled(args: argparse.Namespace, n: int) -> argparse.Namespace:
    """The 3-engine workload options scaled to ``n`` engines (same load per engine)."""
    f, out = n / 3, copy.copy(args)
    out.sessions, out.rate = max(1, round(args.sessions * f)), args.rate * f
    out.requests, out.documents, out.speed = round(args.requests * f), round(args.documents * f), args.speed * f
    return out


def run_cell(kind: str, name: str, args: argparse.Namespace, engines: list) -> dict:
    """One router (its instances) over ``engines`` on one workload: TTFT summary, hit rate, router CPU."""
    reset_caches(engines)
    base, count = INSTANCES.get(kind, (kind, 1))
    redis = EmbeddedRedis().start() if kind in SHARED else None
    options = (*(("--redis-url", redis.url) if redis else ()), *(args.kvmesh_args.split() if kind in OURS else ()))
    routers = [start_router(base, args, engines, args.model, options) for _ in range(count)]
    urls = [r.url for r in routers]
    pids = [r.proc.pid for r in routers] + ([redis.process.pid] if redis else [])
    try:
        asyncio.run(run_sessions(urls, args.model, workload(name, args.seed + 1000, True, args), concurrency=3))
        time.sleep(1.0)
        prompt0, cached0, admitted0 = engine_counters(engines)
        cpu0 = sum(map(cpu_seconds, pids))
        results, wall = asyncio.run(run_sessions(urls, args.model, workload(name, args.seed, False, args)))
        cpu1 = sum(map(cpu_seconds, pids))
        prompt1, cached1, admitted1 = engine_counters(engines)
    finally:
        for router in routers:
            router.stop()
        if redis is not None:
            redis.stop()
    ok = sorted(r.ttft_s for r in results if r.error is None and r.ttft_s is not None)
    pick = lambda q: ok[min(len(ok) - 1, round(q * (len(ok) - 1)))] if ok else None  # noqa: E731
    served = [b - a for a, b in zip(admitted0, admitted1, strict=True)]
    return {
        "requests": len(results),
        "errors": sum(r.error is not None for r in results),
        "first_error": next((r.error for r in results if r.error is not None), None),
        "ttft_mean_s": statistics.fmean(ok) if ok else None,
        **{f"ttft_p{q}_s": pick(q / 100) for q in (50, 90, 99)},
        "hit_rate": (cached1 - cached0) / (prompt1 - prompt0) if prompt1 > prompt0 else 0.0,
        "wall_s": wall,
        "router_cpu_s": cpu1 - cpu0,
        "busiest_over_mean": max(served) / statistics.fmean(served) if any(served) else None,
        "goodput_rps": (len(results) - sum(r.error is not None for r in results)) / wall,
    }


def peers_of(ours: str, kinds: list[str]) -> list[str]:
    """The peers a kvmesh router is judged against: one instance against single-instance peers, three against
    three-instance ones; round robin keeps no state, so it stands in both."""
    many = ours in INSTANCES
    return [k for k in kinds if k not in OURS and (k == "round_robin" or (k in INSTANCES) == many)]


def pair_ratios(runs: dict, kinds: list[str]) -> list[dict]:
    """Per cell, for each of kvmesh's routers: its mean and P90 TTFT over the best of its peers (``peers_of``)
    in the same repeat."""
    out = []
    for cell, by_kind in runs.items():
        repeats = min(len(v) for v in by_kind.values())
        for ours in (k for k in kinds if k in OURS and k in by_kind):
            peers = [p for p in peers_of(ours, kinds) if p in by_kind]
            for key in ("ttft_mean_s", "ttft_p90_s"):
                ratios = []
                for i in range(repeats):
                    best = min((by_kind[p][i][key] for p in peers if by_kind[p][i][key]), default=None)
                    if best and by_kind[ours][i][key]:
                        ratios.append(by_kind[ours][i][key] / best)
                if ratios:
                    out.append(
                        {"cell": cell, "router": ours, "stat": key, "median": statistics.median(ratios)}
                        | {"n": len(ratios), "min": min(ratios), "max": max(ratios), "peers": peers}
                    )
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench sim_fleet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smg", help="SGLang's router command (its own virtualenv's bin/smg)")
    ap.add_argument("--vllm-router", help="vllm-router command (its own virtualenv's bin/vllm-router)")
    ap.add_argument("--engines", default="16,32", help="fleet sizes (comma-separated)")
    ap.add_argument("--model", default=MODEL, help="the simulated engines' model (its tokenizer and KV shape)")
    ap.add_argument("--timing", default=str(results_dir() / "calibration.json") + ":1", help="--simulate's timing")
    ap.add_argument("--kv-blocks", type=int, default=160, help="KV blocks per engine (16 tokens each)")
    ap.add_argument("--routers", help="only these routers (comma-separated)")
    ap.add_argument("--kvmesh-args", default="", help="more options for each kvmesh router (e.g. '--load-period-s 1')")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--report", type=Path, help="print the tables of a saved result (its runs) and run nothing")
    add_workload_args(ap)
    return ap


def router_kinds(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    kinds = ["kvmesh_router", "kvmesh_router_x3"]
    kinds += ["smg_cache_aware", "smg_x3", "round_robin"] if args.smg else []
    kinds += ["vllm_router_cache_aware"] if args.vllm_router else []
    if args.routers:
        kinds += ["kvmesh_router_x3_alone"]  # only when asked for: the sharing's ablation
        unknown = set(args.routers.split(",")) - set(kinds)
        if unknown:
            ap.error(f"--routers: {', '.join(sorted(unknown))} not among {', '.join(kinds)} (give their commands)")
        kinds = [k for k in kinds if k in args.routers.split(",")]
    return kinds


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    if args.report:
        saved = json.loads(args.report.read_text())
        kinds = list(dict.fromkeys(k for cell in saved["runs"].values() for k in cell))
        return report(argparse.Namespace(**saved["args"]), kinds, saved["runs"], args.report)
    kinds, names = router_kinds(ap, args), args.workloads.split(",")
    sizes = sorted(int(n) for n in args.engines.split(","))
    out = args.json or results_dir() / "sim_fleet.json"
    partial = out.with_suffix(".partial.json")
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="sim-fleet-") as tmp:
        fleet, engines = start_fleet(sizes[-1], Path(tmp), args)
        try:
            for n in sizes:
                cell_args = scaled(args, n)
                for repeat in range(args.repeats):
                    for name in names:
                        cell = f"{n} engines / {name}"
                        order = kinds[repeat % len(kinds) :] + kinds[: repeat % len(kinds)]
                        for kind in order:
                            print(f"[{cell} #{repeat + 1}] {kind} ...", file=sys.stderr, flush=True)
                            run = run_cell(kind, name, cell_args, engines[:n])
                            runs.setdefault(cell, {}).setdefault(kind, []).append(run)
                            partial.write_text(json.dumps({"args": vars(args), "runs": runs}, default=str))
        finally:
            fleet.stop()
    report(args, kinds, runs, out)
    partial.unlink(missing_ok=True)


def report(args: argparse.Namespace, kinds: list[str], runs: dict, out: Path) -> None:
    rows, summary = [], {}
    for cell, by_kind in runs.items():
        for kind in kinds:
            reps = by_kind.get(kind, [])
            med = {
                k: statistics.median([r[k] for r in reps if r[k] is not None] or [float("nan")]) for k in SUMMARY_KEYS
            }
            summary.setdefault(cell, {})[kind] = med
            ms = [1000 * med[k] for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")]
            rows.append([cell, kind, *ms, f"{100 * med['hit_rate']:.1f}%", med["router_cpu_s"], int(med["errors"])])
    print(f"\nsimulated engines ({args.timing}), medians of {args.repeats} repeats")
    print_table(["cell", "router", "TTFT mean ms", "P50", "P90", "P99", "hit rate", "router CPU s", "errors"], rows)
    ratios = pair_ratios(runs, kinds)
    print("\nkvmesh over the best peer, per pair (median, n, range)")
    print_table(
        ["cell", "router", "stat", "median", "n", "min", "max"],
        [[r["cell"], r["router"], r["stat"], r["median"], r["n"], r["min"], r["max"]] for r in ratios],
    )
    write_json(
        "sim_fleet",
        {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "ratios": ratios, "runs": runs},
        out,
    )


if __name__ == "__main__":
    main()
