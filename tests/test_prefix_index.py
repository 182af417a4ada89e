"""The Redis prefix index against a real redis-server: publisher (replica side) + lookups (router side)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.messages import ReplicaStatus
from kvmesh.replica.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.index_schema import block_key, index_prefix
from kvmesh.router.prefix_index import PrefixIndex
from tests.index_helpers import disk_tag, entries_of_slot, host_tag, lookup, query

MODEL = "m"
CHAINS = [hash_blocks(list(range(s, s + 16 * 40)), 16, model_seed(MODEL)) for s in (0, 10_000, 20_000)]


class FakeCache:
    """The publisher's view of an engine: a set of cached hashes plus the events that changed it."""

    def __init__(self):
        self.hashes: dict[bytes, None] = {}

    def store(self, hashes):
        new = [h for h in hashes if h not in self.hashes]
        self.hashes.update(dict.fromkeys(new))
        return [BlockStored(h, None) for h in new]

    def remove(self, hashes):
        gone = [h for h in hashes if self.hashes.pop(h, 0) is None]
        return [BlockRemoved(h) for h in gone]

    def snapshot(self):
        return list(self.hashes)


def make_publisher(url, deployment, name, cache, ttl=1.0, **kw):
    return KVIndexPublisher(url, deployment, MODEL, name, cache.snapshot, heartbeat_ttl_s=ttl, **kw).start()


def test_lookup_counts_leading_blocks_per_replica(redis_server, request):
    dep = request.node.name
    a_cache, b_cache = FakeCache(), FakeCache()
    a = make_publisher(redis_server.url, dep, "a", a_cache)
    b = make_publisher(redis_server.url, dep, "b", b_cache)
    a.publish(a_cache.store(CHAINS[0][:30]))
    b.publish(b_cache.store(CHAINS[0][:10] + CHAINS[1][:3]))
    assert a.wait_synced(5) and b.wait_synced(5)
    got = lookup(redis_server.url, dep, MODEL, CHAINS[0], [a.replica_id, b.replica_id, "nobody#1"])
    assert got == {a.replica_id: 30, b.replica_id: 10}
    a.publish(a_cache.remove(CHAINS[0][5:30]))  # evicted tail-first, as the engine does
    assert a.wait_synced(5)
    assert lookup(redis_server.url, dep, MODEL, CHAINS[0], [a.replica_id])[a.replica_id] == 5
    assert lookup(redis_server.url, dep, MODEL, CHAINS[1], [a.replica_id, b.replica_id]) == {
        a.replica_id: 0,
        b.replica_id: 3,
    }
    a.close()
    b.close()


def test_status_reports_cross_redis_typed_to_metrics_and_kvmesh_status(redis_server, request):
    """A replica's ``ReplicaStatus`` is stored beside its heartbeat with its publisher's index size and read
    back typed by the ingress; a status that fails still beats, and its counters show as unknown."""
    from kvmesh.cluster.monitoring import metrics
    from kvmesh.cluster.monitoring.status import render_status
    from kvmesh.core.messages import ClusterStatus

    dep = request.node.name
    cache = FakeCache()
    ok = make_publisher(
        redis_server.url,
        dep,
        "ok",
        cache,
        status=lambda: ReplicaStatus(num_running=3, kv_usage=0.5, pid=42, prefill_busy=0.0),
    )

    def broken() -> ReplicaStatus:
        raise RuntimeError("stats broke")

    bad = make_publisher(redis_server.url, dep, "bad", FakeCache(), status=broken)
    ok.publish(cache.store(CHAINS[0][:7]))
    assert ok.wait_synced(5) and bad.wait_synced(5)

    async def reports_after_a_beat() -> dict[str, ReplicaStatus]:
        index = PrefixIndex(redis_server.url, dep, MODEL)
        try:
            for _ in range(100):
                reports = await index.replica_reports()
                if len(reports) == 2 and reports[ok.replica_id].index_entries == 7:
                    return reports
                await asyncio.sleep(0.05)
            return reports
        finally:
            await index.close()

    reports = asyncio.run(reports_after_a_beat())
    good, failed = reports[ok.replica_id], reports[bad.replica_id]
    assert (good.num_running, good.kv_usage, good.pid, good.index_entries, good.error) == (3, 0.5, 42, 7, None)
    assert good.reported_at > time.time() - 10
    assert "stats broke" in failed.error and failed.index_entries == 0
    text = metrics.render(reports).decode()
    assert f'kvmesh_replica_requests_running{{replica="{ok.replica_id}"}} 3.0' in text
    assert f'kvmesh_replica_index_entries{{replica="{ok.replica_id}"}} 7.0' in text
    assert f'kvmesh_replica_requests_running{{replica="{bad.replica_id}"}}' not in text  # unknown, not 0
    assert f'kvmesh_replica_index_entries{{replica="{bad.replica_id}"}} 0.0' in text
    # The publisher's own counters come with every report, even one whose engine could not be read: each
    # replica's start was one full rebuild, and nothing failed.
    for replica in (ok.replica_id, bad.replica_id):
        assert f'kvmesh_replica_index_resyncs_total{{replica="{replica}"}} 1.0' in text
        assert f'kvmesh_replica_index_errors_total{{replica="{replica}"}} 0.0' in text
    assert "kvmesh_replica_kv_event_gaps_total{" not in text  # no worker's events are followed here
    status = {
        "model": MODEL,
        "policy": "kv_aware",
        "index": {"entries": 7},
        "live_replicas": 2,
        "decisions": [],
        "redis": {"ok": True},
        "replicas": {rid: r.as_dict() for rid, r in reports.items()},
    }
    rows = [line.split() for line in render_status(ClusterStatus.from_dict(status)).splitlines()]
    assert [ok.replica_id, "?", "50.0%", "0.0%", "off", "off", "off", "3", "0", "0", "0%", "-", "7"] in rows
    assert [bad.replica_id, *["?"] * 11, "0"] in rows
    ok.close()
    bad.close()


def test_host_tier_entries_are_looked_up_per_tier_resynced_and_purged(redis_server, request):
    """Blocks the device evicts to its host tier: the lookup returns the device depth and the host
    continuation; a resync republishes both tiers; a dead replica's purge removes both."""
    dep, prefix = request.node.name, index_prefix(request.node.name, MODEL)
    device, host = FakeCache(), FakeCache()
    pub = KVIndexPublisher(
        redis_server.url, dep, MODEL, "a", device.snapshot, heartbeat_ttl_s=1.0, host_snapshot=host.snapshot
    ).start()
    pub.publish(device.store(CHAINS[0][:30]))
    moved = CHAINS[0][10:30][::-1]  # evicted tail-first into the host tier
    host.store(moved)
    pub.publish(device.remove(moved) + [BlockStored(h, None, "host") for h in moved])
    assert pub.wait_synced(5)
    got = query(redis_server.url, dep, MODEL, CHAINS[0], [pub.replica_id])
    assert got.device_hits == {pub.replica_id: 10} and got.host_hits == {pub.replica_id: 20}
    host.remove(CHAINS[0][25:30])
    pub.publish([BlockRemoved(h, "host") for h in CHAINS[0][25:30]])  # the tier dropped its oldest 5
    assert pub.wait_synced(5)
    assert query(redis_server.url, dep, MODEL, CHAINS[0], [pub.replica_id]).host_hits == {pub.replica_id: 15}
    old = pub.slot
    pub.publish([AllBlocksCleared()])  # forces a resync from both snapshots (none of it is cleared here)
    assert pub.wait_synced(5) and pub.slot != old
    assert len(entries_of_slot(redis_server.url, prefix, host_tag(pub.slot))) == 15
    assert query(redis_server.url, dep, MODEL, CHAINS[0], [pub.replica_id]).host_hits == {pub.replica_id: 15}
    assert entries_of_slot(redis_server.url, prefix, host_tag(old)) == set()
    pub.close()
    assert entries_of_slot(redis_server.url, prefix, host_tag(pub.slot)) == set()
    assert entries_of_slot(redis_server.url, prefix, pub.slot) == set()


def test_disk_tier_entries_continue_the_chain_resync_and_purge(redis_server, request):
    """A disk tier under the host tier: the lookup continues device -> host -> disk; a resync republishes
    its snapshot; closing removes its entries."""
    dep, prefix = request.node.name, index_prefix(request.node.name, MODEL)
    device, host, disk = FakeCache(), FakeCache(), FakeCache()
    pub = KVIndexPublisher(
        redis_server.url,
        dep,
        MODEL,
        "a",
        device.snapshot,
        heartbeat_ttl_s=1.0,
        host_snapshot=host.snapshot,
        disk_snapshot=disk.snapshot,
    ).start()
    in_host, on_disk = CHAINS[0][5:12], CHAINS[0][12:30]
    host.store(in_host)
    disk.store(on_disk)
    pub.publish(device.store(CHAINS[0][:5]) + [BlockStored(h, None, "host") for h in in_host])
    pub.publish([BlockStored(h, None, "disk") for h in on_disk])
    assert pub.wait_synced(5)
    got = query(redis_server.url, dep, MODEL, CHAINS[0], [pub.replica_id])
    rid = pub.replica_id
    assert (got.device_hits, got.host_hits, got.disk_hits) == ({rid: 5}, {rid: 7}, {rid: 18})
    disk.remove(CHAINS[0][20:30])
    pub.publish([BlockRemoved(h, "disk") for h in CHAINS[0][20:30]])  # the disk's LRU end
    assert pub.wait_synced(5)
    assert query(redis_server.url, dep, MODEL, CHAINS[0], [pub.replica_id]).disk_hits == {pub.replica_id: 8}
    old = pub.slot
    pub.publish([AllBlocksCleared()])  # a resync from the three snapshots
    assert pub.wait_synced(5) and pub.slot != old
    assert len(entries_of_slot(redis_server.url, prefix, disk_tag(pub.slot))) == 8
    assert entries_of_slot(redis_server.url, prefix, disk_tag(old)) == set()
    pub.close()
    assert entries_of_slot(redis_server.url, prefix, disk_tag(pub.slot)) == set()


def test_clean_shutdown_removes_every_entry(redis_server, request):
    dep = request.node.name
    cache = FakeCache()
    pub = make_publisher(redis_server.url, dep, "a", cache)
    pub.publish(cache.store(CHAINS[0] + CHAINS[1]))
    assert pub.wait_synced(5)
    slot = pub.slot
    assert len(entries_of_slot(redis_server.url, index_prefix(dep, MODEL), slot)) == 80
    pub.close()
    client = redis.Redis.from_url(redis_server.url)
    prefix = index_prefix(dep, MODEL)
    leftover = [k for k in client.scan_iter(match=(prefix + "*").encode()) if not k.endswith((b"slots", b"meta"))]
    assert leftover == []
    assert lookup(redis_server.url, dep, MODEL, CHAINS[0], [pub.replica_id]) == {}


def test_restarted_replica_never_inherits_and_dead_one_is_purged(redis_server, request):
    dep = request.node.name
    old_cache, new_cache = FakeCache(), FakeCache()
    old = make_publisher(redis_server.url, dep, "r0", old_cache, ttl=0.6)
    old.publish(old_cache.store(CHAINS[0]))
    assert old.wait_synced(5)
    old_slot = old.slot
    old.close(remove_entries=False)  # the process died: nothing cleaned up
    new = make_publisher(redis_server.url, dep, "r0", new_cache, ttl=0.6)
    new.publish(new_cache.store(CHAINS[1][:4]))
    assert new.wait_synced(5) and new.replica_id != old.replica_id
    assert lookup(redis_server.url, dep, MODEL, CHAINS[0], [new.replica_id]) == {new.replica_id: 0}
    time.sleep(0.8)  # the dead incarnation's heartbeat expires
    got = lookup(redis_server.url, dep, MODEL, CHAINS[0], [old.replica_id, new.replica_id])
    assert got == {new.replica_id: 0}  # never returned once expired
    prefix = index_prefix(dep, MODEL)
    deadline = time.monotonic() + 5
    while entries_of_slot(redis_server.url, prefix, old_slot) and time.monotonic() < deadline:
        lookup(redis_server.url, dep, MODEL, CHAINS[0], [old.replica_id])  # whoever notices purges
        time.sleep(0.05)
    assert entries_of_slot(redis_server.url, prefix, old_slot) == set()
    assert not redis.Redis.from_url(redis_server.url).hexists(prefix + "reg", old.replica_id)
    new.close()


def test_redis_restart_with_data_loss_is_rebuilt_within_10s(own_redis):
    cache = FakeCache()
    pub = make_publisher(own_redis.url, "d", "a", cache, ttl=1.0)
    pub.publish(cache.store(CHAINS[0]))
    assert pub.wait_synced(5)
    own_redis.restart()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        if lookup(own_redis.url, "d", MODEL, CHAINS[0], [pub.replica_id]) == {pub.replica_id: 40}:
            break
        time.sleep(0.1)
    rebuilt = time.monotonic() - t0
    assert rebuilt < 10, "index not rebuilt within 10 s"
    assert pub.stats["resyncs"] >= 2
    pub.close()


def test_unreachable_redis_costs_nothing(own_redis):
    cache = FakeCache()
    pub = make_publisher(own_redis.url, "d", "a", cache, ttl=1.0, max_queued_steps=50)
    pub.publish(cache.store(CHAINS[0][:8]))
    assert pub.wait_synced(5)
    own_redis.stop()
    t0 = time.perf_counter()
    assert (
        lookup(f"redis://127.0.0.1:{own_redis.port}/0", "d", MODEL, CHAINS[0], [pub.replica_id], timeout_s=0.05) is None
    )
    assert time.perf_counter() - t0 < 1.0  # includes client set-up; the lookup itself is bounded by 50 ms
    t0 = time.perf_counter()
    for i in range(200):  # the engine keeps stepping: publishing must neither block nor grow without bound
        pub.publish(cache.store(CHAINS[1][i % 40 : i % 40 + 1]) or cache.remove(CHAINS[1][i % 40 : i % 40 + 1]))
    assert time.perf_counter() - t0 < 0.5
    assert len(pub._queue) <= 50 and pub.stats["overflows"] >= 1
    own_redis.start()
    assert pub.wait_synced(10)
    expected = sum(1 for _ in CHAINS[0][:8])
    assert lookup(own_redis.url, "d", MODEL, CHAINS[0], [pub.replica_id]) == {pub.replica_id: expected}
    assert entries_of_slot(own_redis.url, index_prefix("d", MODEL), pub.slot) == {block_key(h) for h in cache.hashes}
    pub.close()


def test_prefix_cache_reset_clears_the_replica(redis_server, request):
    dep = request.node.name
    cache = FakeCache()
    pub = make_publisher(redis_server.url, dep, "a", cache)
    pub.publish(cache.store(CHAINS[0]))
    assert pub.wait_synced(5)
    cache.hashes.clear()
    pub.publish([AllBlocksCleared()])
    assert pub.wait_synced(5)
    assert lookup(redis_server.url, dep, MODEL, CHAINS[0], [pub.replica_id]) == {pub.replica_id: 0}
    pub.close()


def test_namespaces_isolate_models_and_deployments(redis_server):
    cache = FakeCache()
    pub = KVIndexPublisher(redis_server.url, "prod", "model-a", "r", cache.snapshot).start()
    pub.publish(cache.store(CHAINS[0][:3]))
    assert pub.wait_synced(5)
    assert lookup(redis_server.url, "prod", "model-a", CHAINS[0], [pub.replica_id]) == {pub.replica_id: 3}
    assert lookup(redis_server.url, "prod", "model-b", CHAINS[0], [pub.replica_id]) == {}
    assert lookup(redis_server.url, "staging", "model-a", CHAINS[0], [pub.replica_id]) == {}
    pub.close()


def test_redis_holds_only_hashes_and_ids(redis_server, request):
    dep = request.node.name
    cache = FakeCache()
    pub = make_publisher(redis_server.url, dep, "replica-7", cache)
    pub.publish(cache.store(CHAINS[2]))
    assert pub.wait_synced(5)
    client = redis.Redis.from_url(redis_server.url)
    prefix = index_prefix(dep, MODEL).encode()
    kinds = {k[len(prefix) :].split(b":")[0] for k in client.scan_iter(match=prefix + b"*")}
    assert kinds <= {b"b", b"log", b"seq", b"hb", b"reg", b"slots", b"meta", b"p"}
    for key in client.scan_iter(match=prefix + b"b:*"):
        assert len(key) == len(prefix) + 4 and all(len(f) == 6 for f in client.hkeys(key))
    assert set(client.hgetall(prefix + b"meta")) == {b"deployment", b"model"}
    pub.close()


@pytest.mark.parametrize("n", [1, 3])
def test_lookup_of_empty_or_unknown(redis_server, n):
    assert lookup(redis_server.url, "x", MODEL, CHAINS[0], []) == {}
    assert lookup(redis_server.url, "x", MODEL, [], [f"ghost#{i}" for i in range(n)]) == {}


def test_password_protected_redis_works_and_a_wrong_password_fails_closed():
    from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis

    with EmbeddedRedis(password="index-s3cret") as server:
        cache = FakeCache()
        pub = make_publisher(server.url, "d", "a", cache)
        pub.publish(cache.store(CHAINS[0][:8]))
        assert pub.wait_synced(5)
        assert lookup(server.url, "d", MODEL, CHAINS[0][:8], [pub.replica_id]) == {pub.replica_id: 8}
        wrong = server.url.replace("index-s3cret", "guess")
        assert lookup(wrong, "d", MODEL, CHAINS[0][:8], [pub.replica_id], timeout_s=0.5) is None  # unknown, no raise
        pub.close()


def test_nothing_from_redis_or_the_network_is_unpickled_or_evaluated():
    """Our packages never deserialize with pickle/marshal, evaluate strings or load YAML unsafely."""
    import re

    from tests.source_tree import ROOT as root
    from tests.source_tree import modules

    risky = re.compile(
        r"\b(pickle|cPickle|marshal|dill|shelve)\.loads?\b|(?<![.\w])(eval|exec)\(|yaml\.load\(|yaml\.unsafe_load"
    )
    device_hits = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for _, path in modules()
        if "_pb2" not in path.name
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if risky.search(line)
    ]
    assert not device_hits, device_hits


def test_conversation_starts_are_shared_decay_and_go_with_the_replica(redis_server, request):
    """Every router sees the conversations any router started on a replica (bounded-load placement), the
    counts fade with age, and a replica that leaves takes its count with it."""
    dep = request.node.name
    cache = FakeCache()
    a, b = make_publisher(redis_server.url, dep, "a", cache), make_publisher(redis_server.url, dep, "b", cache)
    assert a.wait_synced(5) and b.wait_synced(5)
    ids = [a.replica_id, b.replica_id]

    async def go():
        router_1 = PrefixIndex(redis_server.url, dep, MODEL, timeout_s=0.5, session_decay_s=2.0)
        router_2 = PrefixIndex(redis_server.url, dep, MODEL, timeout_s=0.5, session_decay_s=2.0)
        try:
            assert (await router_2.query(CHAINS[0], ids)).starts == {a.replica_id: 0.0, b.replica_id: 0.0}
            for _ in range(3):
                assert await router_1.start_session(a.replica_id)
            assert await router_2.start_session(a.replica_id)
            answer = await router_2.query(CHAINS[0], ids)
            device_hits, starts = answer.device_hits, answer.starts
            assert device_hits == {a.replica_id: 0, b.replica_id: 0}
            assert starts[a.replica_id] == pytest.approx(4.0, abs=0.05) and starts[b.replica_id] == 0.0
            await asyncio.sleep(1.4)  # 0.7 time constants: exp(-0.7) = 0.50
            assert (await router_1.query(CHAINS[0], ids)).starts[a.replica_id] == pytest.approx(2.0, abs=0.3)
        finally:
            await router_1.close()
            await router_2.close()

    asyncio.run(go())
    a.close()
    field = a.replica_id.encode()
    assert field not in redis.Redis.from_url(redis_server.url).hgetall(index_prefix(dep, MODEL) + "ss")
    b.close()
