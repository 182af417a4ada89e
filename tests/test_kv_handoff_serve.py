"""Integration: real Ray Serve, real Redis, engine replicas that keep the fleet's KV across scaling.

A replica that starts pulls its peers' hottest blocks before it serves, so after a redeploy the index shows
the new replicas holding the prefixes the old ones computed before any request reached them.
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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

APP = "kv-handoff-it"


def prompts(base: int, n: int) -> list[list[int]]:
    return [list(range(base + 1000 * i, base + 1000 * i + 400)) for i in range(n)]


async def serve_all(handle, model, batch):
    async def one(tokens):
        replica = None
        async for chunk in handle.options(method_name="generate", stream=True).remote(greedy_call(model, tokens, 2)):
            replica = chunk.replica
        return replica

    return await asyncio.gather(*(one(t) for t in batch))


async def holders(url, model, batch) -> tuple[dict[str, int], list[dict[str, int]]]:
    """Every live replica's id with its index entries, and per prompt each replica's leading blocks held."""
    index = PrefixIndex(url, "kvh", model, timeout_s=2.0)
    try:
        reports = await index.replica_reports()
        ids = list(reports)
        answers = [await index.lookup(greedy_call(model, t, 1).block_hashes, ids) for t in batch]
        return {rid: r.index_entries for rid, r in reports.items()}, answers
    finally:
        await index.close()


def test_a_redeployed_fleet_starts_warm_from_the_replicas_it_replaces(ray_serve, redis_server, tiny_llama_dir):
    """Serve replaces every replica on a redeploy (here 1 -> 2): the new replicas start while the old one
    drains and pull its hottest blocks (or it hands them over), so the prompts computed before are held by
    the new fleet before any request reaches it."""
    model = str(tiny_llama_dir)
    engine = EngineConfig(model=model, num_kv_blocks=600, torch_threads=1, max_num_seqs=4)
    routing = RoutingSettings(redis_url=redis_server.url, deployment="kvh", stats_period_s=0.3)

    def deploy(n: int):
        app = engine_deployment(engine, routing, num_replicas=n, replicas_per_node=2)
        return ray_serve.run(app, name=APP, route_prefix=None)

    hot = prompts(10_000, 3)
    try:
        handle = deploy(1)
        time.sleep(1.0)
        asyncio.run(serve_all(handle, model, hot))
        time.sleep(1.5)  # its events and status reach Redis
        old = set(asyncio.run(holders(redis_server.url, model, []))[0])
        deploy(2)
        time.sleep(4.0)  # the old replica is gone, the new ones have announced what they adopted
        live, answers = asyncio.run(holders(redis_server.url, model, hot))
        assert len(live) == 2 and not set(live) & old, (old, live)
        for tokens, answer in zip(hot, answers, strict=True):
            assert max(answer.values()) >= len(tokens) // 16, answers
    finally:
        ray_serve.delete(APP)
