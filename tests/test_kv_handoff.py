"""Scaling that keeps KV, on real engine replicas sharing a real Redis index (no Ray): a replica that drains
hands its hottest blocks to the replicas that stay, a replica that starts pulls its peers' hottest blocks
before its first request, and a replica that is draining itself takes nothing."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.cluster.engines.engine_replica import EngineReplica
from kvmesh.core.engine_config import EngineConfig
from kvmesh.replica.kv_scaling import hand_off
from kvmesh.router.prefix_index import PrefixIndex
from tests.serve_helpers import greedy_call

PROMPTS = [list(range(2000 * (i + 1), 2000 * (i + 1) + 320)) for i in range(4)]  # 20 blocks each


async def serve(replica: EngineReplica, tokens: list[int]) -> None:
    async for _ in replica.generate(greedy_call(replica.engine.model_id, tokens, 1)):
        pass


async def depths(url: str, model: str, replica_ids: list[str]) -> list[dict[str, int]]:
    index = PrefixIndex(url, "kvho", model, timeout_s=2.0)
    try:
        return [await index.lookup(greedy_call(model, t, 1).block_hashes, replica_ids) for t in PROMPTS]
    finally:
        await index.close()


@pytest.mark.parametrize("keep_kv", [True, False])
def test_a_draining_replica_hands_off_and_a_new_one_starts_warm(own_redis, tiny_llama_dir, keep_kv):
    """``keep_kv`` off (``kvmesh serve --no-keep-kv``): the drained replica's cache goes with it and the
    newcomer starts cold."""
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=400, torch_threads=1)  # warm-up: up to 100

    def replica(name: str) -> EngineReplica:
        ids = (f"{name}-{keep_kv}", None)
        return EngineReplica(config, redis_url=own_redis.url, deployment="kvho", identity=ids, keep_kv=keep_kv)

    async def main():
        drained, staying = replica("drained"), replica("staying")
        for r in (drained, staying):
            await r._peer_start
        for tokens in PROMPTS:
            await serve(drained, tokens)
        await asyncio.sleep(1.0)  # statuses (with KV addresses) reach Redis beside the heartbeats
        await drained.__del__()  # what Serve awaits when it removes a replica
        await asyncio.sleep(0.5)
        after_drain = await depths(own_redis.url, config.model, [staying.index_id])
        newcomer = replica("newcomer")
        await newcomer._peer_start  # its warm-up: before its first request
        await asyncio.sleep(0.5)
        after_start = await depths(own_redis.url, config.model, [newcomer.index_id])
        for r in (staying, newcomer):
            r.close()
        return after_drain, after_start, staying.stats(), newcomer.stats()

    after_drain, after_start, staying_stats, newcomer_stats = asyncio.run(main())
    # (a pool of 200 would take the 50 hottest blocks: its warm-up is bounded to a quarter of the pool)
    kept = 20 if keep_kv else 0
    assert all(d[next(iter(d))] == kept for d in after_drain), after_drain  # the survivor took every prompt
    assert all(d[next(iter(d))] == kept for d in after_start), after_start  # the newcomer pulled them first
    assert staying_stats.kv_fetched_blocks == newcomer_stats.kv_fetched_blocks == 4 * kept
    assert not staying_stats.kv_fetch_fallbacks and not newcomer_stats.kv_fetch_fallbacks


def test_a_draining_replica_takes_no_blocks(own_redis, tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=200, torch_threads=1)

    async def main():
        a = EngineReplica(config, redis_url=own_redis.url, deployment="kvd", identity=("a", None))
        b = EngineReplica(config, redis_url=own_redis.url, deployment="kvd", identity=("b", None))
        for r in (a, b):
            await r._peer_start
        await serve(a, PROMPTS[0])
        b.peer.draining = True  # b is leaving as well: a must find no taker and keep trying until its deadline
        took = await hand_off(a.peer, a._peer_addresses, 100, timeout_s=1.5)
        stats = b.stats()
        a.close()
        b.close()
        return took, stats

    took, stats = asyncio.run(main())
    assert took == 0 and stats.kv_fetched_blocks == 0
