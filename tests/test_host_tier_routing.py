"""Integration: real Ray Serve, real Redis, 2 replicas of a tiny model with small device pools and host tiers.

A conversation whose history its replica evicted from the device into the host tier goes back to that
replica and is served from the tier: the index tells the router which replica's host tier holds it.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvmesh.cluster.engines.engine_deployment import engine_deployment
from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.replica import EngineConfig, LLMEngine
from kvmesh.router.prefix_index import PrefixIndex
from tests.serve_helpers import greedy_call

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

DEVICE_BLOCKS = 48
HISTORY = 600


@pytest.fixture(scope="module")
def tiered(ray_serve, redis_server, tiny_llama_dir):
    model = str(tiny_llama_dir)
    per_block = LLMEngine(EngineConfig(model=model, num_kv_blocks=1, swap_space_bytes=0)).bytes_per_block
    engine = {
        "model": model,
        "num_kv_blocks": DEVICE_BLOCKS,
        "host_cache_bytes": 512 * per_block,
        "torch_threads": 1,
        "max_num_seqs": 4,
    }
    routing = RoutingSettings(redis_url=redis_server.url, deployment="ht", stats_period_s=0.5)
    app = engine_deployment(EngineConfig(**engine), routing, num_replicas=2)
    handle = ray_serve.run(app, name="host-tier-it", route_prefix=None)
    time.sleep(1.5)  # first load reports reach the router
    yield handle.options(method_name="generate", stream=True), model, redis_server.url
    ray_serve.delete("host-tier-it")


async def call(handle, model, tokens, max_tokens=8):
    reply, cached, replica = [], 0, None
    async for chunk in handle.remote(greedy_call(model, tokens, max_tokens)):
        reply += chunk.token_ids
        cached, replica = chunk.num_cached_tokens, chunk.replica
    return reply, cached, replica


def test_a_history_evicted_to_the_host_tier_is_routed_home_and_loaded(tiered):
    handle, model, url = tiered

    async def main():
        index = PrefixIndex(url, "ht", model, timeout_s=1.0)
        try:
            results = []
            for c in range(3):
                history = list(range(10_000 * (c + 1), 10_000 * (c + 1) + HISTORY))
                reply, _, home = await call(handle, model, history)
                history += reply
                # Unrelated prompts, two at a time (the router sends the second where the first is not),
                # until the index shows the history gone from its replica's device into its host tier.
                answer = None
                for f in range(10):
                    fillers = [random.Random(100 * c + 2 * f + k).choices(range(1_000, 49_000), k=500) for k in (0, 1)]
                    await asyncio.gather(*(call(handle, model, filler, max_tokens=2) for filler in fillers))
                    await asyncio.sleep(0.3)  # the replica's KV events reach Redis
                    answer = await index.query(greedy_call(model, history, 1).block_hashes, [home])
                    if answer.device_hits.get(home, 0) < 8 and answer.host_hits.get(home, 0) >= 20:
                        break
                else:
                    pytest.fail(f"history not evicted to the host tier: {answer}")
                # Load reports taken while the fillers ran show pinned pools and decode lifetimes that, on
                # cores another process shares, can outprice the history's reload: let idle ones replace them.
                await asyncio.sleep(1.0)
                _, cached, replica = await call(handle, model, history + list(range(900, 920)))
                results.append((home, replica, cached))
            return results
        finally:
            await index.close()

    for home, replica, cached in asyncio.run(main()):
        assert replica == home, f"the follow-up left the replica whose host tier holds its history: {replica}"
        assert cached >= 512, f"the history was not loaded from the host tier: {cached} cached tokens"
