"""Routing policies on fake replicas: pure logic, no Ray, no Redis."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.router.baselines import ApproxTreePolicy, PowerOfTwoPolicy, RoundRobinPolicy, SessionHashPolicy, make_policy
from kvmesh.router.policy import KVAwarePolicy, ReplicaLoad, RouteRequest
from kvmesh.router.sessions import MIN_LIVE_S, SESSION_DECAY_S, DecayingCounts, LiveConversations

SEED = model_seed("t")


def request(tokens, session=None):
    return RouteRequest(hash_blocks(tokens, 16, SEED), len(tokens), 16, session)


def replicas(n, **kw):
    return [ReplicaLoad(index_id=f"r{i}", prefill_tok_s=2000, **kw) for i in range(n)]


def test_kv_aware_prefers_the_replica_holding_the_prefix():
    req = request(list(range(1024)))
    d = KVAwarePolicy().rank(req, replicas(3), {"r0": 0, "r1": 60, "r2": 10})
    assert d.ranked[0] == "r1" and d.reason == "hit" and d.matched_blocks == 60


def test_kv_aware_overrides_a_hit_when_its_queue_costs_more_than_a_miss():
    req = request(list(range(1024)))
    reps = replicas(3)
    reps[1].pending_prefill_tokens = 100_000  # 50 s of queued prefill on the holder
    d = KVAwarePolicy().rank(req, reps, {"r0": 0, "r1": 64, "r2": 0})
    assert d.ranked[0] != "r1" and d.reason == "load_override"
    reps[1].pending_prefill_tokens = 500  # a short queue: the hit still wins
    assert KVAwarePolicy().rank(req, reps, {"r0": 0, "r1": 64, "r2": 0}).ranked[0] == "r1"


def test_on_a_busy_fleet_a_miss_is_charged_the_delay_it_adds_for_others():
    """Empty caches (no eviction to charge). The holder's queue is 1 s longer than a peer's: with idle peers
    (median queue 0) moving the 0.5 s prefill pays; when every replica is busy, the miss's extra work would
    delay the requests queued behind it, so the request stays on the holder (the busy term; 0: off)."""
    req = request(list(range(1024)))
    device_hits = {"r0": 0, "r1": 64, "r2": 0, "r3": 0}
    reps = replicas(4, cache_fill=0.0)
    reps[1].pending_prefill_tokens = 3000  # 1.5 s on the holder, the rest idle
    assert KVAwarePolicy().rank(req, reps, device_hits).ranked[0] != "r1"
    for r, queued in zip(reps, (1000, 3000, 4000, 4000), strict=True):  # everyone busy; r0 1 s shorter
        r.pending_prefill_tokens = queued
    assert KVAwarePolicy().rank(req, reps, device_hits).ranked[0] == "r1"
    assert KVAwarePolicy(busy_weight=0).rank(req, reps, device_hits).ranked[0] == "r0"
    with pytest.raises(ValueError, match="busy_weight"):
        KVAwarePolicy(busy_weight=-1)


def test_kv_aware_miss_goes_to_least_loaded_and_ranks_everyone():
    reps = replicas(3)
    reps[0].num_running = 20
    reps[2].routed_prefill_tokens = 3000
    d = KVAwarePolicy().rank(request(list(range(100))), reps, {"r0": 0, "r1": 0, "r2": 0})
    assert (d.reason == "miss" and d.ranked == ["r1", "r0", "r2"]) or d.ranked[0] == "r1"
    assert sorted(d.ranked) == ["r0", "r1", "r2"]


def route_hot_prefix(rounds_busy: int, n: int = 300) -> Counter:
    """Requests on one 512-token system prompt, one per round, each busy for ``rounds_busy`` rounds.

    The index reports a hit on every replica that served the prefix before; a replica's load is its
    concurrent requests, each adding 20 ms to a newcomer's TTFT (a CPU-class decode step share).
    """
    policy = KVAwarePolicy()
    reps = {r.index_id: r for r in replicas(4, decode_s_per_seq=0.02)}
    holders: set[str] = set()
    busy: list[tuple[int, str]] = []
    chosen = Counter()
    for i in range(n):
        for done in [b for b in busy if b[0] <= i]:
            busy.remove(done)
            reps[done[1]].routed_requests -= 1
        req = request(list(range(512)) + [100_000 + i] * 32)
        device_hits = {rid: (32 if rid in holders else 0) for rid in reps}
        rid = policy.rank(req, list(reps.values()), device_hits).ranked[0]
        chosen[rid] += 1
        holders.add(rid)
        reps[rid].routed_requests += 1
        busy.append((i + rounds_busy, rid))
    return chosen


def test_hot_shared_prefix_stays_home_under_light_load_and_spreads_under_heavy_load():
    light = route_hot_prefix(rounds_busy=10)
    assert len(light) == 1, "light load should keep the prefix on one replica"
    heavy = route_hot_prefix(rounds_busy=300)
    assert len(heavy) >= 2, "a hot prefix pinned all traffic on one replica"
    assert max(heavy.values()) <= 0.75 * sum(heavy.values())


def test_kv_aware_falls_back_to_its_own_recent_decisions_when_the_index_is_down():
    policy = KVAwarePolicy()
    reps = replicas(3)
    first = request(list(range(640)))
    d = policy.rank(first, reps, {"r0": 0, "r1": 0, "r2": 0})
    policy.on_routed(first, "r2", d)
    sibling = request(list(range(640)) + [7] * 40)
    d = policy.rank(sibling, reps, None)
    assert d.ranked[0] == "r2" and d.reason == "index_unavailable_hit"
    d = policy.rank(request([9] * 300), reps, None)
    assert d.reason == "index_unavailable_miss"


def test_dead_replicas_are_simply_not_candidates():
    d = KVAwarePolicy().rank(request(list(range(320))), replicas(2), {"r1": 5})  # r0 not live in the index
    assert d.ranked[0] == "r1" and set(d.ranked) == {"r0", "r1"}
    with pytest.raises(ValueError):
        KVAwarePolicy().rank(request([1] * 20), [], {})


def test_round_robin_cycles():
    p = RoundRobinPolicy()
    firsts = [p.rank(request([1] * 20), replicas(3)).ranked[0] for _ in range(6)]
    assert firsts == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_pow2_picks_the_less_loaded_of_two():
    reps = replicas(2)
    reps[0].num_running = 10
    assert all(PowerOfTwoPolicy(seed=s).rank(request([1] * 20), reps).ranked[0] == "r1" for s in range(10))


def test_session_hash_is_sticky_and_bounded():
    p = SessionHashPolicy(epsilon=0.25)
    reps = replicas(4)
    home = p.rank(request([1] * 40, "alice"), reps).ranked[0]
    assert all(p.rank(request([i] * 40, "alice"), reps).ranked[0] == home for i in range(5))
    spread = Counter(p.rank(request([1] * 40, f"user{i}"), reps).ranked[0] for i in range(200))
    assert len(spread) == 4
    next(r for r in reps if r.index_id == home).num_running = 50  # overloaded: bounded load moves alice
    d = p.rank(request([1] * 40, "alice"), reps)
    assert d.ranked[0] != home and d.reason == "bounded_load"
    # Its shortlist for a large fleet is the head of the order it would rank every replica in.
    many = replicas(64)
    for user in ("alice", "bob", None):
        req = request([7] * 40, user)
        assert p.preferred(req, [r.index_id for r in many], 5) == p.rank(req, many).ranked[:5]


def test_approx_tree_follows_its_own_history_until_imbalanced():
    p = ApproxTreePolicy()
    reps = replicas(3)
    req = request(list(range(800)))
    d = p.rank(req, reps)
    first = d.ranked[0]
    p.on_routed(req, first, d)
    again = p.rank(request(list(range(800)) + [5] * 16), reps)
    assert again.ranked[0] == first and again.reason == "tree_match"
    next(r for r in reps if r.index_id == first).num_waiting = 100  # 100 vs 0: imbalanced
    d = p.rank(req, reps)
    assert d.reason == "imbalanced" and d.ranked[0] != first


def test_make_policy_by_name():
    assert make_policy("kv_aware", miss_weight=2.0).miss_weight == 2.0
    assert make_policy("pow2").name == "pow2"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_kv_aware_spreads_new_conversations_while_caches_have_room():
    """With decode_weight on, a short shared system prompt is not worth herding onto its holder while
    blocks are empty (a miss costs only its own prefill) and the holder's decode batch would slow the
    newcomer down; once caches are full, copying the prefix evicts others and the holder keeps it."""
    policy = KVAwarePolicy(decode_weight=1.0)
    req = request(list(range(480)))  # 30 blocks; the first 8 are the shared system prompt
    reps = replicas(4, decode_s_per_seq=0.01, mean_output_tokens=32)
    reps[0].num_running = 4  # the holder already runs four conversations
    device_hits = {"r0": 8, "r1": 0, "r2": 0, "r3": 0}
    for r in reps:
        r.cache_fill = 0.1
    assert policy.rank(req, reps, device_hits).ranked[0] != "r0"
    assert KVAwarePolicy().rank(req, reps, device_hits).ranked[0] == "r0"  # the default optimises TTFT alone
    for r in reps:
        r.cache_fill = 1.0
        r.decode_s_per_seq = 0.0  # decode steps that do not grow with the batch (a GPU below saturation)
    assert policy.rank(req, reps, device_hits).ranked[0] == "r0"


def test_kv_aware_keeps_a_conversation_with_its_history_despite_a_busier_replica():
    req = request(list(range(960)))  # 60 blocks of history held by r0
    reps = replicas(2, decode_s_per_seq=0.01, mean_output_tokens=32)
    reps[0].num_running, reps[0].cache_fill, reps[1].cache_fill = 1, 0.1, 0.1
    assert KVAwarePolicy(decode_weight=1.0).rank(req, reps, {"r0": 58, "r1": 0}).ranked[0] == "r0"


def test_decode_cost_is_the_fitted_slope_not_the_average():
    from kvmesh.replica.telemetry import StepRates

    rates = StepRates()
    for _ in range(50):
        rates.observe(0, 4, 0.080 + 4 * 0.005)
    assert rates.decode_s_per_seq is None  # one batch size only: base and slope not separable
    for _ in range(200):
        for running in (1, 8, 16):
            rates.observe(0, running, 0.080 + running * 0.005)
    assert rates.decode_s_per_seq == pytest.approx(0.005, rel=0.05)


def test_decode_cost_never_exceeds_a_recent_step():
    """A warm-up on contended cores (slow steps of varied batch sizes) must not price every running
    sequence at a third of a second once steps take 16 ms: routers would move conversations for it."""
    from kvmesh.replica.telemetry import StepRates

    rates = StepRates()
    for running in (1, 4, 8, 1, 4, 8):
        rates.observe(0, running, 0.1 + running * 0.05)
    assert rates.decode_s_per_seq == pytest.approx(0.05, rel=0.05)
    for _ in range(30):
        rates.observe(0, 3, 0.016)
    assert rates.decode_s_per_seq <= rates.step_s < 0.018


def test_prefill_utilisation_is_the_share_of_recent_time_spent_prefilling():
    from kvmesh.core.messages import BUSY_WINDOW_S
    from kvmesh.replica.telemetry import StepRates

    rates, now = StepRates(), 0.0
    for _ in range(int(3 * BUSY_WINDOW_S / 0.05)):  # prefilling without a pause for three windows
        now += 0.05
        rates.observe(100, 0, 0.05, now)
    assert rates.prefill_busy(now) == pytest.approx(0.95, abs=0.01)
    assert rates.prefill_busy(now + 2 * BUSY_WINDOW_S) == pytest.approx(0.95 * math.exp(-2), abs=0.01)  # idle
    rates, now = StepRates(), 0.0
    for _ in range(int(3 * BUSY_WINDOW_S / 0.1)):
        now += 0.05
        rates.observe(0, 16, 0.025, now)  # decode steps only
        now += 0.05
        rates.observe(50, 8, 0.05, now)  # mixed steps: half the step is the chunk, at the measured rate
    assert rates.prefill_tok_s == 2000.0  # mixed steps do not move the measured rate
    assert rates.prefill_busy(now) == pytest.approx(0.95 * 0.25, abs=0.01)
    rates, now = StepRates(), 0.0
    for i in range(int(3 * BUSY_WINDOW_S / 0.125)):  # prefilling all the time, every other step slowed 4x
        step = 0.2 if i % 2 else 0.05  # (another process took the core): the rate's average lags them
        now += step
        rates.observe(100, 0, step, now)
    assert rates.prefill_busy(now) == pytest.approx(0.95, abs=0.01)


def test_churn_is_cheap_on_an_idle_fleet_and_dear_on_a_busy_one():
    """Moving a request off the replica holding most of its prompt evicts what the other replica cached.
    On a busy fleet that recompute later delays everyone (stay, behind a queue); on an idle one it costs
    only its own prefill (do not wait 0.5 s behind the holder's queue for a 0.16 s recompute)."""
    req = request(list(range(320)))  # 20 blocks, 16 held by r0, which has 0.5 s of prefill queued
    device_hits = {"r0": 16, "r1": 0, "r2": 0, "r3": 0}

    def chosen(busy):
        reps = replicas(4, prefill_busy=busy)
        reps[0].pending_prefill_tokens = 1000
        return KVAwarePolicy().rank(req, reps, device_hits).ranked[0]

    assert chosen(None) == "r0"  # unreported: priced as on a busy fleet
    assert chosen(0.9) == "r0"
    assert chosen(0.3) != "r0"


def test_new_conversations_are_placed_with_bounded_loads():
    """Every new conversation shares a system prompt the first replica holds: by cost alone they would all
    start there. With the bound (1.25 x fair share) starts spread evenly, while a continuing conversation
    still goes back to its own history whatever the counts."""
    system = list(range(160))  # 10 shared blocks
    reps = replicas(4)
    for balance, expect_spread in ((1.25, True), (0, False)):
        policy = KVAwarePolicy(session_balance=balance)
        starts = Counter()
        for i in range(40):
            req = request(system + list(range(10_000 + 400 * i, 10_400 + 400 * i)))  # 35 blocks: system + own
            d = policy.rank(req, reps, {"r0": 10, "r1": 0, "r2": 0, "r3": 0})
            assert d.opens_session
            policy.on_routed(req, d.ranked[0], d)
            starts[d.ranked[0]] += 1
        if expect_spread:
            assert max(starts.values()) <= 1.25 * 40 / 4 + 1 and len(starts) == 4
        else:
            assert starts == {"r0": 40}
    policy = KVAwarePolicy()  # a few conversations per router: the slack never leaves a replica without any
    for i in range(8):
        req = request(system + list(range(10_000 + 400 * i, 10_400 + 400 * i)))
        d = policy.rank(req, reps, {"r0": 10, "r1": 0, "r2": 0, "r3": 0})
        policy.on_routed(req, d.ranked[0], d)
    assert [round(policy.sessions.local.get(f"r{i}")) for i in range(4)] == [2, 2, 2, 2]
    history = request(system + list(range(500, 900)))
    d = KVAwarePolicy().rank(history, reps, {"r0": 0, "r1": 0, "r2": 0, "r3": 30})  # r3 holds 30 of 35 blocks
    assert not d.opens_session and d.ranked[0] == "r3"
    with pytest.raises(ValueError, match="session_balance"):
        KVAwarePolicy(session_balance=0.5)


def test_replicas_interchangeable_on_what_the_router_knows_are_reported_tied():
    """Tied: as much of the prompt cached as the first choice and a cost within tie_margin x its own prefill
    time of it. A holder is never tied with replicas that would miss, nor a capped replica with an uncapped
    one."""
    req = request(list(range(640)))
    reps = replicas(4)
    reps[3].pending_prefill_tokens = 2000  # 1 s queued: more than this request's own 0.32 s prefill
    d = KVAwarePolicy().rank(req, reps, {})  # on by default, at one prefill
    assert d.tied == 3 and set(d.ranked[:3]) == {"r0", "r1", "r2"} and d.ranked[3] == "r3"
    assert KVAwarePolicy(tie_margin=0).rank(req, reps, {}).tied == 1  # 0: off
    reps[1].prefill_tok_s = 1000  # 0.64 s vs 0.32 s: less than one request another router may have sent
    assert KVAwarePolicy(tie_margin=1.0).rank(req, reps, {}).tied == 3
    reps[1].prefill_tok_s = 600  # 1.07 s: outside
    assert KVAwarePolicy(tie_margin=1.0).rank(req, reps, {}).tied == 2
    hit = KVAwarePolicy(tie_margin=1.0).rank(req, replicas(3), {"r0": 0, "r1": 30, "r2": 30})
    assert hit.tied == 2 and set(hit.ranked[:2]) == {"r1", "r2"}  # equal holders tie; misses stay apart
    system = list(range(160))
    policy = KVAwarePolicy(tie_margin=1.0)
    for i in range(3):  # three conversations start on r1, r2, r3; the cap (ceil(4/4) = 1) then bars them
        new = request(system + list(range(10_000 + 400 * i, 10_400 + 400 * i)))
        d = policy.rank(new, replicas(4), {"r0": 10, "r1": 10, "r2": 10, "r3": 10})  # a conversation start
        policy.on_routed(new, f"r{i + 1}", d)
    new = request(system + list(range(20_000, 20_400)))
    d = policy.rank(new, replicas(4), {"r0": 10, "r1": 10, "r2": 10, "r3": 10})
    assert d.opens_session and d.ranked[0] == "r0" and d.tied == 1
    with pytest.raises(ValueError, match="tie_margin"):
        KVAwarePolicy(tie_margin=-1)


def test_near_ties_are_offered_least_recently_used_first():
    """One of two idle replicas looks a hair busier (a gauge polled while its last request ran): the two are
    tied, and Ray, finding both live queues empty, takes the first offered. Offered cheapest first, that is
    the same replica every time; offered least recently used first, sequential new prompts take turns."""
    policy = KVAwarePolicy()
    reps = replicas(3)
    reps[1].num_running = 1  # r1 stale-busy, within one prefill of the others
    reps[2].pending_prefill_tokens = 4000  # r2 clearly busy: never tied
    chosen = []
    for p in range(6):
        req = request(list(range(1000 * p, 1000 * p + 320)))
        d = policy.rank(req, reps, {})
        assert d.ranked[0] == "r0" and d.tied == 2 and set(d.tied_group) == {"r0", "r1"}
        chosen.append(d.tied_group[0])  # equal live queues: Ray takes the first
        policy.on_routed(req, chosen[-1], d)
    assert chosen[1:] == ["r1", "r0"] * 2 + ["r1"] or chosen[1:] == ["r0", "r1"] * 2 + ["r0"], chosen
    untied = KVAwarePolicy(tie_margin=0).rank(request(list(range(320))), reps, {})
    assert untied.tied == 1 and untied.tied_group == ["r0"]


def test_a_burst_of_new_prompts_spreads_over_identical_replicas_measured_at_different_rates():
    """Six new conversations sent at once to three idle replicas of one deployment, one measured 5x faster than
    its identical peers (a warm-up step on shared cores). The serve router counts each decision against its first
    choice before Ray sends any: that work priced at each replica's own rate, the fast-measured replica took 4 of
    the 6; priced at the fleet's median rate, the burst spreads. A lone prompt still goes to the fastest."""
    reps = [ReplicaLoad(index_id=f"r{i}", prefill_tok_s=rate, cache_fill=0.0) for i, rate in enumerate((1e5, 2e4, 2e4))]
    policy, nowhere = KVAwarePolicy(), {r.index_id: 0 for r in reps}
    prompts = [request([1000 + c] * 5 + list(range(10_000 * (c + 1), 10_000 * (c + 1) + 3600))) for c in range(6)]
    assert policy.rank(prompts[0], reps, nowhere).ranked[0] == "r0"
    starts = Counter()
    for req in prompts:
        d = policy.rank(req, reps, nowhere)
        first = next(r for r in reps if r.index_id == d.tied_group[0])
        first.routed_requests += 1  # as the serve router tracks it, before any report or probe can see it
        first.routed_prefill_tokens += req.num_tokens
        starts[first.index_id] += 1
    assert starts == {"r0": 2, "r1": 2, "r2": 2}, starts


def test_routers_sharing_counts_of_conversation_starts_balance_together():
    """Eight router processes (Ray Serve runs one per handle-holding process) each placing two new
    conversations, all preferring the replica holding the system prompt: counted per router, every router
    starts its two on the same two cheapest replicas; with the counts the index shares
    (``shared_starts``) the fleet ends within the bound."""
    system = list(range(160))

    def place(shared: bool) -> list[int]:
        starts = Counter()
        routers = [KVAwarePolicy() for _ in range(8)]
        for i in range(16):
            policy = routers[i % 8]
            req = request(system + list(range(10_000 + 400 * i, 10_400 + 400 * i)))
            reps = replicas(4)
            counts = {r.index_id: float(starts[r.index_id]) for r in reps} if shared else None
            d = policy.rank(req, reps, {"r0": 10, "r1": 1, "r2": 0, "r3": 0}, counts)
            rid = d.ranked[0]
            policy.on_routed(req, rid, d)
            starts[rid] += 1
        return [starts[f"r{i}"] for i in range(4)]

    assert place(shared=False) == [8, 8, 0, 0]
    shared = place(shared=True)
    assert max(shared) <= 1.25 * 4 and min(shared) >= 3  # at most the bound's slack of one conversation


def test_counts_of_conversation_starts_decay():
    now = [0.0]
    counts = DecayingCounts(10.0, clock=lambda: now[0])
    counts.add("r0")
    counts.add("r0")
    now[0] = 10.0
    assert counts.get("r0") == pytest.approx(2 * math.exp(-1))
    counts.add("r0")
    assert counts.get("r0") == pytest.approx(2 * math.exp(-1) + 1) and counts.get("r1") == 0.0
    with pytest.raises(ValueError, match="session_decay_s"):
        DecayingCounts(0)


def test_a_conversation_is_live_for_a_few_of_the_gaps_seen_between_turns():
    """Until a gap between turns is seen a conversation counts for ``SESSION_DECAY_S``; then for 3 mean gaps
    (at least ``MIN_LIVE_S``); a conversation that moves counts on its new replica only."""
    now = [0.0]
    live = LiveConversations(clock=lambda: now[0])
    live.touch("a", "r0")
    now[0] = 300.0
    assert live.counts(["r0", "r1"]) == {"r0": 1.0, "r1": 0.0} and live.live_s == SESSION_DECAY_S
    for t in (305.0, 310.0, 315.0):  # turns 5 s apart
        now[0] = t
        live.touch("a", "r0")
    assert live.mean_gap_s == pytest.approx(305 + 0.05 * (5 - 305) + 0.05 * (5 - 290))  # a running mean
    for _ in range(200):  # many more gaps of 5 s: the mean settles on them
        now[0] += 5.0
        live.touch("a", "r0")
    assert live.live_s == pytest.approx(15.0, rel=0.01)
    live.touch("b", "r1")
    now[0] += 14.0
    assert live.counts(["r0", "r1"]) == {"r0": 1.0, "r1": 1.0}
    live.touch("b", "r0")  # moved, after a gap of 14 s: the mean rises to 5.5 s, live_s to 16.4 s
    now[0] += 4.0  # "a" is 18 s old: over
    assert live.counts(["r0", "r1"]) == {"r0": 1.0, "r1": 0.0}
    for _ in range(100):  # back-to-back turns (an agent's tool calls) still count for MIN_LIVE_S
        now[0] += 0.1
        live.touch("b", "r0")
    assert live.live_s == MIN_LIVE_S


def test_new_conversations_avoid_the_replicas_holding_live_ones_not_those_that_started_many_long_ago():
    """Under cache pressure a replica holds few conversations' histories at once: a new conversation must go
    where the fewest are live. r0 started three conversations a minute ago that have ended; r1 holds one
    whose turns still come every 4 s, started first on a prompt no replica held (so only its second turn
    shows it is a conversation). Both hold the system prompt, r2 nothing: the new one goes to r0."""
    now = [0.0]
    policy = KVAwarePolicy(clock=lambda: now[0])
    system = list(range(160))
    reps = replicas(3)

    def route(tokens, held, to=None):
        req = request(tokens)
        d = policy.rank(req, reps, held)
        policy.on_routed(req, to or d.ranked[0], d)
        return d

    live_one = system + list(range(1_000, 1_320))
    assert not route(live_one, {"r0": 0, "r1": 0, "r2": 0}, "r1").opens_session
    for i in range(3):
        now[0] += 1.0
        assert route(
            system + list(range(10_000 * (i + 2), 10_000 * (i + 2) + 320)), {"r0": 10, "r1": 10, "r2": 0}, "r0"
        ).opens_session
    for turn in range(1, 16):  # a minute of turns on r1; r0's conversations see none
        now[0] += 4.0
        live_one = live_one + list(range(100_000 + 64 * turn, 100_064 + 64 * turn))
        assert not route(live_one, {"r0": 10, "r1": len(live_one) // 16 - 4, "r2": 0}).opens_session
    assert policy.sessions.live.counts(["r0", "r1", "r2"]) == {"r0": 0.0, "r1": 1.0, "r2": 0.0}
    new = route(system + list(range(90_000, 90_320)), {"r0": 10, "r1": 10, "r2": 0})
    assert new.opens_session and new.ranked[0] == "r0"  # counted by starts over 10 minutes, r0 was capped


def test_a_new_conversation_goes_where_its_history_fits_beside_the_live_ones():
    """48-block pools; a conversation's prompt is 30 blocks. r0 holds two live conversations and r1 one (the
    bound's cap of 2 bars only r0), r2 none. r1 holds the system prompt and is cheapest by cost, but a second
    history there evicts the live one's: the new conversation goes to r2. With pools that hold several, r1."""
    system = list(range(160))

    def place(pool_blocks: int) -> str:
        now = [0.0]
        policy = KVAwarePolicy(clock=lambda: now[0])
        reps = replicas(3, kv_total_blocks=pool_blocks, kv_free_blocks=pool_blocks)
        for i, home in enumerate(("r0", "r0", "r1")):  # three conversations on the system prompt, each continued
            first = system + list(range(10_000 * (i + 1), 10_000 * (i + 1) + 320))
            for tokens in (first, first + list(range(500_000 + 64 * i, 500_064 + 64 * i))):
                now[0] += 1.0
                req = request(tokens)
                d = policy.rank(req, reps, {"r0": 10, "r1": 10, "r2": 0})
                policy.on_routed(req, home, d)
        assert policy.sessions.live.counts(["r0", "r1", "r2"]) == {"r0": 2.0, "r1": 1.0, "r2": 0.0}
        new = request(system + list(range(90_000, 90_320)))
        d = policy.rank(new, reps, {"r0": 10, "r1": 10, "r2": 0})
        assert d.opens_session
        return d.ranked[0]

    assert place(48) == "r2"
    assert place(10_000) == "r1"


def test_a_long_prompt_goes_where_the_kv_pool_has_room():
    """r0 runs one request that is decoding (empty prefill queue) but pins 42 of its 48 blocks; r1 is idle
    and measured a little slower. A 640-token prompt placed on r0 would wait for that request to finish."""
    full = ReplicaLoad(
        index_id="r0",
        prefill_tok_s=500,
        num_running=1,
        kv_free_blocks=6,
        kv_total_blocks=48,
        mean_output_tokens=16,
        step_s=0.07,
    )
    empty = ReplicaLoad(
        index_id="r1", prefill_tok_s=450, kv_free_blocks=48, kv_total_blocks=48, mean_output_tokens=16, step_s=0.07
    )
    req = request(list(range(640)))
    assert full.kv_wait_s(640, 16) == pytest.approx(34 / 42 * 16 * 0.07)
    assert empty.kv_wait_s(640, 16) == 0.0 and full.kv_wait_s(64, 16) == 0.0  # a short prompt fits
    assert KVAwarePolicy().rank(req, [full, empty], {"r0": 0, "r1": 0}).ranked[0] == "r1"
    unreported = ReplicaLoad(index_id="r0", prefill_tok_s=500, num_running=1)  # an old replica: room assumed
    assert unreported.kv_wait_s(640, 16) == 0.0


def test_a_full_batch_of_long_generations_is_priced_by_its_soonest_end():
    """r0 holds the conversation's history but its 4 batch slots run generations with 3,800 tokens left
    (``slot_free_steps``): the next turn would wait for one to end, so it goes to r1 and recomputes there.
    Known to end within 2 steps, r0 keeps the turn; unreported, the mean output length stands in."""
    history = request(list(range(1600)))
    stats = dict(prefill_tok_s=4000, num_running=4, max_num_seqs=4, step_s=0.05, mean_output_tokens=16)
    idle = ReplicaLoad(index_id="r1", prefill_tok_s=4000, step_s=0.05, mean_output_tokens=16)
    hits = {"r0": 100, "r1": 0}
    policy = KVAwarePolicy(peer_fetch=False)
    busy = ReplicaLoad(index_id="r0", slot_free_steps=3800, **stats)
    assert busy.queue_s >= 3800 * 0.05
    assert policy.rank(history, [busy, idle], hits).ranked[0] == "r1"
    ending = ReplicaLoad(index_id="r0", slot_free_steps=2, **stats)
    assert policy.rank(history, [ending, idle], hits).ranked[0] == "r0"
    unknown = ReplicaLoad(index_id="r0", **stats)
    assert unknown.queue_s == pytest.approx(ReplicaLoad(index_id="r0", slot_free_steps=None, **stats).queue_s)
    assert unknown.queue_s < busy.queue_s


def test_a_full_pool_in_an_old_report_has_been_freeing_since():
    """The report was taken while a request pinned 42 of 48 blocks. Its running sequences have decoded since:
    the wait counts from the report, and a report older than that wait shows no wait at all."""
    wait = 34 / 42 * 16 * 0.07
    stats = dict(prefill_tok_s=500, num_running=1, kv_free_blocks=6, kv_total_blocks=48, mean_output_tokens=16)
    aged = ReplicaLoad(index_id="r0", step_s=0.07, report_age_s=0.2, **stats)
    assert aged.kv_wait_s(640, 16) == pytest.approx(wait - 0.2)
    stale = ReplicaLoad(index_id="r0", step_s=0.07, report_age_s=wait + 0.01, **stats)
    assert stale.kv_wait_s(640, 16) == 0.0
    twin = ReplicaLoad(index_id="r1", prefill_tok_s=450, kv_free_blocks=48, kv_total_blocks=48, mean_output_tokens=16)
    req = request(list(range(640)))
    assert KVAwarePolicy().rank(req, [stale, twin], {"r0": 0, "r1": 0}).ranked[0] == "r0"  # faster, room now


def test_prompts_sharing_nothing_go_by_cost_not_by_the_conversation_bound():
    """A replica just added has started no conversations. A prompt nobody holds any of must still go where
    it waits least, not to the newcomer because of its count; one on a shared system prompt is bounded."""
    old = ReplicaLoad(index_id="r0", prefill_tok_s=2000)  # idle, many conversations started
    new = ReplicaLoad(index_id="r1", prefill_tok_s=2000, pending_prefill_tokens=4000)  # busy prefilling, none started
    starts = {"r0": 12.0, "r1": 0.0}
    fresh = request(list(range(50_000, 50_400)))
    d = KVAwarePolicy().rank(fresh, [old, new], {"r0": 0, "r1": 0}, starts)
    assert d.ranked[0] == "r0"
    assert not d.opens_session
    on_system_prompt = request(list(range(160)) + list(range(60_000, 60_400)))
    d = KVAwarePolicy().rank(on_system_prompt, [old, new], {"r0": 10, "r1": 0}, starts)
    assert d.ranked[0] == "r1"
    assert d.opens_session


def test_kv_aware_answers_a_replica_missing_from_the_index_from_its_own_decisions():
    """A replica whose heartbeat lapsed (publisher stalled) is absent from the index's answer: that is no
    evidence it lost its cache, so its conversation is not moved on it, however old the decision."""
    policy = KVAwarePolicy(predict_ttl_s=0)  # no prediction window: only the fallback can know
    reps = replicas(3)
    first = request(list(range(640)))
    policy.on_routed(first, "r2", policy.rank(first, reps, {"r0": 0, "r1": 0, "r2": 0}))
    follow_up = request(list(range(640)) + [7] * 40)
    d = policy.rank(follow_up, reps, {"r0": 0, "r1": 0})  # r2 missing from the answer
    assert d.ranked[0] == "r2" and d.reason == "hit" and d.matched_blocks == 40
    d = policy.rank(follow_up, reps, {"r0": 0, "r1": 0, "r2": 0})  # the index says r2 evicted it: believed
    assert d.reason == "miss"


def test_host_tier_hits_are_priced_by_the_load_rate_each_replica_reports():
    """1,024 tokens: r0 holds 60 blocks on its device, r1 the same 60 in its host tier (loading at 20k tok/s,
    10x its prefill), r2 nothing. Equal load: device hit > host hit > miss. With 2 s of queue on the device
    holder, the idle host holder wins. Tier-blind routing prices the host copy as a miss, and a miss's
    evictions at full price (with a host tier they are reloaded, not recomputed)."""
    req = request(list(range(1024)))
    reps = replicas(3, cache_fill=0.5, host_load_tok_s=20_000)
    device_hits, host = {"r0": 60, "r1": 0, "r2": 0}, {"r1": 60}
    d = KVAwarePolicy().rank(req, reps, device_hits, None, host)
    assert d.ranked == ["r0", "r1", "r2"] and d.reason == "hit"
    assert d.costs["r0"] < d.costs["r1"] < d.costs["r2"]
    reps[0].pending_prefill_tokens = 4000
    d = KVAwarePolicy().rank(req, reps, device_hits, None, host)
    assert d.ranked[0] == "r1" and d.reason == "host_hit" and d.matched_blocks == 60
    blind = KVAwarePolicy(host_tier=False).rank(req, reps, device_hits, None, host)
    assert blind.costs["r1"] == pytest.approx(blind.costs["r2"]) and blind.costs["r2"] > d.costs["r2"]
    # A tier slower to load than to recompute (as the engine would decide) is not counted either.
    reps[1].host_load_tok_s = 1000
    assert KVAwarePolicy().rank(req, reps, device_hits, None, host).costs["r1"] == pytest.approx(blind.costs["r1"])


def test_a_host_tier_continuing_a_device_hit_adds_to_it():
    """r0: 30 blocks on device + 30 in its host tier; r1: 40 on device. r0's 60 loadable blocks win."""
    req = request(list(range(1024)))
    reps = replicas(2, cache_fill=0.5, host_load_tok_s=50_000)
    d = KVAwarePolicy().rank(req, reps, {"r0": 30, "r1": 40}, None, {"r0": 30})
    assert d.ranked[0] == "r0" and d.matched_blocks == 60 and d.reason == "host_hit"


def test_a_disk_tier_continuing_the_chain_is_priced_by_its_own_load_rate():
    """r0: 10 blocks on device, 50 more on disk (read at 8k tok/s, 4x its prefill); r1 nothing. r0 wins and
    costs more than if the 50 were in its host tier; a disk slower than recomputing is not counted."""
    req = request(list(range(1024)))
    reps = replicas(2, cache_fill=0.5, host_load_tok_s=50_000, disk_load_tok_s=8_000)
    device, host, disk = {"r0": 10, "r1": 0}, {}, {"r0": 50}
    d = KVAwarePolicy().rank(req, reps, device, None, host, disk)
    assert d.ranked[0] == "r0" and d.matched_blocks == 60 and d.costs["r0"] < d.costs["r1"]
    as_host = KVAwarePolicy().rank(req, reps, device, None, {"r0": 50})
    assert as_host.costs["r0"] < d.costs["r0"]
    reps[0].disk_load_tok_s = 1000  # below its 2,000 tok/s prefill: the replica would recompute them
    slow = KVAwarePolicy().rank(req, reps, device, None, host, disk)
    assert slow.matched_blocks == 10 and slow.costs["r0"] > d.costs["r0"]


def _route_with_index(policy, held, tokens):
    """Route one prompt with an index that answers each replica's leading blocks from ``held`` (the blocks
    it caches), then cache the prompt where it went, as its replica would."""
    req = request(tokens)
    device_hits = {}
    for rid, blocks in held.items():
        device_hits[rid] = next((i for i, h in enumerate(req.block_hashes) if h not in blocks), len(req.block_hashes))
    d = policy.rank(req, replicas(len(held)), device_hits)
    policy.on_routed(req, d.ranked[0], d)
    held[d.ranked[0]].update(req.block_hashes)
    return d


def test_agent_sessions_on_a_long_shared_tool_prompt_are_spread_while_one_off_questions_stay_with_it():
    """A tool prompt of 12 blocks is most of each agent session's first request, so no replica holds
    "part, but less than half" of it; sessions still open conversations once one that passed through the
    prompt was continued, and are placed with bounded loads instead of all following the prompt's first holder.
    Each session's next step continues its own history (and so does a sub-agent forked from it). Questions
    on one document that nobody continues stay where the document is cached: they create no later load."""
    tools = list(range(192))  # 12 blocks
    held = {f"r{i}": set() for i in range(4)}
    policy = KVAwarePolicy()
    homes = {}
    for s in range(16):
        own = list(range(100_000 * (s + 1), 100_000 * (s + 1) + 16))
        first = _route_with_index(policy, held, tools + own)
        assert first.opens_session == (s > 0)  # the first shows that conversations grow from the prompt
        step = _route_with_index(policy, held, tools + own + list(range(7_000_000 + 32 * s, 7_000_000 + 32 * s + 32)))
        assert not step.opens_session and step.ranked[0] == first.ranked[0]  # its history stays home
        fork = _route_with_index(policy, held, tools + own + [9_000_000 + s] * 16)  # a sub-agent off step one
        assert not fork.opens_session and fork.ranked[0] == first.ranked[0]
        homes[s] = first.ranked[0]
    per_replica = Counter(homes.values())
    assert len(per_replica) == 4 and max(per_replica.values()) <= 1.25 * 16 / 4 + 1

    document = list(range(20_000_000, 20_000_192))
    held = {f"r{i}": set() for i in range(4)}
    policy = KVAwarePolicy()
    questions = [_route_with_index(policy, held, document + [30_000_000 + q] * 16) for q in range(16)]
    assert not any(d.opens_session for d in questions)
    assert {d.ranked[0] for d in questions[1:]} == {questions[0].ranked[0]}


def test_a_router_that_did_not_see_a_conversations_history_does_not_count_its_next_turn_as_a_start():
    """With several router processes one may know only the shared prompt while the index shows a replica
    holding more of the request than that: another router routed its earlier turns. Not a new conversation."""
    tools = list(range(192))
    held = {f"r{i}": set() for i in range(4)}
    policy = KVAwarePolicy()
    for s in range(4):  # this router learns that conversations grow from the tool prompt
        own = list(range(100_000 * (s + 1), 100_000 * (s + 1) + 16))
        _route_with_index(policy, held, tools + own)
        _route_with_index(policy, held, tools + own + list(range(7_000_000 + 32 * s, 7_000_000 + 32 * s + 32)))
    history = tools + list(range(50_000_000, 50_000_064))  # routed by another router: held by r3, unknown here
    held["r3"].update(request(history).block_hashes)
    d = _route_with_index(policy, held, history + list(range(60_000_000, 60_000_016)))
    assert not d.opens_session and d.ranked[0] == "r3"


def test_a_burst_on_a_shared_document_is_copied_to_a_second_replica_but_a_conversation_stays_home():
    """Questions on one document branch off it where no prompt ended. Once its holder's queue makes a new
    question's own wait more than wait_cap x what an idle replica offers (recomputing the document), the
    question goes there; the churn term alone would keep it queued. A conversation's next turn continues
    its history where the last prompt ended and waits for its holder whatever the queue."""

    def route(policy, tokens, held_blocks, holder_queue_tokens=0):
        req = request(tokens)
        reps = replicas(3)
        reps[0].pending_prefill_tokens = holder_queue_tokens  # 1,000 tokens: 0.5 s
        d = policy.rank(req, reps, {"r0": held_blocks, "r1": 0, "r2": 0})
        policy.on_routed(req, d.ranked[0], d)
        return d.ranked[0]

    document = list(range(20_000_000, 20_000_192))  # 12 blocks; a question adds a 13th
    for cap in (2.0, 0.0):
        policy = KVAwarePolicy(wait_cap=cap, seed=0)
        for q in range(3):  # idle: every question goes to the document's holder, which learns it is shared
            assert route(policy, document + [30_000_000 + q] * 16, 12) == "r0"
        busy = route(policy, document + [40_000_000] * 16, 12, holder_queue_tokens=1000)
        assert busy in ({"r1", "r2"} if cap else {"r0"}), (cap, busy)

    policy = KVAwarePolicy(wait_cap=2.0, seed=0)
    turn = list(range(50_000_000, 50_000_192))
    route(policy, turn, 0)
    for t in range(3):
        held = len(turn) // 16  # the previous turn's prompt
        turn = turn + list(range(60_000_000 + 16 * t, 60_000_000 + 16 * t + 16))
        assert route(policy, turn, held, holder_queue_tokens=1000 if t else 0) == "r0", f"turn {t + 2} moved"
    with pytest.raises(ValueError, match="wait_cap"):
        KVAwarePolicy(wait_cap=0.5)


def test_on_a_wide_fleet_a_turn_stays_on_its_history_while_caches_have_room():
    """A busy fleet (utilisation 0.8) with room in every cache: a turn whose 40-block history is on a replica
    with 1.4 s of queue moves to an idle one on a small fleet (its recompute, 0.3 s, is cheap there), and
    stays on a fleet of ``history_min_replicas`` or more, where leaving the history is priced at least
    ``history_weight`` x its recompute: a floor under the churn term, which with full caches already prices
    it at ``miss_weight - 1`` (15 of the 16)."""
    req = request(list(range(1024)))  # 64 blocks, 40 of them its history
    reps = replicas(6, cache_fill=0.05, prefill_busy=0.8)
    reps[1].pending_prefill_tokens = 2800
    hits = {"r0": 1, "r1": 40, "r2": 1, "r3": 1, "r4": 1, "r5": 1}  # the system block everywhere
    assert KVAwarePolicy().rank(req, reps, hits).ranked[0] != "r1"  # 6 replicas: under history_min_replicas
    assert KVAwarePolicy(history_weight=0).rank(req, reps, hits, fleet_size=64).ranked[0] != "r1"
    assert KVAwarePolicy().rank(req, reps, hits, fleet_size=64).ranked[0] == "r1"  # 6 shortlisted of 64
    assert KVAwarePolicy(history_min_replicas=6).rank(req, reps, hits).ranked[0] == "r1"
    full = replicas(6, cache_fill=1.0, prefill_busy=0.8)
    full[1].pending_prefill_tokens = 2800
    priced = KVAwarePolicy().rank(req, full, hits, fleet_size=64).costs
    unpriced = KVAwarePolicy(history_weight=0).rank(req, full, hits, fleet_size=64).costs
    topped_up = (16 - 15) * 16 / 2000  # per lacking block: the floor less the churn already charged, in seconds
    assert {rid: priced[rid] - unpriced[rid] for rid in priced} == pytest.approx(
        {rid: (40 - hits[rid]) * topped_up for rid in priced}
    )
    reps[1].pending_prefill_tokens = 40_000  # 20 s of queue: leaving the history is worth it again
    assert KVAwarePolicy().rank(req, reps, hits, fleet_size=64).ranked[0] != "r1"
    with pytest.raises(ValueError, match="history_weight"):
        KVAwarePolicy(history_weight=-1)
    with pytest.raises(ValueError, match="history_min_replicas"):
        KVAwarePolicy(history_min_replicas=0)


def test_on_a_wide_fleet_the_sole_holder_of_a_short_prefix_takes_one_start_beyond_the_bound():
    """A turn adding more than it resends (20 of 64 blocks held, by r1 alone) counts as a start. On a wide
    fleet whose fair share of starts is under one, the bound would move it off r1, which already started one
    conversation (perhaps this one); there r1 may take one more. A prefix another replica holds as deep is
    shared, and bounded as before."""
    req = request(list(range(1024)))
    reps = replicas(6)
    hits = {"r0": 0, "r1": 20, "r2": 0, "r3": 0, "r4": 0, "r5": 0}
    starts = {"r1": 1.0}
    narrow = KVAwarePolicy().rank(req, reps, hits, starts)
    assert narrow.opens_session and narrow.ranked[0] != "r1"
    wide = KVAwarePolicy().rank(req, reps, hits, starts, fleet_size=64)
    assert wide.opens_session and wide.ranked[0] == "r1"
    hits["r2"] = 20
    assert KVAwarePolicy().rank(req, reps, hits, {"r1": 1.0, "r2": 1.0}, fleet_size=64).ranked[0] not in ("r1", "r2")


def test_a_router_remembers_its_decisions_as_fast_when_its_memory_is_full():
    """Once its bounded memory of recent decisions is full (the default 65,536 blocks), each new block evicts
    the oldest: that must cost about what filling it did (a plain dict's front deletions once made it 20x
    slower and more: 31 us per block, 16 ms per 8k-token request), and the oldest blocks are forgotten."""
    import time

    from kvmesh.router.policy import _RecentOwners

    size = KVAwarePolicy()._recent.size
    memory = _RecentOwners(size, clock=lambda: 0.0)
    blocks = list(range(4 * size))

    def record(start: int, replica: str) -> float:
        t0 = time.perf_counter()
        for k in range(start, start + size, 512):
            memory.record(blocks[k : k + 512], replica)
        return time.perf_counter() - t0

    fill = record(0, "r0")
    assert min(record(size * k, "r1") for k in (1, 2, 3)) < 2.5 * fill  # each a whole memory's evictions
    assert memory.match(blocks[3 * size - 1 : 3 * size + 1], ["r0", "r1"]) == ({"r0": 0, "r1": 0}, 0)  # forgotten
    assert memory.match(blocks[3 * size : 3 * size + 2], ["r0", "r1"]) == ({"r0": 0, "r1": 2}, 2)
