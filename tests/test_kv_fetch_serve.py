"""Integration: real Ray Serve, real Redis, 2 engine replicas serving their KV blocks to each other.

A long prefix is computed on one replica; a burst of long generations continuing it arrives, more than the
holder's batch holds. The router spreads the burst, and the requests it sends to the replica that lacks the
prefix pull it from the holder instead of recomputing it: they are served from cache there, with the tokens
a local computation gives, and the replica's status counts the blocks fetched and the holder's the blocks
served.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh.cluster.engines.engine_deployment import engine_deployment
from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.replica import EngineConfig
from kvmesh.router.prefix_index import PrefixIndex
from tests.serve_helpers import greedy_call

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PREFIX = list(range(20_000, 20_000 + 900))
LONG = 120
"""Output tokens per request of the burst: two fill the holder's batch (``max_num_seqs`` 2) for a while."""


@pytest.fixture(scope="module")
def pair(ray_serve, redis_server, tiny_llama_dir):
    model = str(tiny_llama_dir)
    engine = EngineConfig(model=model, num_kv_blocks=400, torch_threads=1, max_num_seqs=2)
    routing = RoutingSettings(redis_url=redis_server.url, deployment="kvf", stats_period_s=0.3)
    app = engine_deployment(engine, routing, num_replicas=2)
    handle = ray_serve.run(app, name="kv-fetch-it", route_prefix=None)
    time.sleep(1.5)  # first load reports (with each replica's KV address and probed rate) reach the router
    yield handle, model, redis_server.url
    ray_serve.delete("kv-fetch-it")


async def call(handle, model, tokens, max_tokens=4):
    reply, cached, replica = [], 0, None
    async for chunk in handle.options(method_name="generate", stream=True).remote(
        greedy_call(model, tokens, max_tokens)
    ):
        reply += chunk.token_ids
        cached, replica = chunk.num_cached_tokens, chunk.replica
    return reply, cached, replica


def test_requests_moved_for_balance_fetch_the_prefix_from_its_holder(pair):
    handle, model, url = pair
    suffixes = [list(range(30_000 + 40 * i, 30_000 + 40 * i + 24)) for i in range(4)]

    async def main():
        _, _, holder = await call(handle, model, PREFIX)
        await asyncio.sleep(0.8)  # the holder's KV events reach the index
        burst = await asyncio.gather(*(call(handle, model, PREFIX + s, max_tokens=LONG) for s in suffixes))
        alone = [await call(handle, model, PREFIX + s, max_tokens=LONG) for s in suffixes]
        await asyncio.sleep(1.5)  # statuses go to Redis with the heartbeats
        index = PrefixIndex(url, "kvf", model, timeout_s=1.0)
        try:
            reports = await index.replica_reports()
        finally:
            await index.close()
        return holder, burst, alone, reports

    holder, burst, alone, reports = asyncio.run(main())
    moved = [(i, cached) for i, (_, cached, replica) in enumerate(burst) if replica != holder]
    assert moved, "the burst all queued on the prefix's holder"
    for i, cached in moved:
        assert cached >= len(PREFIX) - 16, f"request {i} recomputed the prefix off its holder ({cached} cached)"
    assert [tokens for tokens, _, _ in burst] == [tokens for tokens, _, _ in alone]
    other = next(rid for rid in reports if rid != holder)
    assert reports[other].kv_fetched_blocks >= (len(PREFIX) - 1) // 16, reports[other]
    assert reports[holder].kv_served_blocks == reports[other].kv_fetched_blocks
    assert not reports[other].kv_fetch_fallbacks
