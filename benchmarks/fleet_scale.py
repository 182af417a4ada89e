"""Routing at fleet scale: kv_aware's hit rate against the pooled and the replication-aware bounds, 16-256 replicas.

For each fleet size the simulator (``benchmarks/harness/fleet_sim.py``, the policy code the router runs) replays the
trace with kv_aware (and a variant of its settings, ``--variant``) and session_hash at ``--target-load`` of the
fleet's prefill on the pooled bound. The table gives both bounds (``benchmarks/harness/cache_bounds.py``: the
replicated one as placed-ceiling), each kv_aware's share of them, its imbalance and mean TTFT against
session_hash, and what it passed over: blocks another replica held beyond the chosen one's (moves for load;
in brackets, those of requests placed as new conversations).

    kvmesh bench fleet_scale                                   # the Mooncake trace, 16-256 replicas
    kvmesh bench fleet_scale --variant '{"history_weight": 12}'
    kvmesh bench fleet_scale --mooncake-size 86 --replicas 1024 --shortlist 16   # ~1M requests
    kvmesh bench fleet_scale --peer-fetch 100000 --variant '{"peer_fetch": false}'   # fetching from peers, or not

``--peer-fetch TOK_S``: every replica can pull a prefix's KV from a peer at TOK_S prompt tokens per second (and
serves its own); the hit rate then counts local and fetched blocks, and the "fetched" column the latter.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvmesh.bench.harness.fleet_sim import BOUND_IMBALANCE, Costs, compare_routers, load_trace, trace_rows
from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.bench.harness.trace_workloads import mooncake

VARIANT = "kv_aware(variant)"


def run_size(rows, replicas: int, args) -> dict:
    """Bounds and every router at one fleet size, with kv_aware's shares of the bounds."""
    runs = [(name, name, {}) for name in args.routers.split(",") if name]
    if args.variant:
        runs.insert(1, (VARIANT, "kv_aware", args.variant))
    t0 = time.perf_counter()
    bounds, results = compare_routers(
        rows, replicas, args.capacity_blocks, args.target_load, args.router_processes, runs,
        Costs(fetch_tok_s=args.peer_fetch),
        imbalance=args.bound_imbalance, shortlist=args.shortlist,
        on_result=lambda label, res: print(f"  {label}: {res['sim_seconds']:.0f} s", flush=True),
        progress=lambda label, n: print(f"  {label}: {n:,} of {len(rows):,} requests routed", flush=True),
    )  # fmt: skip
    base = results["session_hash"]["ttft_mean_s"] if "session_hash" in results else None
    for res in results.values():
        res["of_pooled"] = res["hit_rate"] / bounds["pooled_lru"]
        res["of_replicated"] = res["hit_rate"] / bounds["replicated"]
        res["of_placed"] = res["hit_rate"] / bounds["replicated_placed"]
        res["ttft_vs_session_hash"] = res["ttft_mean_s"] / base if base else None
    sims = sum(res["sim_seconds"] for res in results.values())
    return {
        "replicas": replicas,
        "bounds": bounds,
        "routers": results,
        "bounds_seconds": time.perf_counter() - t0 - sims,
    }


def report(args: argparse.Namespace, rows: list, sizes: list[dict]) -> None:
    """Per fleet size and router: the bounds, its hit rate (local and fetched blocks), the fetched share, its
    shares of the bounds, what it passed over, its imbalance and TTFT against session_hash."""
    table = [
        [
            s["replicas"],
            f"{s['bounds']['pooled_lru']:.2%}",
            f"{s['bounds']['replicated_placed']:.2%}-{s['bounds']['replicated']:.2%}",
            label,
            f"{res['hit_rate']:.2%}",
            f"{res['fetched_rate']:.2%}",
            f"{res['of_pooled']:.1%}",
            f"{res['of_replicated']:.1%}",
            f"{res['passed_over']:.2%} ({res['passed_over_opening']:.2%})",
            res["imbalance"],
            res["ttft_mean_s"] * 1000,
            res["ttft_vs_session_hash"],
            res["sim_seconds"],
        ]
        for s in sizes
        for label, res in s["routers"].items()
    ]
    print(f"\n{len(rows)} requests, {args.capacity_blocks} blocks per replica, load {args.target_load}")
    headers = ["replicas", "pooled", "replicated", "router", "hits", "fetched", "of pooled", "of replicated"]
    headers += ["passed over (opening)", "imbalance", "TTFT mean ms", "TTFT / session_hash", "sim s"]
    print_table(headers, table)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench fleet_scale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", type=Path, default=Path("benchmarks/workloads/mooncake/conversation_trace.jsonl"))
    ap.add_argument("--replicas", default="16,32,64,128,256", help="comma list of fleet sizes")
    ap.add_argument("--capacity-blocks", type=int, default=3000)
    ap.add_argument("--target-load", type=float, default=0.8)
    ap.add_argument("--router-processes", type=int, default=4)
    ap.add_argument("--bound-imbalance", type=float, default=BOUND_IMBALANCE)
    ap.add_argument("--routers", default="kv_aware,session_hash", help="policies to run (session_hash: the baseline)")
    ap.add_argument("--variant", type=json.loads, default={}, help="also run kv_aware with these settings")
    ap.add_argument("--mooncake-size", type=float, default=0.0, help="the Mooncake-like generator at this size")
    ap.add_argument("--seed", type=int, default=0, help="the generator's seed")
    ap.add_argument("--shortlist", type=int, default=0, help="price k deepest holders + k random (0: all)")
    ap.add_argument(
        "--peer-fetch", type=float, default=0.0, metavar="TOK_S", help="replicas pull prefixes from peers (0: off)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.mooncake_size:
        rows = trace_rows(mooncake(seed=args.seed, size=args.mooncake_size))
        source = f"mooncake(seed={args.seed}, size={args.mooncake_size:g})"
    else:
        rows, source = load_trace(args.trace, None), str(args.trace)
    print(f"{len(rows)} requests from {source} in {time.perf_counter() - t0:.0f} s", flush=True)
    sizes = []
    for n in map(int, args.replicas.split(",")):
        print(f"{n} replicas:", flush=True)
        sizes.append(run_size(rows, n, args))
    report(args, rows, sizes)
    payload = {
        "trace": source,
        "shortlist": args.shortlist,
        "peer_fetch_tok_s": args.peer_fetch,
        "variant": args.variant,
        "requests": len(rows),
        "capacity_blocks": args.capacity_blocks,
        "target_load": args.target_load,
        "router_processes": args.router_processes,
        "bound_imbalance": args.bound_imbalance,
        "sizes": sizes,
    }
    write_json("fleet_scale", payload, args.json)


if __name__ == "__main__":
    main()
