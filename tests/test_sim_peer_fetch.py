"""The fleet simulator with replicas that pull a prefix's KV from a peer (issue 58): the router's fetch plans
are carried out, fetched blocks count as hits, and with fetching off nothing changes."""

import json

import pytest

from kvmesh.bench.harness.fleet_sim import Costs, compare_routers, trace_rows
from kvmesh.bench.harness.trace_workloads import mooncake


def without_wall_time(results: dict) -> dict:
    return {label: {k: v for k, v in res.items() if k != "sim_seconds"} for label, res in results.items()}


def test_fetched_blocks_are_hits_and_fetching_off_changes_nothing():
    rows = trace_rows(mooncake(seed=1, size=0.1))
    runs = [("kv_aware", "kv_aware", {}), ("unpriced", "kv_aware", {"peer_fetch": False})]
    bounds, off = compare_routers(rows, 8, 3000, 0.8, 4, runs)
    _, on = compare_routers(rows, 8, 3000, 0.8, 4, runs, Costs(fetch_tok_s=100_000))
    fetched, local = on["kv_aware"], off["kv_aware"]
    assert fetched["fetched_rate"] > 0.01 and fetched["hit_rate"] >= local["hit_rate"]
    assert fetched["hit_rate"] == pytest.approx(fetched["local_hit_rate"] + fetched["fetched_rate"])
    assert fetched["hit_rate"] <= bounds["infinite"]
    assert local["fetched_rate"] == 0 and local["local_hit_rate"] == local["hit_rate"]
    assert local["recomputed_rate"] == 1 - local["hit_rate"]
    # Replicas able to fetch under a router that never plans it run exactly as replicas unable to.
    assert without_wall_time(off)["kv_aware"] == without_wall_time(off)["unpriced"] == without_wall_time(on)["unpriced"]


def test_simulate_command_reports_fetched_blocks(tmp_path):
    """``kvmesh bench simulate --peer-fetch TOK_S`` writes each router's ``fetched_rate`` beside its hit rate,
    which counts them; without the option none are fetched."""
    from kvmesh.cluster.launch.cli import main as cli_main

    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in mooncake(seed=1, size=0.1)))
    args = ["bench", "simulate", "--trace", str(trace), "--replicas", "8", "--routers", "kv_aware,session_hash"]
    out = {}
    for label, extra in (("off", []), ("on", ["--peer-fetch", "100000"])):
        out[label] = tmp_path / f"{label}.json"
        assert cli_main([*args, *extra, "--json", str(out[label])]) == 0
    off, on = (json.loads(p.read_text()) for p in out.values())
    assert on["costs"]["fetch_tok_s"] == 100_000 and off["costs"]["fetch_tok_s"] == 0
    assert on["routers"]["kv_aware"]["fetched_rate"] > 0 == off["routers"]["kv_aware"]["fetched_rate"]
    assert on["routers"]["kv_aware"]["hit_rate"] >= off["routers"]["kv_aware"]["hit_rate"]
    assert on["routers"]["session_hash"]["fetched_rate"] == 0  # a baseline plans no fetch
