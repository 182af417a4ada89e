"""The workload family (benchmarks/harness/trace_workloads.py) and the router suite over it (kvmesh bench suite)."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from collections import Counter

import pytest

from kvmesh.bench.harness.fleet_sim import Costs
from kvmesh.bench.harness.router_cells import ROUTERS, cell, workload_rows
from kvmesh.bench.harness.trace_workloads import WORKLOADS, agentic, arrival_times, long_single, rag, tenants
from kvmesh.cluster.launch.cli import main as cli_main


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_each_workload_is_a_seeded_sorted_mooncake_trace(name):
    rows = WORKLOADS[name](seed=3, size=0.1)
    other = WORKLOADS[name](seed=4, size=0.1)
    assert rows and rows == WORKLOADS[name](seed=3, size=0.1) != other
    assert not {h for r in rows for h in r["hash_ids"]} & {h for r in other for h in r["hash_ids"]}
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    for r in rows:
        assert r["input_length"] == 512 * len(r["hash_ids"]) and r["output_length"] > 0


def test_agentic_sub_agents_fork_from_the_whole_parent_context_within_the_burst():
    rows = agentic(seed=1, size=0.3, fanout_p=0.5, burst_ms=100)
    children: dict[tuple, list[int]] = {}
    for r in rows:
        children.setdefault(tuple(r["hash_ids"][:-1]), []).append(r["timestamp"])
    bursts = []
    for r in rows:  # sub-agents: the parent's context plus one block, sent within a second of the parent
        ts = [t for t in children.get(tuple(r["hash_ids"]), []) if 0 <= t - r["timestamp"] < 1000]
        if len(ts) > 1:
            bursts.append(ts)
    assert len(bursts) >= 5
    assert all(3 <= len(ts) <= 8 and max(ts) - min(ts) <= 100 for ts in bursts)


def test_rag_documents_follow_zipf_and_tenants_share_nothing_across_salts():
    first_doc_block = Counter(r["hash_ids"][1] for r in rag(seed=0, size=0.5, documents=100))
    assert first_doc_block.most_common(1)[0][1] > 10 * 1000 / 100  # the top document: > 10x a uniform share
    one = tenants(seed=0, size=0.2, count=1, groups=4)
    many = tenants(seed=0, size=0.2, count=4, groups=4)
    assert len({r["hash_ids"][0] for r in one}) <= 4 < len({r["hash_ids"][0] for r in many}) <= 16
    blocks = [h for r in long_single(seed=0, size=0.1) for h in r["hash_ids"]]
    assert len(blocks) == len(set(blocks))


def test_bursty_arrivals_are_burstier_than_poisson():
    def cv(shape):
        t = arrival_times(random.Random(0), 4000, shape)
        gaps = [b - a for a, b in itertools.pairwise(t)]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    assert 0.9 < cv("poisson") < 1.1 < 1.3 < cv("bursty")
    with pytest.raises(ValueError, match="arrival"):
        arrival_times(random.Random(0), 10, "weekly")


@pytest.mark.parametrize("workload", ["agentic", "rag"])
def test_kv_aware_leads_every_baseline_on_reuse_heavy_workloads(workload):
    """80% load, 4 router processes (the production shape): kv_aware near the pooled bound and ahead of
    every baseline on mean and p99 time to first token."""
    rows = workload_rows(workload, seed=0, size=0.2)
    c = cell(rows, 4, 1.0, 0.8, 4, list(ROUTERS), Costs())
    res = c["routers"]
    assert c["of_pooled"] >= 0.97
    assert res["kv_aware"]["hit_rate"] >= max(v["hit_rate"] for k, v in res.items() if k != "kv_aware") - 0.01
    assert c["mean_vs_best"] < 0.9 and c["p99_vs_best"] < 1.0 and not c["beaten"]


def test_suite_command_writes_every_cell(tmp_path):
    out = tmp_path / "suite.json"
    rc = cli_main(
        [
            "bench",
            "suite",
            "--workloads",
            "few_shot,chat_diurnal",
            "--loads",
            "0.8",
            "--caches",
            "1,2",
            "--processes",
            "1",
            "--routers",
            "kv_aware,round_robin",
            "--replicas",
            "4",
            "--size",
            "0.05",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    cells = json.loads(out.read_text())["cells"]
    assert {(c["workload"], c["cache_factor"]) for c in cells} == {
        (w, f) for w in ("few_shot", "chat_diurnal") for f in (1.0, 2.0)
    }
    assert all(set(c["routers"]) == {"kv_aware", "round_robin"} for c in cells)
    for c in cells:  # the replication-aware bound sits between what was placed and the infinite cache
        b = c["bounds"]
        assert 0 < b["replicated_placed"] <= b["replicated"] <= b["infinite"]
        assert c["of_replicated"] == pytest.approx(c["routers"]["kv_aware"]["hit_rate"] / b["replicated"])


def test_the_mooncake_like_generator_has_the_real_traces_shape():
    """Fitted to the shipped Mooncake conversation trace: about as many requests per conversation, as long, as
    much reuse on an unbounded cache, every prompt on the one shared system block."""
    from pathlib import Path

    from kvmesh.bench.harness.cache_bounds import lru_hit_rate
    from kvmesh.bench.harness.fleet_sim import load_trace, trace_rows
    from kvmesh.bench.harness.trace_workloads import mooncake

    real = load_trace(Path(__file__).parents[1] / "benchmarks/workloads/mooncake/conversation_trace.jsonl", None)
    made = trace_rows(mooncake(seed=0, size=1.0))
    assert 0.9 < len(made) / len(real) < 1.1
    assert len({chain[0] for _, chain, _ in made}) == 1
    for stat in (
        lambda rows: statistics.median(len(chain) for _, chain, _ in rows),
        lambda rows: statistics.fmean(len(chain) for _, chain, _ in rows),
        lambda rows: lru_hit_rate(rows, None, 1.0)[0],
        lambda rows: statistics.median(out for _, _, out in rows),
    ):
        assert 0.85 < stat(made) / stat(real) < 1.15
