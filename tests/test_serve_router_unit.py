"""KVAwareRequestRouter's own logic, driven directly (no Ray cluster): stand-in replicas carry only what the
router reads (id and load report); the index is a real redis-server, or a dead port."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from kvmesh.cluster.launch.embedded_redis import free_port
from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.messages import GenerateCall, KVFetch
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.serve_router import KVAwareRequestRouter

DEP = DeploymentID(name="engine", app_name="unit")


@dataclass
class Replica:
    replica_id: ReplicaID
    routing_stats: dict


def make_router(url, **kw) -> KVAwareRequestRouter:
    r = KVAwareRequestRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(redis_url=url, deployment="unit", model="m", lookup_timeout_s=0.5, **kw)
    return r


def replicas(n, **stats):
    now = time.time()
    return [Replica(ReplicaID(f"u{i}", DEP), {"index_id": f"u{i}", "reported_at": now, **stats}) for i in range(n)]


def pending(tokens, i, session=None):
    call = GenerateCall(
        request_id=f"q{i}",
        prompt_token_ids=list(tokens),
        block_hashes=hash_blocks(tokens, 16, model_seed("m")),
        block_size=16,
        session_id=session,
    )
    return SimpleNamespace(
        args=[call],
        kwargs={},
        metadata=SimpleNamespace(internal_request_id=f"q{i}", session_id=None),
        routing_context=SimpleNamespace(should_backoff=False),
    )


def test_routes_to_the_holder_counts_reasons_and_tracks_what_it_routed(redis_server):
    tokens = list(range(640))
    pub = KVIndexPublisher(
        redis_server.url, "unit", "m", "u2", lambda: hash_blocks(tokens, 16, model_seed("m")), unique_name=True
    ).start()
    assert pub.wait_synced(5)
    reps = replicas(3, prefill_tok_s=1000.0)

    async def main():
        router = make_router(redis_server.url, policy_kwargs={"tie_margin": 1.0})
        req = pending([*tokens, 1, 2, 3], 1)
        ranked = await router.choose_replicas(reps, req)
        assert ranked[0][0].replica_id.unique_id == "u2" and req.routing_context.should_backoff
        assert router.decisions["hit"] == 1
        assert router._load(reps[2]).routed_requests == 1  # counted before Ray even sends it
        router.on_request_completed(reps[2].replica_id, "q1")
        assert router._load(reps[2]).routed_requests == 0
        miss = await router.choose_replicas(reps, pending([9] * 300, 2))
        # A miss on three idle-looking replicas: tied, one group, so Ray's live queue probe picks among them.
        assert router.decisions["miss"] == 1 and len(miss) == 1 and len(miss[0]) == 3
        no_info = await router.choose_replicas(
            reps, SimpleNamespace(args=["not a dict"], metadata=None, routing_context=SimpleNamespace())
        )
        assert len(no_info) == 3 and router.decisions["no_routing_info"] == 1
        # q2 is ours, in flight where no probe counts it yet: a concurrent miss is never tied with its replica.
        burst = await router.choose_replicas(reps, pending([7] * 300, 4))
        assert len(burst[0]) == 2 and miss[0][0] not in burst[0]
        router.on_request_completed(miss[0][0].replica_id, "q2")
        router.on_request_completed(burst[0][0].replica_id, "q4")
        reps[1].routing_stats = {**reps[1].routing_stats, "num_running": 1, "pending_prefill_tokens": 640}
        split = await router.choose_replicas(reps, pending([8] * 300, 3))  # u1's report shows 0.64 s queued
        assert [len(g) for g in split] == [2, 1] and split[1][0] is reps[1]
        await router.index.close()

    asyncio.run(main())
    pub.close()


def test_a_busy_holders_prefix_is_fetched_by_the_replica_the_call_goes_to(redis_server):
    """The holder's queue is long and its peers pull blocks far faster than they prefill: the call goes to a
    peer and carries the plan naming the holder's KV address, for the replica that runs it."""
    tokens = list(range(640))
    pub = KVIndexPublisher(
        redis_server.url, "unit", "m", "u2", lambda: hash_blocks(tokens, 16, model_seed("m")), unique_name=True
    ).start()
    assert pub.wait_synced(5)
    reps = replicas(3, prefill_tok_s=1000.0, fetch_tok_s=200_000.0)
    for i, rep in enumerate(reps):
        rep.routing_stats["kv_address"] = f"tcp://10.0.0.{i}:7000"
    reps[2].routing_stats["pending_prefill_tokens"] = 5000  # 5 s of queued prefill on the holder

    async def main():
        router = make_router(redis_server.url)
        req = pending([*tokens, 1, 2, 3], 1)
        ranked = await router.choose_replicas(reps, req)
        chosen = ranked[0][0].replica_id.unique_id
        await router.index.close()
        return chosen, req.args[0].fetches, router.decisions

    chosen, fetches, decisions = asyncio.run(main())
    pub.close()
    assert chosen != "u2" and decisions["fetch"] == 1
    assert fetches[chosen] == KVFetch(holder=pub.replica_id, address="tcp://10.0.0.2:7000", num_blocks=40)


def test_index_down_still_routes_from_recent_decisions():
    reps = replicas(3, prefill_tok_s=1000.0)

    async def main():
        router = make_router(f"redis://127.0.0.1:{free_port()}/0")
        first = pending(list(range(480)), 1)
        ranked = await router.choose_replicas(reps, first)
        home = ranked[0][0]
        router.on_request_routed(first, home.replica_id, None)
        sibling = await router.choose_replicas(reps, pending([*range(480), 5, 6], 2))
        assert sibling[0][0] is home
        assert router.decisions["index_unavailable_hit"] == 1
        await router.index.close()

    asyncio.run(main())


def test_in_a_burst_a_tie_is_offered_as_the_replica_it_is_counted_against(monkeypatch):
    """Alone, a tie goes to Ray as one group (its live queue probes choose). While other requests wait here to
    be routed (sent together), none has reached a replica: the probes read equal and Ray's pick among equals is
    arbitrary, so each request goes as the router's first choice alone, where it counted it, and the burst
    spreads as counted."""
    reps = replicas(3, prefill_tok_s=1000.0)

    async def main():
        router = make_router(None, policy="kv_aware")
        router.index = None
        alone = await router.choose_replicas(reps, pending([9] * 300, 1))
        assert [len(group) for group in alone] == [3]
        router.on_request_completed(alone[0][0].replica_id, "q1")
        monkeypatch.setattr(KVAwareRequestRouter, "num_pending_requests", property(lambda self: 6))
        homes = []
        for i in range(10, 16):
            ranked = await router.choose_replicas(reps, pending([i] * 300, i))
            assert [len(group) for group in ranked] == [1, 1, 1]
            assert router.routes.where(f"q{i}") == ranked[0][0].replica_id  # offered alone where it is counted
            homes.append(ranked[0][0].replica_id.unique_id)
        assert sorted(homes) == ["u0", "u0", "u1", "u1", "u2", "u2"]

    asyncio.run(main())


def test_without_the_index_a_turn_on_its_home_counts_only_what_it_lacks():
    """With the index down the router prices a conversation's next turn by where it sent the history; what it
    counts as queued there must be the same few new tokens, not the whole prompt, or the home looks busy with
    work it will never do and the conversation's other turns move off it."""
    reps = replicas(3, prefill_tok_s=1000.0)
    history = list(range(480))

    async def main():
        router = make_router(None, policy="kv_aware")
        router.index = None
        first = pending(history, 1)
        home = (await router.choose_replicas(reps, first))[0][0]
        router.on_request_routed(first, home.replica_id, None)
        router.on_request_completed(home.replica_id, "q1")
        ranked = await router.choose_replicas(reps, pending([*history, *range(900, 932)], 2))  # 32 new tokens
        assert ranked[0][0] is home and router.decisions["index_unavailable_hit"] == 1
        assert router._load(home).routed_prefill_tokens <= 32  # not its 512-token prompt

    asyncio.run(main())


def test_session_breaks_near_ties_toward_the_previous_replica():
    reps = replicas(3, prefill_tok_s=1000.0)

    async def main():
        router = make_router(None, policy="kv_aware")
        router.index = None
        first = pending([7] * 40, 1, session="alice")
        home = (await router.choose_replicas(reps, first))[0][0]
        router.on_request_routed(first, home.replica_id, None)
        router.on_request_completed(home.replica_id, "q1")
        again = await router.choose_replicas(reps, pending([8] * 40, 2, session="alice"))
        assert again[0][0] is home

    asyncio.run(main())


def test_baseline_policy_selected_by_name():
    reps = replicas(3)

    async def main():
        router = make_router(None, policy="round_robin")
        firsts = [
            (await router.choose_replicas(reps, pending([1] * 40, i)))[0][0].replica_id.unique_id for i in range(3)
        ]
        assert sorted(firsts) == ["u0", "u1", "u2"] and router.index is None

    asyncio.run(main())


def test_a_newer_load_report_supersedes_routed_work():
    reps = replicas(2, prefill_tok_s=1000.0)

    async def main():
        router = make_router(None, policy="kv_aware")
        router.index = None
        ranked = await router.choose_replicas(reps, pending([3] * 64, 1))
        chosen = ranked[0][0]
        assert router._load(chosen).routed_requests == 1
        chosen.routing_stats = {**chosen.routing_stats, "reported_at": time.time() + 1, "num_running": 1}
        load = router._load(chosen)  # the report now includes it: counted once, not twice
        assert (load.routed_requests, load.routed_prefill_tokens, load.num_running) == (0, 0, 1)

    asyncio.run(main())


def test_a_reported_queue_drains_at_the_reported_rate():
    """A report taken while three prompts queued (1,800 tokens at 12,000 tok/s: 0.15 s of work) must not
    keep the replica looking busy until the next report; what this router sent since queues behind it."""
    now = time.time()
    stats = {"prefill_tok_s": 12000.0, "pending_prefill_tokens": 1800}
    fresh = Replica(ReplicaID("u0", DEP), {"index_id": "u0", "reported_at": now, **stats})
    old = Replica(ReplicaID("u1", DEP), {"index_id": "u1", "reported_at": now - 0.5, **stats})

    async def main():
        router = make_router(None, policy="kv_aware")
        router.index = None
        assert router._load(old).pending_prefill_tokens == 0
        assert router._load(fresh).pending_prefill_tokens > 1700
        await router.choose_replicas([fresh], pending([3] * 600, 1))
        load = router._load(fresh)
        assert load.routed_requests == 1 and load.routed_prefill_tokens > 550  # behind the report's backlog
        assert (load.pending_prefill_tokens + load.routed_prefill_tokens) / 12000 > 0.19

    asyncio.run(main())


def test_a_load_report_knows_its_age():
    """The router dates each replica's report, so a full KV pool it showed is priced as freeing since."""
    now = time.time()
    stats = {"index_id": "u0", "kv_free_blocks": 6, "kv_total_blocks": 48, "num_running": 1, "step_s": 0.07}
    old = Replica(ReplicaID("u0", DEP), {**stats, "reported_at": now - 0.5, "mean_output_tokens": 16})
    router = make_router(None, policy="kv_aware")
    load = router._load(old)
    assert 0.5 <= load.report_age_s < 5.0
    assert load.kv_wait_s(640, 16) == pytest.approx(max(34 / 42 * 16 * 0.07 - load.report_age_s, 0.0))
    unreported = Replica(ReplicaID("u1", DEP), {})
    assert router._load(unreported).report_age_s == 0.0


def test_routed_work_drains_on_a_replica_that_has_not_reported_yet():
    """A new replica has no report: what this router sent it still drains from the moment it was sent."""
    fresh = Replica(ReplicaID("u0", DEP), {"index_id": "u0", "prefill_tok_s": 1000.0})

    async def main():
        router = make_router(None, policy="kv_aware")
        router.index = None
        await router.choose_replicas([fresh], pending([3] * 600, 1))
        assert router._load(fresh).routed_prefill_tokens > 550
        await asyncio.sleep(0.3)
        assert router._load(fresh).routed_prefill_tokens < 350

    asyncio.run(main())


def test_prediction_is_shared_across_router_processes(redis_server):
    """Router A routes a new prefix; router B (another process) sends a sibling to the same replica before
    any KV event exists, through the short-lived prediction in Redis."""
    pubs = [KVIndexPublisher(redis_server.url, "unit", "m", f"u{i}", list, unique_name=True).start() for i in range(3)]
    assert all(p.wait_synced(5) for p in pubs)
    reps = replicas(3, prefill_tok_s=1000.0)
    prefix = list(range(5000, 5000 + 800))

    async def main():
        a, b = make_router(redis_server.url), make_router(redis_server.url)
        first = pending([*prefix, 1], 1)
        home = (await a.choose_replicas(reps, first))[0][0]
        a.on_request_routed(first, home.replica_id, None)
        await asyncio.gather(*a._tasks)
        home.routing_stats = {**home.routing_stats, "num_running": 4}  # without a hit, B would avoid it
        sibling = await b.choose_replicas(reps, pending([*prefix, 2, 3], 2))
        assert sibling[0][0].replica_id == home.replica_id and b.decisions["hit"] == 1
        for r in (a, b):
            await r.index.close()

    asyncio.run(main())
    for p in pubs:
        p.close()


def test_router_memory_stays_bounded_when_queued_requests_are_cancelled():
    """Requests cancelled while they queued are never routed nor completed: their planned decisions and
    in-flight entries are dropped by age and count, not kept forever."""
    import kvmesh.router.serve_router as serve_router

    reps = replicas(2, prefill_tok_s=1000.0)

    async def main():
        router = make_router(None, max_tracked=50)
        for i in range(200):  # decided, then cancelled: Ray never calls on_request_routed / _completed
            await router.choose_replicas(reps, pending([i % 7] * 40, i))
        assert len(router._planned) <= 50 and len(router.routes._where) <= 50
        next(iter(router._planned.values())).at = time.monotonic() - 1e6  # a decision long ago
        await router.choose_replicas(reps, pending([1] * 40, 999))
        assert all(p.at > time.monotonic() - serve_router.PLANNED_TTL_S for p in router._planned.values())

    asyncio.run(main())


def test_an_adapter_request_goes_only_to_replicas_that_can_serve_the_adapter():
    """Behind ``kvmesh serve --worker``: a worker whose ``/v1/models`` lacks the adapter (``lora_served``) is never
    offered a request on it, however idle; a kvmesh engine (``lora_served`` None) reads any; where no replica
    can serve it, every one is offered (the worker's 404 then says so)."""
    now = time.time()
    stats = [{"lora_served": ["tone"], "num_running": 40}, {"lora_served": []}, {}]
    reps = [
        Replica(ReplicaID(f"u{i}", DEP), {"index_id": f"u{i}", "reported_at": now, **s}) for i, s in enumerate(stats)
    ]

    def on(adapter):
        req = pending([7, *range(300)], 1)
        req.args[0].lora_name = adapter
        return req

    async def main():
        router = make_router(f"redis://127.0.0.1:{free_port()}/0")
        offered = {r.replica_id.unique_id for group in await router.choose_replicas(reps, on("tone")) for r in group}
        assert offered == {"u0", "u2"}
        workers_only = reps[:2]
        offered = {r.replica_id.unique_id for g in await router.choose_replicas(workers_only, on("style")) for r in g}
        assert offered == {"u0", "u1"}
        base = {r.replica_id.unique_id for group in await router.choose_replicas(reps, on(None)) for r in group}
        assert base == {"u0", "u1", "u2"}
        await router.index.close()

    asyncio.run(main())
