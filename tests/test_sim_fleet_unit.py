"""Pure logic of the simulated fleet: the step timing's forms, workloads (scaled to a fleet; the Mooncake trace's),
per-pair ratios."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from kvmesh.bench.harness.peer_fleet import MOONCAKE_WARMUP_ROW, _mooncake_rows, workload
from kvmesh.bench.sim_fleet import pair_ratios, scaled
from kvmesh.core.step_timing import StepTiming


def test_step_timing_forms(tmp_path):
    assert StepTiming.parse("default") == StepTiming()
    timing = StepTiming.parse("prefill_tok_s=1000,min_step_s=0.05")
    assert timing == StepTiming(prefill_tok_s=1000.0, min_step_s=0.05)
    assert timing.step_s(500, 10) == pytest.approx(0.05 + 10 * 0.00025 + 0.5)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"prefill_tok_s": 500.0, "decode_s_per_seq": 0.004, "step_base_s": 0.08}))
    assert StepTiming.parse(str(cal)) == StepTiming(20_000.0, 0.0001, 0.002)  # to the default prefill rate
    assert StepTiming.parse(f"{cal}:1") == StepTiming(500.0, 0.004, 0.08)
    for bad in ("prefill_tok_s=0", "speed=3", str(tmp_path / "missing.json")):
        with pytest.raises(ValueError):
            StepTiming.parse(bad)


def test_workloads_scale_with_the_fleet():
    args = argparse.Namespace(sessions=12, rate=0.4, requests=60, documents=12, speed=1.0)
    big = scaled(args, 30)
    assert (big.sessions, big.requests, big.documents) == (120, 600, 120)
    assert big.rate == pytest.approx(4.0) and big.speed == pytest.approx(10.0) and args.sessions == 12


def test_the_mooncake_workload_replays_the_trace_in_order_as_text():
    """``--workloads mooncake``: the real trace's first rows at their own pace (sped up by ``speed``), as text
    prompts any router takes; conversations that continue share their prompt's start; the warm-up is far away."""
    args = argparse.Namespace(requests=40, speed=2.0, max_tokens=16)
    rows = _mooncake_rows()
    sessions = workload("mooncake", 0, False, args)
    assert len(sessions) == 40 and all(s.steps[0].text and s.steps[0].token_ids is None for s in sessions)
    starts = [s.start_s for s in sessions]
    span_s = (rows[39]["timestamp"] - rows[0]["timestamp"]) / 1000
    assert starts == sorted(starts) and starts[-1] == pytest.approx(span_s / 2 / 2)  # 8-token blocks: twice as fast
    first_block = {}
    for row, session in zip(rows, sessions, strict=False):  # the same first block: the same leading text
        first_block.setdefault(row["hash_ids"][0], []).append(session.steps[0].text)
    shared = [texts for texts in first_block.values() if len(texts) > 1]
    assert shared and all(len({text[:40] for text in texts}) == 1 for texts in shared)
    warm = {h for row in rows[MOONCAKE_WARMUP_ROW : MOONCAKE_WARMUP_ROW + 3] for h in row["hash_ids"][1:]}
    timed = {h for row in rows[:40] for h in row["hash_ids"]}
    assert len(workload("mooncake", 0, True, args)) == 3 and not warm & timed


def test_the_agentic_workload_sends_fan_out_bursts_that_share_their_parents_context():
    """``--workloads agentic``: agent steps as text prompts in arrival order; a step that forks sends several
    sub-agents within a burst, each the same context (the same leading text) with its own task."""
    args = argparse.Namespace(requests=60, speed=1.0, max_tokens=16)
    sessions = workload("agentic", 0, False, args)
    assert len(sessions) == 60 and all(s.steps[0].text and s.steps[0].token_ids is None for s in sessions)
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts)
    # sub-agents of one fork: arriving together, sharing all but their last block
    bursts = [(a, b) for a, b in itertools.pairwise(sessions) if b.start_s - a.start_s < 0.1]
    assert bursts and all(a.steps[0].text[:200] == b.steps[0].text[:200] for a, b in bursts)
    assert len(workload("agentic", 1000, True, args)) == 3


def test_pair_ratios_take_the_best_peer_of_each_repeat():
    """One kvmesh router against single-instance peers, three against three; round robin stands in both."""
    run = lambda mean, p90: {"ttft_mean_s": mean, "ttft_p90_s": p90}  # noqa: E731
    runs = {
        "16 engines / rag": {
            "kvmesh_router": [run(1.0, 2.0), run(2.0, 2.0)],
            "smg_cache_aware": [run(2.0, 4.0), run(1.0, 1.0)],
            "round_robin": [run(4.0, 3.0), run(4.0, 4.0)],
            "kvmesh_router_x3": [run(3.0, 3.0), run(3.0, 3.0)],
            "smg_x3": [run(6.0, 6.0), run(2.0, 2.0)],
        }
    }
    kinds = ["kvmesh_router", "kvmesh_router_x3", "smg_cache_aware", "smg_x3", "round_robin"]
    found = pair_ratios(runs, kinds)
    many = {r["stat"]: r for r in found if r["router"] == "kvmesh_router_x3"}
    assert many["ttft_mean_s"]["peers"] == ["smg_x3", "round_robin"]
    assert (many["ttft_mean_s"]["min"], many["ttft_mean_s"]["max"]) == (0.75, 1.5)
    ratios = {r["stat"]: r for r in found if r["router"] == "kvmesh_router"}
    assert ratios["ttft_mean_s"]["peers"] == ["smg_cache_aware", "round_robin"]
    assert ratios["ttft_mean_s"]["median"] == pytest.approx(1.25) and ratios["ttft_mean_s"]["n"] == 2
    assert (ratios["ttft_mean_s"]["min"], ratios["ttft_mean_s"]["max"]) == (0.5, 2.0)
    assert ratios["ttft_p90_s"]["median"] == pytest.approx((2 / 3 + 2.0) / 2)
