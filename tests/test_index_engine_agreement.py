"""After random engine activity, the Redis index agrees exactly with the engine's own prefix cache, on the
device and in the host tier."""

from __future__ import annotations

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.index_schema import block_key, index_prefix
from tests.index_helpers import entries_of_slot, host_tag, query

BLOCK, POOL = 4, 20

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 30), st.integers(1, 10)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=40,
)


@pytest.fixture(scope="module", params=[0, 12], ids=["device", "host_tier"])
def wired(tiny_llama_dir, redis_server, request):
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK, num_kv_blocks=POOL, max_num_batched_tokens=12)
    if request.param:
        per_block = LLMEngine(config).bytes_per_block
        config = EngineConfig(**{**vars(config), "host_cache_bytes": request.param * per_block})
    engine = LLMEngine(config)
    host = engine.swap.cached_hashes if engine.swap is not None else None
    name = f"r-{request.param}"
    pub = KVIndexPublisher(
        redis_server.url, "agree", engine.model_id, name, engine.pool.cached_hashes, host_snapshot=host
    )
    engine.kv_event_sinks.append(pub.start().publish)
    yield engine, pub
    pub.close()


def leading(chain, held) -> int:
    n = 0
    for h in chain:
        if not held(h):
            break
        n += 1
    return n


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_index_mirrors_engine(wired, redis_server, ops):
    engine, pub = wired
    prefixes = [list(range(300, 300 + n)) for n in (0, 7, 13)]
    chains, added = [], []
    for op in ops:
        if op[0] == "add":
            prompt = prefixes[op[1]] + [5000 + len(engine.requests) * 37 + i for i in range(op[2])]
            rid = engine.add_request(prompt, SamplingParams(max_tokens=op[3], temperature=0, ignore_eos=True))
            added.append(rid)
            chains.append(engine.requests[rid][0].block_hashes)
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
        elif added:
            engine.abort_request(added[op[1] % len(added)])
    assert pub.wait_synced(10)
    prefix = index_prefix("agree", engine.model_id)
    assert entries_of_slot(redis_server.url, prefix, pub.slot) == {block_key(h) for h in engine.pool.cached_hashes()}
    hosted = set(engine.swap.cached_hashes()) if engine.swap is not None else set()
    assert entries_of_slot(redis_server.url, prefix, host_tag(pub.slot)) == {block_key(h) for h in hosted}
    for chain in chains:
        got = query(redis_server.url, "agree", engine.model_id, chain, [pub.replica_id])
        on_device = leading(chain, lambda h: engine.pool.lookup(h) is not None)
        in_host = leading(chain[on_device:], hosted.__contains__)
        assert got.device_hits == {pub.replica_id: on_device}
        assert got.host_hits == ({pub.replica_id: in_host} if in_host else {})
    for rid in list(engine.requests):
        engine.abort_request(rid)


def test_redis_back_from_an_older_snapshot_gets_the_lost_batches_again(tiny_llama_dir, own_redis):
    """Redis restarted from a snapshot taken before the last batches (a persistent Redis losing its last
    writes, a lagging replica promoted): the publisher sees the gap in its sequence numbers, sends the lost
    batches again instead of resynchronising, and the index holds the engine's set exactly."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK, num_kv_blocks=64))
    pub = KVIndexPublisher(own_redis.url, "snap", engine.model_id, "r", engine.pool.cached_hashes)
    engine.kv_event_sinks.append(pub.start().publish)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    try:
        for first, count in ((100, 3), (900, 3)):
            for k in range(count):
                engine.add_request(list(range(first + 50 * k, first + 50 * k + 20)), params)
                while engine.has_unfinished:
                    engine.step()
            assert pub.wait_synced(10)
            if first == 100:
                redis.Redis.from_url(own_redis.url).save()  # the snapshot: the first three prompts only
        resyncs = pub.stats["resyncs"]
        own_redis.restart(from_snapshot=True)
        engine.add_request(list(range(5000, 5020)), params)  # the next batch finds the gap
        while engine.has_unfinished:
            engine.step()
        assert pub.wait_synced(10)
        assert pub.stats["replayed"] >= 1 and pub.stats["resyncs"] == resyncs  # steps queued together are one batch
        prefix = index_prefix("snap", engine.model_id)
        assert entries_of_slot(own_redis.url, prefix, pub.slot) == {block_key(h) for h in engine.pool.cached_hashes()}
    finally:
        pub.close()
