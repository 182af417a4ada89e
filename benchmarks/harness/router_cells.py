"""One cell of the router suite (``kvmesh bench suite``): every router on one workload's trace in the fleet
simulator (``benchmarks/harness/fleet_sim.py``) at one load, fleet cache size and number of router processes,
and how kv_aware fares there against the pooled-LRU and replication-aware bounds and the best baseline."""

from __future__ import annotations

import math

from kvmesh.bench.harness.fleet_sim import Costs, compare_routers, trace_rows
from kvmesh.bench.harness.trace_workloads import WORKLOADS

ROUTERS = ("kv_aware", "pow2", "round_robin", "session_hash", "approx_tree")
VARIANTS = {"agentic_bursty": ("agentic", "bursty"), "chat_diurnal": ("chat", "diurnal")}
"""Extra suite workloads: a generator with a non-Poisson arrival shape."""
SLACK = 1.05
"""A baseline beating kv_aware by more than this factor on mean or p99 TTFT flags the cell."""


def workload_rows(name: str, seed: int, size: float):
    gen, arrival = VARIANTS.get(name, (name, "poisson"))
    return trace_rows(WORKLOADS[gen](seed=seed, size=size, arrival=arrival))


def cell(
    rows, replicas: int, cache_factor: float, load: float, processes: int, routers, costs: Costs, kv_kwargs=None
) -> dict:
    """One cell of the grid: every router on ``rows``, and how kv_aware (with ``kv_kwargs``) fares against the
    best baseline."""
    distinct = len({h for _, chain, _ in rows for h in chain})
    capacity = max(1, math.ceil(cache_factor * distinct / replicas))
    runs = [(r, r, (kv_kwargs or {}) if r == "kv_aware" else {}) for r in routers]
    bounds, results = compare_routers(rows, replicas, capacity, load, processes, runs, costs)
    out = {"capacity_blocks": capacity, "working_set_blocks": distinct, "bounds": bounds, "routers": results}
    ours, others = results.get("kv_aware"), {k: v for k, v in results.items() if k != "kv_aware"}
    if ours is not None and others:
        best_mean = min(v["ttft_mean_s"] for v in others.values())
        best_p99 = min(v["ttft_p99_s"] for v in others.values())
        out["of_pooled"] = ours["hit_rate"] / bounds["pooled_lru"] if bounds["pooled_lru"] > 0 else None
        out["of_replicated"] = ours["hit_rate"] / bounds["replicated"] if bounds["replicated"] > 0 else None
        out["mean_vs_best"] = ours["ttft_mean_s"] / best_mean if best_mean > 0 else None
        out["p99_vs_best"] = ours["ttft_p99_s"] / best_p99 if best_p99 > 0 else None
        out["beaten"] = bool(ours["ttft_mean_s"] > SLACK * best_mean or ours["ttft_p99_s"] > SLACK * best_p99)
    return out
