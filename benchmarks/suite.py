"""Every router on every workload shape, in the simulator: does a policy hold beyond the trace it was tuned on?

For each workload of ``benchmarks/harness/trace_workloads.py`` (plus bursty and diurnal variants), each load, each
fleet cache size (a multiple of the workload's working set: its distinct blocks) and each number of router
processes, the simulator (``benchmarks/harness/fleet_sim.py``) runs every router on the same trace. A cell reports
kv_aware's hit rate as a share of the pooled-LRU bound (and of the replication-aware one,
``benchmarks/harness/cache_bounds.py``) and its mean / p99 TTFT against the best baseline,
and is flagged when a baseline beats kv_aware by more than 5% on mean or p99 TTFT. Writes JSON and a PNG
heatmap (needs matplotlib).

    kvmesh bench suite                                   # the full grid
    kvmesh bench suite --workloads agentic,rag --loads 0.8 --caches 1 --processes 4 --size 0.3
    kvmesh bench suite --loads 0.8 --caches 1,4 --processes 4 --kv-aware '{"busy_weight": 0}'   # a variant
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from kvmesh.bench.harness.fleet_sim import Costs
from kvmesh.bench.harness.report import print_table, pyplot, save_figure, write_json
from kvmesh.bench.harness.router_cells import ROUTERS, VARIANTS, cell, workload_rows
from kvmesh.bench.harness.trace_workloads import WORKLOADS

SUITE_WORKLOADS = tuple(w for w in WORKLOADS if w != "mooncake")
"""The grid's generators: all but the fleet-scale Mooncake-like trace (``kvmesh bench simulate`` and
``kvmesh bench fleet_scale`` run that one)."""


def heatmap(cells: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    workloads = list(dict.fromkeys(c["workload"] for c in cells))
    columns = list(dict.fromkeys((c["load"], c["cache_factor"], c["processes"]) for c in cells))
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.6 * len(columns) + 3), 1.2 * len(workloads) + 3))
    for ax, key, title, cmap, lims in (
        (axes[0], "of_pooled", "kv_aware hit rate / pooled-LRU bound", "RdYlGn", (0.8, 1.0)),
        (axes[1], "mean_vs_best", "kv_aware mean TTFT / best baseline", "RdYlGn_r", (0.0, 1.5)),
    ):
        grid = [[math.nan] * len(columns) for _ in workloads]
        for c in cells:
            value = c.get(key)
            if value is not None:
                grid[workloads.index(c["workload"])][columns.index((c["load"], c["cache_factor"], c["processes"]))] = (
                    value
                )
        im = ax.imshow(grid, cmap=cmap, vmin=lims[0], vmax=lims[1], aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(workloads)), workloads)
        ax.set_xticks(range(len(columns)), [f"L{lo:g} C{c:g} P{p}" for lo, c, p in columns], rotation=90, fontsize=7)
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench suite", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workloads", default=",".join([*SUITE_WORKLOADS, *VARIANTS]))
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--loads", default="0.5,0.8,0.95")
    ap.add_argument("--caches", default="0.5,1,2,4", help="fleet cache as multiples of the working set")
    ap.add_argument("--processes", default="1,4", help="router processes")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--size", type=float, default=1.0, help="scales each workload's sessions / requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-aware", type=json.loads, default={}, help="kv_aware settings, e.g. '{\"busy_weight\": 0}'")
    ap.add_argument("--json", type=Path, default=None)
    return ap


def run_grid(args: argparse.Namespace, names: list[str], routers: list[str]) -> tuple[list[dict], list[list]]:
    """Every cell of the grid (workload x load x cache x processes), with its progress printed, and its row
    of the summary table."""
    grid = [
        (load, cache, procs)
        for load in map(float, args.loads.split(","))
        for cache in map(float, args.caches.split(","))
        for procs in map(int, args.processes.split(","))
    ]
    cells, table, t0 = [], [], time.perf_counter()
    for name in names:
        rows = workload_rows(name, args.seed, args.size)
        for load, cache, procs in grid:
            c = cell(rows, args.replicas, cache, load, procs, routers, Costs(), args.kv_aware)
            c.update(workload=name, requests=len(rows), load=load, cache_factor=cache, processes=procs)
            cells.append(c)
            print(
                f"[{len(cells)}/{len(names) * len(grid)} {time.perf_counter() - t0:.0f} s] {name} load {load:g} "
                f"cache {cache:g}x procs {procs}: of pooled {c.get('of_pooled') or 0:.1%}, "
                f"mean vs best {c.get('mean_vs_best') or 0:.2f}x",
                flush=True,
            )
            table.append(
                [
                    name,
                    load,
                    cache,
                    procs,
                    f"{c['bounds']['pooled_lru']:.1%}",
                    f"{c.get('of_pooled') or 0:.1%}",
                    f"{c.get('of_replicated') or 0:.1%}",
                    c.get("mean_vs_best"),
                    c.get("p99_vs_best"),
                    "BEATEN" if c.get("beaten") else "",
                ]
            )
    return cells, table


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS and w not in VARIANTS]
    if unknown:
        ap.error(f"unknown workloads {unknown}; choose from {[*WORKLOADS, *VARIANTS]}")
    routers = [r for r in args.routers.split(",") if r]
    cells, table = run_grid(args, names, routers)
    print()
    print_table(
        [
            "workload",
            "load",
            "cache x",
            "procs",
            "pooled bound",
            "kv_aware of pooled",
            "of replicated",
            "mean/best",
            "p99/best",
            "",
        ],
        table,
    )
    path = write_json(
        "suite",
        {
            "replicas": args.replicas,
            "size": args.size,
            "seed": args.seed,
            "routers": routers,
            "kv_aware": args.kv_aware,
            "cells": cells,
        },
        args.json,
    )
    heatmap(cells, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
