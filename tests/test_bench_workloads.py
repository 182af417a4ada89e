"""Benchmark building blocks: seeded workloads, trace replay keeping prefix structure, the pooled bound."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from kvmesh.bench.harness.cache_bounds import pooled_bound
from kvmesh.bench.harness.workloads import (
    block_tokens_for,
    build_workload,
    mooncake_trace,
    multi_turn_chat,
    shared_prefix,
)


def test_workloads_are_reproducible_from_their_seed():
    assert multi_turn_chat(seed=3) == multi_turn_chat(seed=3)
    assert multi_turn_chat(seed=3) != multi_turn_chat(seed=4)
    assert shared_prefix(seed=1) == shared_prefix(seed=1)


def test_multi_turn_chat_shape():
    sessions = multi_turn_chat(seed=0, conversations=5, turns=3, rate=2.0, context_tokens=50)
    assert len(sessions) == 5 and all(len(s.steps) == 3 for s in sessions)
    assert len({s.system for s in sessions}) == 1  # one system prompt shared by every conversation
    assert all("document for case" in s.steps[0].text for s in sessions)
    assert all("document" not in step.text for s in sessions for step in s.steps[1:])
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts) and starts[0] == 0.0 and starts[-1] > 0


def test_shared_prefix_groups():
    sessions = shared_prefix(seed=0, groups=3, prompts_per_group=4)
    assert len(sessions) == 12
    by_group = {}
    for s in sessions:
        by_group.setdefault(s.labels["group"], set()).add(s.system)
    assert len(by_group) == 3 and all(len(systems) == 1 for systems in by_group.values())


def test_trace_replay_keeps_prefix_structure(tmp_path: Path):
    rows = [
        {"timestamp": 1000, "input_length": 1024, "output_length": 512, "hash_ids": [7, 8]},
        {"timestamp": 3000, "input_length": 1500, "output_length": 100, "hash_ids": [7, 8, 9]},
        {"timestamp": 5000, "input_length": 400, "output_length": 10, "hash_ids": [10]},
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    sessions = mooncake_trace(trace, block_tokens=16, speed=2.0, max_output_tokens=8)
    a, b, c = (s.steps[0] for s in sessions)
    assert len(a.token_ids) == 32 and b.token_ids[:32] == a.token_ids and c.token_ids[:16] != a.token_ids[:16]
    assert [s.start_s for s in sessions] == [0.0, 1.0, 2.0]
    assert (a.max_tokens, b.max_tokens, c.max_tokens) == (8, 3, 1)  # 512*16/512=16 -> cap 8; 100/32 -> 3
    assert block_tokens_for(7, 16) == block_tokens_for(7, 16) != block_tokens_for(8, 16)
    assert sessions[0].chat is False


def test_pooled_bound_counts_reuse_like_the_engine():
    a = list(range(100, 164))  # 4 blocks of 16
    # second request repeats the first: 3 blocks reusable (the last prompt token is always recomputed)
    assert pooled_bound([(a, []), (a, [])], 16, 100) == (3 * 16) / (2 * 64)
    # a reply's full blocks are reusable by the next turn that contains it
    reply = list(range(500, 532))
    turn2 = a + reply + [1, 2, 3]
    assert pooled_bound([(a, reply), (turn2, [])], 16, 100) == (6 * 16) / (64 + len(turn2))
    # capacity bounds it: a one-block pool keeps only the newest chain's first block (tails go first)
    assert pooled_bound([(a, []), (a, [])], 16, 1) == 16 / (2 * 64)
    assert pooled_bound([(a, []), (list(range(900, 964)), []), (a, [])], 16, 1) == 0.0
    # warm-up traffic fills the cache without being counted
    assert pooled_bound([(a, [])], 16, 100, prefill=[(a, [])]) == (3 * 16) / 64


def test_autoscale_prompts_step_or_ramp_to_the_long_length():
    """The autoscale benchmark's load: short prompts, then long ones at once (a step) or growing linearly
    over ``ramp_s`` (a ramp), each within ±10% of its nominal length, token ids never shared."""
    from argparse import Namespace

    from kvmesh.bench.harness.workloads import StepPrompts

    args = Namespace(base_s=10.0, step_s=40.0, ramp_s=0.0, short=100, long=600, max_tokens=8)
    step = StepPrompts(0, args)
    lengths = {t: len(step(t).steps[0].token_ids) for t in (0.0, 9.9, 10.0, 49.9)}
    assert 90 <= lengths[0.0] <= 110 and 90 <= lengths[9.9] <= 110
    assert 540 <= lengths[10.0] <= 660 and 540 <= lengths[49.9] <= 660
    assert step(50.0) is None  # the load ends after base + step
    ramp = StepPrompts(0, Namespace(**{**vars(args), "ramp_s": 20.0}))
    for t, nominal in ((5.0, 100), (10.0, 100), (15.0, 225), (20.0, 350), (25.0, 475), (30.0, 600), (45.0, 600)):
        n = len(ramp(t).steps[0].token_ids)
        assert int(0.9 * nominal) <= n <= int(1.1 * nominal), (t, n)
    assert [s.labels["phase"] for s in ramp.sessions] == ["base", "step", "step", "step", "step", "step", "step"]
    firsts = [s.steps[0].token_ids[:8] for s in ramp.sessions]
    assert len({tuple(f) for f in firsts}) == len(firsts)


def test_bench_run_replays_generated_agentic_and_rag_traces_with_a_disjoint_warm_up():
    args = argparse.Namespace(workload="rag", sessions=30, warmup=4, block_tokens=16, speed=2.0, max_tokens=8)
    measured, warm = build_workload(args, 0), build_workload(args, 1000, warmup=True)
    assert len(measured) == 30 and len(warm) == 4 and all(not s.chat for s in measured)
    assert measured[0].start_s == 0 and all(a.start_s <= b.start_s for a, b in itertools.pairwise(measured))
    prompts = [s.steps[0].token_ids for s in measured]
    assert sum(p[:16] == prompts[0][:16] for p in prompts) > 1  # the shared instruction block
    assert not {tuple(p[:16]) for p in prompts} & {tuple(s.steps[0].token_ids[:16]) for s in warm}
    args.workload = "agentic"
    assert len(build_workload(args, 0)) == 30


def test_the_mooncake_trace_in_the_repository_is_the_published_one():
    """The trace the routing benchmarks replay travels with the repository, unchanged (its README names the
    source, licence and checksum)."""
    import hashlib
    from pathlib import Path

    trace = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads" / "mooncake" / "conversation_trace.jsonl"
    digest = hashlib.sha256(trace.read_bytes()).hexdigest()
    assert digest == "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
    sessions = mooncake_trace(trace, block_tokens=16, speed=1.0, max_output_tokens=8)
    assert sum(len(s.steps) for s in sessions) == 12031
