"""Host-tier routing in the fleet simulator (``benchmarks/harness/fleet_sim.py``), one workload three ways on the
same fleet (tier-aware, tier-blind, no host tier) and two references (unbounded caches, the no-queue floor);
``kvmesh bench host_tier_sim`` describes them and runs them over its workloads."""

from __future__ import annotations

import math
from collections import Counter

from kvmesh.bench.harness.cache_bounds import lru_hit_rate
from kvmesh.bench.harness.fleet_sim import PREDICT_TTL_S, Costs, FleetSim, compare_routers, offered_scale

MODES = {
    "tier_aware": (True, {}),
    "tier_blind": (True, {"host_tier": False}),
    "no_host_tier": (False, {}),
}
"""Mode -> (replicas have a host tier, kv_aware keyword settings)."""


def working_set(rows) -> int:
    """Blocks used by more than one request: what a cache must keep to serve every reuse there is."""
    seen: Counter = Counter(h for _, chain, _ in rows for h in set(chain))
    return sum(1 for n in seen.values() if n > 1)


def run_workload(rows, replicas: int, device_factor: float, host_factor: float, load: float, processes: int) -> dict:
    """The three modes and the two references on one workload; kv_aware throughout."""
    costs = Costs()
    distinct = working_set(rows)
    capacity = max(1, math.ceil(device_factor * distinct / replicas))
    host_capacity = max(1, math.ceil(host_factor * capacity))
    results, bounds = {}, {}
    for mode, (tiered, kwargs) in MODES.items():
        bounds, res = compare_routers(
            rows,
            replicas,
            capacity,
            load,
            processes,
            [(mode, "kv_aware", kwargs)],
            costs,
            host_capacity=host_capacity if tiered else 0,
        )
        results.update(res)
    scale, _, _ = offered_scale(rows, replicas, capacity, load, costs)
    every_block = sum(len(chain) for _, chain, _ in rows)
    sim = FleetSim(rows, replicas, every_block, "kv_aware", {}, processes, scale, PREDICT_TTL_S, costs)
    results["unbounded"] = sim.run()
    infinite, floor_work = lru_hit_rate(rows, None, costs.prefill_tok_s)
    floor = floor_work / len(rows)
    blind = results["tier_blind"]["ttft_mean_s"]
    return {
        "requests": len(rows),
        "working_set_blocks": distinct,
        "capacity_blocks": capacity,
        "host_capacity_blocks": host_capacity,
        "bounds": bounds,
        "modes": results,
        "floor_ttft_mean_s": floor,
        "floor_hit_rate": infinite,
        "aware_vs_blind_mean": results["tier_aware"]["ttft_mean_s"] / blind,
        "aware_vs_none_mean": results["tier_aware"]["ttft_mean_s"] / results["no_host_tier"]["ttft_mean_s"],
        "unbounded_vs_blind_mean": results["unbounded"]["ttft_mean_s"] / blind,
        "floor_vs_blind_mean": floor / blind,
    }
