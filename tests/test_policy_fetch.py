"""Pricing a prefix fetched from a peer (issue 58), on fake replicas: pure logic, no Ray, no Redis."""

from __future__ import annotations

from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.messages import KVFetch
from kvmesh.router.policy import KVAwarePolicy, ReplicaLoad, RouteRequest

SEED = model_seed("t")
REQ = RouteRequest(hash_blocks(list(range(1024)), 16, SEED), 1024, 16)  # 64 blocks
HELD = {"r0": 0, "r1": 60, "r2": 0}


def fleet(fetch_tok_s: float | None = 100_000, address: str | None = "tcp://r1:1") -> list[ReplicaLoad]:
    """Three replicas prefilling 2,000 tokens/s; r1 holds 60 of the request's 64 blocks behind a 1 s queue
    (too short to move a 1,024-token recompute off it, whose churn is priced too), r2 has 1 s queued."""
    reps = [
        ReplicaLoad(index_id=f"r{i}", prefill_tok_s=2000, fetch_tok_s=fetch_tok_s, kv_address=f"tcp://r{i}:1")
        for i in range(3)
    ]
    reps[1].kv_address = address
    reps[1].pending_prefill_tokens = reps[2].pending_prefill_tokens = 2000
    return reps


def test_an_idle_replica_that_fetches_fast_takes_the_request_from_a_busy_holder():
    d = KVAwarePolicy(seed=0).rank(REQ, fleet(), HELD)
    assert d.ranked[0] == "r0" and d.reason == "fetch"
    assert d.fetches["r0"] == KVFetch(holder="r1", address="tcp://r1:1", num_blocks=60)
    assert "r1" not in d.fetches  # the holder computes only what it lacks
    # 960 tokens at 100k tokens/s plus one of the holder's steps (no churn: no compute), 64 recomputed with
    # their churn: about 0.54 s, against 8.2 s to recompute all 1,024 and the holder's 1 s queue.
    recompute = KVAwarePolicy(seed=0, peer_fetch=False).rank(REQ, fleet(), HELD)
    assert d.costs["r0"] < 0.6 < 1.0 < d.costs["r1"] == recompute.costs["r1"] < recompute.costs["r0"]


def test_the_deepest_holder_is_named_the_least_queued_among_equals():
    reps = fleet()
    reps[2].pending_prefill_tokens = 4000
    d = KVAwarePolicy(seed=0).rank(REQ, reps, {"r0": 0, "r1": 40, "r2": 60})
    assert d.fetches["r0"].holder == "r2" and d.fetches["r1"] == KVFetch(
        holder="r2", address="tcp://r2:1", num_blocks=60
    )
    d = KVAwarePolicy(seed=0).rank(REQ, reps, {"r0": 0, "r1": 60, "r2": 60})
    assert d.fetches["r0"].holder == "r1" and "r1" not in d.fetches and "r2" not in d.fetches


def decision_fields(d) -> tuple:
    return d.ranked, d.reason, d.matched_blocks, d.costs, d.tied, d.tie_order, d.fetches


def test_no_fetch_is_priced_where_it_is_slower_than_prefill_unreported_unserved_or_off():
    before = decision_fields(KVAwarePolicy(seed=0, peer_fetch=False).rank(REQ, fleet(None), HELD))
    assert before[0][0] == "r1" and before[1] == "hit" and before[-1] == {}
    for reps, kwargs in (
        (fleet(None), {}),  # no replica reports a fetch rate: the decision is the one without the option
        (fleet(1500), {}),  # fetching slower than prefilling
        # the holder serves no blocks (and no prefill split: r2 could be prefilled on r0 while its queue drains)
        (fleet(address=None), {"disaggregate_tokens": 0}),
        (fleet(), {"peer_fetch": False}),
    ):
        assert decision_fields(KVAwarePolicy(seed=0, **kwargs).rank(REQ, reps, HELD)) == before


LONG = RouteRequest(hash_blocks(list(range(5000, 9096)), 16, SEED), 4096, 16)  # 256 blocks, held nowhere


def decoding_fleet(prefill_role: str = "prefill") -> list[ReplicaLoad]:
    """Two replicas decoding 20 streams each, and a third that is idle (a dedicated prefill replica, or a
    mixed one), all fetching at 100k tokens/s."""
    reps = [
        ReplicaLoad(
            index_id=f"r{i}", prefill_tok_s=4000, fetch_tok_s=100_000, kv_address=f"tcp://r{i}:1", num_running=20
        )
        for i in range(3)
    ]
    reps[2].num_running, reps[2].role = 0, prefill_role
    return reps


def test_a_long_prompt_is_prefilled_on_the_prefill_replica_and_decoded_elsewhere():
    d = KVAwarePolicy(seed=0).rank(LONG, decoding_fleet(), {})
    assert d.reason == "disaggregated" and "r2" not in d.ranked  # the prefill replica takes no request
    plan = d.fetches[d.ranked[0]]
    assert (plan.holder, plan.prefill, plan.num_blocks) == ("r2", True, 255) and plan.expected_s > 1.0
    # Colocated, its 1 s prefill would stall 20 streams: the split costs the prefill plus a 0.04 s fetch.
    off = KVAwarePolicy(seed=0, disaggregate_tokens=0).rank(LONG, decoding_fleet(), {})
    assert off.reason == "miss" and not off.fetches and "r2" not in off.ranked


def test_no_split_for_a_short_prompt_or_onto_a_replica_as_busy_decoding():
    short = RouteRequest(LONG.block_hashes[:32], 512, 16)
    assert not KVAwarePolicy(seed=0).rank(short, decoding_fleet(), {}).fetches
    busy = decoding_fleet("mixed")
    busy[2].num_running = 20  # every replica decodes as many streams: a split only moves the stall
    d = KVAwarePolicy(seed=0).rank(LONG, busy, {})
    assert d.reason == "miss" and not d.fetches
