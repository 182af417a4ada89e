"""Adapter-aware routing on fake replicas (pure logic): a request on a LoRA adapter goes where the adapter is
held unless reading it elsewhere costs less than the holder's queue."""

from __future__ import annotations

import pytest

from kvmesh.core.hashing import first_block_extra, hash_blocks, model_seed
from kvmesh.core.messages import LoadReport
from kvmesh.router.policy import DEFAULT_LORA_LOAD_S, KVAwarePolicy, ReplicaLoad, RouteRequest

SEED = model_seed("t")


def on(adapter: str | None, first_token: int, tokens: int = 256) -> RouteRequest:
    ids = list(range(first_token, first_token + tokens))
    return RouteRequest(hash_blocks(ids, 16, SEED, first_block_extra(None, adapter)), tokens, 16, None, adapter)


def fleet(*held: list[str], slots: int = 4, load_s: float | None = 0.05) -> list[ReplicaLoad]:
    return [
        ReplicaLoad(index_id=f"r{i}", prefill_tok_s=2000, loras=list(h), lora_slots=slots, lora_load_s=load_s)
        for i, h in enumerate(held)
    ]


def test_a_request_goes_to_the_replica_holding_its_adapter():
    reps = fleet([], ["a"], [])
    for first in range(0, 3000, 300):  # new prompts each time: no KV hit anywhere
        assert KVAwarePolicy().rank(on("a", first), reps, {}).ranked[0] == "r1"
    base = KVAwarePolicy().rank(on(None, 0), reps, {})
    assert base.tied == 3  # the base model needs no adapter: every idle replica is as good


def test_adapter_blind_routing_sees_no_difference():
    d = KVAwarePolicy(adapter_weight=0).rank(on("a", 0), fleet([], ["a"], []), {})
    assert d.tied == 3 and set(d.costs.values()) == {d.costs["r1"]}
    with pytest.raises(ValueError, match="adapter_weight"):
        KVAwarePolicy(adapter_weight=-1)


def test_a_hot_adapter_spreads_once_its_holders_queue_costs_more_than_a_read():
    reps = fleet(["a"], [])
    reps[0].pending_prefill_tokens = 50  # 25 ms queued: less than a 50 ms read elsewhere
    assert KVAwarePolicy().rank(on("a", 0), reps, {}).ranked[0] == "r0"
    reps[0].pending_prefill_tokens = 1000  # 0.5 s queued: reading it on the idle peer is sooner
    assert KVAwarePolicy().rank(on("a", 0), reps, {}).ranked[0] == "r1"


def test_the_measured_read_time_prices_the_move():
    reps = fleet(["a"], [], load_s=2.0)  # a slow read (a big adapter, a busy disk): worth a 0.5 s queue
    reps[0].pending_prefill_tokens = 1000
    assert KVAwarePolicy().rank(on("a", 0), reps, {}).ranked[0] == "r0"
    unmeasured = fleet(["a"], [], load_s=None)
    d = KVAwarePolicy().rank(on("a", 0), unmeasured, {})
    assert d.costs["r1"] - d.costs["r0"] == pytest.approx(DEFAULT_LORA_LOAD_S)


def test_a_read_that_evicts_a_live_adapter_costs_more():
    """Reading ``a`` on r0 (both slots full) evicts its least recently used adapter; r1 has a free slot. While
    that adapter is idle, evicting it costs nothing; once this router sends r0 requests on both its adapters
    (live conversations), the eviction is charged a read (the next turn reads it again) and ``a`` goes to r1."""
    policy, reps = KVAwarePolicy(), fleet(["x", "y"], ["z"], slots=2)
    d = policy.rank(on("a", 0), reps, {})
    assert d.costs["r0"] == pytest.approx(d.costs["r1"])
    for first, adapter in ((1000, "x"), (2000, "y")):
        policy.on_routed(on(adapter, first), "r0", policy.rank(on(adapter, first), reps, {}))
    d = policy.rank(on("a", 3000), reps, {})
    assert d.ranked[0] == "r1" and d.costs["r0"] - d.costs["r1"] == pytest.approx(0.05)


def test_a_burst_on_a_cold_adapter_lands_where_the_first_went_before_any_report():
    """No replica holds ``b``: the first request picks one, and the next ones (new prompts, before the
    replica's report says it holds ``b``) follow it instead of reading ``b`` everywhere."""
    policy, reps = KVAwarePolicy(), fleet([], [], [])
    first = policy.rank(on("b", 0), reps, {})
    policy.on_routed(on("b", 0), first.ranked[0], first)
    for start in range(1000, 4000, 1000):
        assert policy.rank(on("b", start), reps, {}).ranked[0] == first.ranked[0]


def test_load_reports_carry_the_adapters_a_replica_holds():
    report = LoadReport(index_id="r0", loras=["a", "b"], lora_slots=4, lora_load_s=0.02)
    again = LoadReport.from_dict(report.as_dict())
    assert again.loras == ["a", "b"] and again.lora_slots == 4 and again.lora_load_s == 0.02
    assert ReplicaLoad.from_report(again).loras == ["a", "b"]
    assert LoadReport.from_dict({**report.as_dict(), "loras": "a"}) is None  # malformed: refused


def test_a_read_this_router_caused_evicts_before_the_report_says_so():
    """r0 holds x and y in its two slots; sending it a request on a (a read) evicts x, the least recently used.
    Before r0 reports again, a request on x goes to r1, which holds it, instead of reading x back on r0."""
    policy, reps = KVAwarePolicy(), fleet(["x", "y"], ["x"], slots=2)
    reps[1].pending_prefill_tokens = 60  # 30 ms queued on r1: without the eviction r0 would look cheaper
    assert policy.rank(on("x", 0), reps, {}).ranked[0] == "r0"
    first = policy.rank(on("a", 1000), reps, {})
    policy.on_routed(on("a", 1000), "r0", first)
    assert policy.rank(on("x", 2000), reps, {}).ranked[0] == "r1"
