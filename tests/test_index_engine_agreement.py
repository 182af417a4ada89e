"""After random engine activity, the Redis index agrees exactly with the engine's own prefix cache."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica import EngineConfig, LLMEngine, SamplingParams
from router.index_publisher import KVIndexPublisher
from router.index_schema import block_key, index_prefix
from tests.index_helpers import entries_of_slot, lookup

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


@pytest.fixture(scope="module")
def wired(tiny_llama_dir, redis_server):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), block_size=BLOCK, num_kv_blocks=POOL, max_num_batched_tokens=12)
    )
    pub = KVIndexPublisher(redis_server.url, "agree", engine.model_id, "r0", engine.pool.cached_hashes).start()
    engine.kv_event_sinks.append(pub.publish)
    yield engine, pub
    pub.close()


def leading_cached(engine, chain) -> int:
    n = 0
    for h in chain:
        if engine.pool.lookup(h) is None:
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
    for chain in chains:
        got = lookup(redis_server.url, "agree", engine.model_id, chain, [pub.replica_id])
        assert got == {pub.replica_id: leading_cached(engine, chain)}
    for rid in list(engine.requests):
        engine.abort_request(rid)
