"""How faithful the simulated engine is: against real engines, and against the discrete-event fleet simulator.

    kvmesh bench sim_fidelity [--real 3] [--engines 32] [--timing CALIBRATION.json[:SPEEDUP]] [--repeats 3]

Real against simulated: ``--real`` real ``kvmesh engine`` servers of SmolLM2 (one torch thread each), then as
many simulated ones timed by ``--timing`` (what ``kvmesh bench calibrate --threads 1`` measured on this machine),
each behind ``kvmesh router`` on ``kvmesh bench peer_routers``' workloads (``multi_turn``, ``rag``), alternating,
``--repeats`` pairs: mean TTFT simulated over real per pair (goal within 20%) and hit rates (goal within 2
points). Simulator against fleet: a RAG trace (``--trace-documents``, ``--trace-requests`` at ``--trace-speed``)
as token ids through ``kvmesh router`` to ``--engines`` simulated engines, and replayed by
``benchmarks/harness/fleet_sim.py`` with the same timing, engines, KV blocks and arrival times (goal: hit rates
within 2 points). Writes ``benchmarks/results/sim_fidelity.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from kvmesh.bench.harness.fleet_sim import PREDICT_TTL_S, Costs, FleetSim, trace_rows
from kvmesh.bench.harness.load_client import run_sessions
from kvmesh.bench.harness.peer_fleet import MODEL, add_workload_args, start_engines, start_router
from kvmesh.bench.harness.report import print_table, results_dir, write_json
from kvmesh.bench.harness.trace_workloads import rag
from kvmesh.bench.harness.workloads import trace_sessions
from kvmesh.bench.peer_routers import engine_counters, reset_caches
from kvmesh.bench.sim_fleet import run_cell, start_fleet
from kvmesh.core.step_timing import StepTiming

BLOCK = 16


def real_against_simulated(args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Per repeat and workload: kvmesh router's run on the real engines and on the simulated ones."""
    pairs = []
    real = start_engines(
        args.real, tmp, args.max_num_seqs, model=args.model, engine_args=["--num-kv-blocks", str(args.kv_blocks)]
    )
    fleet, simulated = start_fleet(args.real, tmp, args)
    try:
        for repeat in range(args.repeats):
            for name in args.workloads.split(","):
                runs = {}
                for kind, engines in (("real", real), ("simulated", simulated))[:: 1 if repeat % 2 == 0 else -1]:
                    print(f"[{name} #{repeat + 1}] {kind} engines ...", file=sys.stderr, flush=True)
                    runs[kind] = run_cell("kvmesh_router", name, args, engines)
                pairs.append({"workload": name, "repeat": repeat, **runs})
    finally:
        fleet.stop()
        for child, _ in real:
            child.stop()
    return pairs


def simulator_against_fleet(args: argparse.Namespace, tmp: Path) -> dict:
    """The same RAG trace on ``--engines`` simulated engines behind ``kvmesh router`` and in the fleet simulator."""
    n = args.trace_requests
    rows = rag(seed=args.seed, size=n / 2000, documents=args.trace_documents)[:n]
    for row in rows:  # the simulator's decode steps and the sessions' output tokens alike
        row["output_length"] = min(row["output_length"], args.max_tokens * 32)
    sessions = trace_sessions(rows, block_tokens=BLOCK, speed=args.trace_speed, max_output_tokens=args.max_tokens)
    fleet, engines = start_fleet(args.engines, tmp, args)
    try:
        reset_caches(engines)
        router = start_router("kvmesh_router", args, engines, args.model)
        try:
            prompt0, cached0, _ = engine_counters(engines)
            results, wall = asyncio.run(run_sessions(router.url, args.model, sessions))
            prompt1, cached1, _ = engine_counters(engines)
        finally:
            router.stop()
    finally:
        fleet.stop()
    ok = [r.ttft_s for r in results if r.error is None and r.ttft_s is not None]
    timing = StepTiming.parse(args.timing)
    costs = Costs(timing.prefill_tok_s, timing.decode_s_per_seq, timing.min_step_s, slots=args.max_num_seqs)
    sim = FleetSim(
        trace_rows(rows), args.engines, args.kv_blocks, "kv_aware", {}, 1, 1 / args.trace_speed, PREDICT_TTL_S, costs
    )
    des = sim.run()
    return {
        "fleet": {
            "hit_rate": (cached1 - cached0) / (prompt1 - prompt0) if prompt1 > prompt0 else 0.0,
            "ttft_mean_s": statistics.fmean(ok) if ok else None,
            "errors": len(results) - len(ok),
            "wall_s": wall,
        },
        "simulator": {k: des[k] for k in ("hit_rate", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "imbalance")},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench sim_fidelity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--real", type=int, default=3, help="real engines (and as many simulated ones); 0: skip")
    ap.add_argument("--engines", type=int, default=32, help="simulated engines against the fleet simulator; 0: skip")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--timing", required=True, help="--simulate's timing: this machine's calibration")
    ap.add_argument("--kv-blocks", type=int, default=160, help="KV blocks per engine")
    ap.add_argument("--trace-documents", type=int, default=200, help="the trace check's RAG documents")
    ap.add_argument("--trace-requests", type=int, default=1000, help="the trace check's requests")
    ap.add_argument("--trace-speed", type=float, default=8.0, help="the trace check's speed-up (the trace is 2/s)")
    ap.add_argument("--json", type=Path, default=None)
    add_workload_args(ap)
    args = ap.parse_args(argv)
    out: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="sim-fidelity-") as tmp:
        if args.real:
            out["pairs"] = pairs = real_against_simulated(args, Path(tmp))
            rows = []
            for name in args.workloads.split(","):
                mine = [p for p in pairs if p["workload"] == name]
                ratios = [p["simulated"]["ttft_mean_s"] / p["real"]["ttft_mean_s"] for p in mine]
                gaps = [100 * (p["simulated"]["hit_rate"] - p["real"]["hit_rate"]) for p in mine]
                rows.append(
                    [name, statistics.median(ratios), len(ratios), min(ratios), max(ratios), statistics.median(gaps)]
                )
                out.setdefault("real_vs_simulated", {})[name] = {"ttft_ratio": ratios, "hit_rate_gap_points": gaps}
            print(f"\n{args.real} real vs simulated engines behind kvmesh router")
            print_table(["workload", "TTFT sim/real median", "n", "min", "max", "hit rate gap (points)"], rows)
        if args.engines:
            out["simulator_vs_fleet"] = check = simulator_against_fleet(args, Path(tmp))
            print(
                f"\nRAG trace, {args.trace_requests} requests: {args.engines} simulated engines vs the fleet simulator"
            )
            print_table(
                ["run", "hit rate", "TTFT mean ms"],
                [[k, f"{100 * v['hit_rate']:.1f}%", 1000 * (v["ttft_mean_s"] or 0)] for k, v in check.items()],
            )
    write_json("sim_fidelity", out, args.json or results_dir() / "sim_fidelity.json")


if __name__ == "__main__":
    main()
