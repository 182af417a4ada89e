"""The trace simulator runs the real policy objects; on a small synthetic trace kv_aware must out-reuse
round robin and stay within the pooled-LRU bound."""

import json

from benchmarks.simulate import Costs, load_trace, lru_hit_rate, simulate


def test_kv_aware_beats_round_robin_on_a_conversation_trace(tmp_path):
    rows, t = [], 0
    for turn in range(6):  # 41 conversations whose history grows turn by turn
        for c in range(41):
            t += 50
            ids = [0] + [1000 * c + k for k in range(1, 4 + 3 * turn)]
            rows.append({"timestamp": t, "input_length": 512 * len(ids), "output_length": 64, "hash_ids": ids})
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    trace = load_trace(path, None)
    pooled, work = lru_hit_rate(trace, 4 * 200, Costs().prefill_tok_s)
    scale = work / (0.7 * 4 * (trace[-1][0] - trace[0][0]))
    ours = simulate(trace, 4, 200, "kv_aware", {}, 2, scale, 10.0)
    rr = simulate(trace, 4, 200, "round_robin", {}, 2, scale, 10.0)
    assert ours["hit_rate"] > 1.5 * rr["hit_rate"]
    assert ours["hit_rate"] <= pooled + 1e-9
    assert ours["ttft_mean_s"] < rr["ttft_mean_s"]


def test_calibrated_costs_keep_the_measured_balance(tmp_path):
    cal = tmp_path / "calibration.json"
    cal.write_text(json.dumps({"prefill_tok_s": 1000.0, "step_base_s": 0.03, "decode_s_per_seq": 0.002}))
    costs, speedup = Costs.from_calibration(cal)
    assert speedup == 20.0 and costs.prefill_tok_s == 20_000.0  # brought to the GPU-class prefill rate
    assert costs.min_step_s == 0.03 / 20 and costs.decode_s_per_seq == 0.002 / 20
    assert Costs.from_calibration(cal, speedup=2.0)[0].prefill_tok_s == 2000.0


def test_a_replicas_queued_prefill_never_reads_below_zero(monkeypatch):
    """A prediction can deepen a replica's device hits past where its host-tier blocks were counted from;
    the queued prefill the router is told must still never go negative, or that replica looks ever cheaper
    and takes the whole fleet's traffic (an agentic run once sent 1,745 of 2,443 requests to one of 8)."""
    import math

    from benchmarks.host_tier_sim import working_set
    from benchmarks.simulate import Replica, compare_routers, trace_rows
    from benchmarks.trace_workloads import agentic

    seen = []
    load = Replica.load

    def checked(self, now):
        seen.append(self.queued_tokens)
        return load(self, now)

    monkeypatch.setattr(Replica, "load", checked)
    rows = trace_rows(agentic(seed=0, size=1.0))
    capacity = math.ceil(0.25 * working_set(rows) / 8)
    _, res = compare_routers(
        rows, 8, capacity, 0.8, 4, [("kv_aware", "kv_aware", {})], Costs(), host_capacity=4 * capacity
    )
    assert min(seen) >= 0 and res["kv_aware"]["imbalance"] < 1.5
