"""Host-tier routing in the fleet simulator: tier-aware vs tier-blind vs no host tier, same policy code.

Each workload runs three ways on the same fleet, the device caches holding ``--device-factor`` (default
half) of the working set between them and each replica's host tier ``--host-factor`` (default 4) times its
device capacity. The working set is the blocks used by more than one request (most blocks of a trace are
used once and never need a place):

- ``tier_aware``: kv_aware prices a prefix in a replica's host tier at that replica's load rate;
- ``tier_blind``: the same engines (they still load what they find), routed as if host tiers did not exist;
- ``no_host_tier``: evicted blocks are dropped.

Two references bound what any tier could give, at the same offered load:

- ``unbounded``: kv_aware on device caches that never evict (no tier of any size can do better for it);
- ``floor``: each request computing only the blocks no earlier request brought, with no queue at all: a
  mean TTFT no router and no cache can go below.

Workloads: the Mooncake conversation trace (``--trace``) and the agentic and chat generators of
``benchmarks/harness/trace_workloads.py``. Offered load is set as in ``kvmesh bench simulate`` (``--target-load``
of the fleet's prefill capacity on the pooled-LRU bound of the device caches alone).

    kvmesh bench host_tier_sim --trace benchmarks/workloads/mooncake/conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.bench.harness.fleet_sim import Costs, load_trace, trace_rows
from kvmesh.bench.harness.host_tier_modes import run_workload
from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.bench.harness.trace_workloads import WORKLOADS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench host_tier_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--trace", type=Path, default=Path("benchmarks/workloads/mooncake/conversation_trace.jsonl"))
    ap.add_argument("--replicas", type=int, default=16, help="for the Mooncake trace (agentic, chat: half)")
    ap.add_argument("--device-factor", type=float, default=0.5, help="fleet device cache / working set")
    ap.add_argument("--host-factor", type=float, default=4.0, help="host tier / device cache, per replica")
    ap.add_argument("--target-load", type=float, default=0.8)
    ap.add_argument("--router-processes", type=int, default=4)
    ap.add_argument("--size", type=float, default=1.0, help="size of the generated agentic and chat traces")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.device_factor <= 0 or args.host_factor < 0:
        ap.error("--device-factor must be > 0 and --host-factor >= 0")
    workloads = {
        name: (trace_rows(WORKLOADS[name](seed=0, size=args.size)), args.replicas // 2) for name in ("agentic", "chat")
    }
    if args.trace.exists():
        workloads = {"mooncake": (load_trace(args.trace, None), args.replicas), **workloads}
    else:
        print(f"{args.trace} not found: the Mooncake trace is skipped")
    out, table = {}, []
    for name, (rows, replicas) in workloads.items():
        print(f"{name}: {len(rows)} requests on {replicas} replicas ...", flush=True)
        res = out[name] = run_workload(
            rows, replicas, args.device_factor, args.host_factor, args.target_load, args.router_processes
        )
        blind = res["modes"]["tier_blind"]["ttft_mean_s"]
        for mode, r in res["modes"].items():
            table.append(
                [
                    name,
                    mode,
                    f"{r['hit_rate']:.1%}",
                    f"{r['host_hit_rate']:.1%}",
                    r["ttft_mean_s"],
                    r["ttft_p99_s"],
                    f"{r['ttft_mean_s'] / blind:.2f}x",
                ]
            )
        floor = res["floor_ttft_mean_s"]
        table.append([name, "floor", f"{res['floor_hit_rate']:.1%}", "", floor, "", f"{floor / blind:.2f}x"])
    print(
        f"\ndevice caches {args.device_factor:g}x the working set, host tiers {args.host_factor:g}x the device, "
        f"load {args.target_load}"
    )
    print_table(["workload", "mode", "hit rate", "from host", "TTFT mean s", "TTFT p99 s", "mean / blind"], table)
    payload = {
        "device_factor": args.device_factor,
        "host_factor": args.host_factor,
        "target_load": args.target_load,
        "router_processes": args.router_processes,
        "costs": Costs().__dict__,
        "workloads": out,
    }
    write_json("host_tier_sim", payload, args.json)


if __name__ == "__main__":
    main()
