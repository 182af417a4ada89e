"""Trace-driven fleet simulation of routing policies (the same policy objects the Ray router runs).

Replays a Mooncake-format trace (``--trace``) on ``--replicas`` simulated replicas of ``--capacity-blocks``
blocks each (the model: ``benchmarks/harness/fleet_sim.py``), once per router of ``--routers`` (and once per
``--miss-weights`` value for kv_aware), with arrival times rescaled so the offered work, assuming a pooled LRU
of all the replicas' blocks, is ``--target-load`` of the fleet's prefill capacity. Requests are spread over
``--router-processes`` independent router processes; a routing decision stands as a prediction until its
blocks land and for ``--predict-ttl`` trace seconds. Runs are judged against bounds from the trace alone
(``benchmarks/harness/cache_bounds.py``): the pooled LRU and the replication-aware bound at
``--bound-imbalance``. ``--shortlist k`` prices only the k replicas holding the prompt deepest plus k random
ones per decision, for fleets of a thousand replicas. ``--peer-fetch TOK_S``: every replica can pull a
prefix's KV from a peer at TOK_S prompt tokens per second (and serves its own), which the router prices
(``docs/routing.md``, "Fetching a prefix from a peer"); hits are then counted by source: local (device and host
tier) and fetched, both in the hit rate. ``--adapters N``: a trace of many fine-tunes, each prefix family on one
of N LoRA adapters with Zipf popularity (``--adapter-zipf``); each replica holds ``--adapter-slots`` adapters ready
and reads another in ``--lora-load-s``; ``--adapter-blind`` adds kv_aware routing blind to adapters, and the table
counts adapter loads per simulated minute.

Cost constants, by default a GPU-class replica documented here (not measured on a GPU): prefill 20,000
tokens/s, a decode step takes 15 ms plus 0.25 ms per running sequence, 64 batch slots, 16 tokens per
block. ``--calibration benchmarks/results/calibration.json`` (written by ``kvmesh bench calibrate``, which
measures our real engine) uses the measured constants instead, sped up by ``--speedup`` (default: the
factor that brings the measured prefill rate to the GPU-class 20,000 tokens/s; step costs scale by the
same factor, so the measured balance between prefill and decode is kept).

    kvmesh bench simulate --trace benchmarks/workloads/mooncake/conversation_trace.jsonl \\
        --replicas 16 --capacity-blocks 3000 --routers kv_aware,pow2,round_robin,session_hash,approx_tree
    kvmesh bench simulate ... --routers kv_aware --miss-weights 1,2,4,8   # tune the miss weight
    kvmesh bench simulate ... --routers kv_aware --peer-fetch 100000       # replicas fetch prefixes from peers
    kvmesh bench simulate ... --replicas 64 --adapters 500 --adapter-blind --routers kv_aware,round_robin
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from kvmesh.bench.harness.fleet_sim import (
    BOUND_IMBALANCE,
    PREDICT_TTL_S,
    Costs,
    compare_routers,
    load_trace,
    zipf_adapters,
)
from kvmesh.bench.harness.report import print_table, write_json


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--capacity-blocks", type=int, default=3000)
    ap.add_argument("--routers", default="kv_aware,pow2,round_robin,session_hash,approx_tree")
    ap.add_argument("--miss-weights", default="", help="comma list: run kv_aware once per miss_weight")
    ap.add_argument("--target-load", type=float, default=0.8)
    ap.add_argument("--router-processes", type=int, default=4)
    ap.add_argument("--predict-ttl", type=float, default=PREDICT_TTL_S, help="predict-on-route TTL, trace seconds")
    ap.add_argument(
        "--bound-imbalance",
        type=float,
        default=BOUND_IMBALANCE,
        help="the replication-aware bound's load cap: busiest replica's requests / the mean",
    )
    ap.add_argument(
        "--shortlist", type=int, default=0, help="price only k deepest holders + k random replicas (0: all)"
    )
    ap.add_argument("--limit", type=int, default=None, help="first N trace rows only")
    ap.add_argument("--calibration", type=Path, default=None, help="measured costs (kvmesh bench calibrate)")
    ap.add_argument("--speedup", type=float, default=None, help="with --calibration: replica speed-up factor")
    ap.add_argument(
        "--peer-fetch",
        type=float,
        default=0.0,
        metavar="TOK_S",
        help="replicas pull prefixes from peers at TOK_S prompt tokens/s (0: off)",
    )
    ap.add_argument("--adapters", type=int, default=0, help="LoRA adapters the trace's prefix families run on")
    ap.add_argument("--adapter-zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    ap.add_argument("--adapter-slots", type=int, default=4, help="adapters a replica holds ready at once")
    ap.add_argument("--lora-load-s", type=float, default=0.05, help="seconds a replica takes to read an adapter")
    ap.add_argument("--adapter-blind", action="store_true", help="also run kv_aware blind to adapters")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def runs_of(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """``(label, policy, settings)`` per router of ``--routers``, then kv_aware once per ``--miss-weights``."""
    runs = [(name, name, {}) for name in args.routers.split(",") if name]
    runs += [
        (f"kv_aware(miss_weight={float(w):g})", "kv_aware", {"miss_weight": float(w)})
        for w in args.miss_weights.split(",")
        if w
    ]
    if args.adapter_blind:
        runs.append(("kv_aware(adapter-blind)", "kv_aware", {"adapter_weight": 0.0}))
    return runs


def report(args: argparse.Namespace, rows: list, bounds: dict, results: dict) -> None:
    """The table of every run's hit rate (local and fetched blocks; and its share of each bound), the fetched
    share, TTFT and imbalance."""
    pooled, replicated = bounds["pooled_lru"], bounds["replicated"]
    table = [
        [
            label,
            f"{res['hit_rate']:.1%}",
            f"{res['fetched_rate']:.1%}",
            f"{res['hit_rate'] / pooled:.1%}",
            f"{res['hit_rate'] / replicated:.1%}",
            res["ttft_mean_s"],
            res["ttft_p99_s"],
            res["imbalance"],
            *([res["adapter_loads_per_min"]] if args.adapters else []),
        ]
        for label, res in results.items()
    ]
    print(f"\n{len(rows)} requests, {args.replicas} replicas x {args.capacity_blocks} blocks, load {args.target_load}")
    print(
        f"bounds: infinite cache {bounds['infinite']:.1%}, pooled LRU {pooled:.1%}, replicated at imbalance "
        f"{args.bound_imbalance:g} {bounds['replicated_placed']:.1%}-{replicated:.1%} (placed-ceiling)"
    )
    headers = ["router", "hit rate", "fetched", "of pooled", "of replicated", "TTFT mean s", "TTFT p99 s", "imbalance"]
    print_table(headers + (["adapter loads/min"] if args.adapters else []), table)


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    costs, speedup = Costs.from_calibration(args.calibration, args.speedup) if args.calibration else (Costs(), None)
    if speedup:
        print(f"calibrated costs x{speedup:.1f}: {costs}")
    if not 0 < args.target_load < 2:
        ap.error("--target-load must be in (0, 2)")
    if args.bound_imbalance < 1:
        ap.error("--bound-imbalance must be >= 1 (the busiest replica serves at least the mean)")
    if args.peer_fetch < 0:
        ap.error("--peer-fetch must be >= 0 (0: off)")
    if args.adapters < 0 or args.adapter_slots < 1 or args.lora_load_s < 0:
        ap.error("--adapters and --lora-load-s must be >= 0, --adapter-slots >= 1")
    costs = dataclasses.replace(
        costs, fetch_tok_s=args.peer_fetch, adapter_slots=args.adapter_slots, lora_load_s=args.lora_load_s
    )
    rows = load_trace(args.trace, args.limit)
    adapters = zipf_adapters(rows, args.adapters, args.adapter_zipf) if args.adapters else None
    bounds, results = compare_routers(
        rows,
        args.replicas,
        args.capacity_blocks,
        args.target_load,
        args.router_processes,
        runs_of(args),
        costs,
        args.predict_ttl,
        on_result=lambda label, res: print(f"{label}: done in {res['sim_seconds']:.1f} s", flush=True),
        imbalance=args.bound_imbalance,
        shortlist=args.shortlist,
        progress=lambda label, n: print(f"{label}: {n:,} of {len(rows):,} requests routed", flush=True),
        adapters=adapters,
    )
    report(args, rows, bounds, results)
    payload = {
        "requests": len(rows),
        "replicas": args.replicas,
        "capacity_blocks": args.capacity_blocks,
        "target_load": args.target_load,
        "router_processes": args.router_processes,
        "costs": costs.__dict__,
        "calibration": str(args.calibration) if args.calibration else None,
        "speedup": speedup,
        "bound_imbalance": args.bound_imbalance,
        "shortlist": args.shortlist,
        "adapters": args.adapters,
        "adapter_zipf": args.adapter_zipf,
        "bounds": bounds,
        "routers": results,
    }
    write_json("simulate_calibrated" if args.calibration else "simulate", payload, args.json)


if __name__ == "__main__":
    main()
