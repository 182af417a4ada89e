"""Integration: KV-pressure autoscaling on real Ray Serve with a real Redis index and a tiny model.

A load that fills the KV pools scales the engine deployment from 1 replica to at least 3; a light load then
lets it drain back to 1 while requests keep flowing. Every request of the run must succeed, and the index
must hold nothing of the removed replicas afterwards.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
import redis

from kvmesh.cluster.engines.autoscaling import autoscaling_config
from kvmesh.cluster.engines.engine_deployment import engine_deployment
from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.core.engine_config import EngineConfig
from kvmesh.router.index_schema import index_prefix
from tests.serve_helpers import greedy_call

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

APP, INDEX = "autoscale-it", "autoscale-it"
POOL_BLOCKS = 64


def running_replicas(serve) -> int:
    app = serve.status().applications.get(APP)
    if app is None or "engine" not in app.deployments:
        return 0
    states = app.deployments["engine"].replica_states
    return sum(v for k, v in states.items() if str(getattr(k, "value", k)).upper() == "RUNNING")


async def call(handle, model: str, tokens: list[int], max_tokens: int) -> tuple[int, str]:
    request = greedy_call(model, tokens, max_tokens)
    produced, replica = 0, ""
    async for chunk in handle.remote(request):
        produced += len(chunk.token_ids)
        replica = chunk.replica
    return produced, replica


async def load(handle, model, workers, prompt_len, max_tokens, until, results, seed) -> None:
    """Closed loop: ``workers`` clients each send distinct prompts back to back until ``until()``."""

    async def client(w: int) -> None:
        i = 0
        while not until():
            tokens = [(seed + 7919 * w + 104729 * i + k) % 40000 + 100 for k in range(prompt_len)]
            t0 = time.monotonic()
            try:
                produced, replica = await call(handle, model, tokens, max_tokens)
                results.append(("ok" if produced == max_tokens else f"short {produced}", replica, t0))
            except Exception as exc:
                results.append((repr(exc), "", t0))
            i += 1

    await asyncio.gather(*(client(w) for w in range(workers)))


def test_kv_pressure_scales_out_and_drains_back_without_losing_requests(ray_serve, redis_server, tiny_llama_dir):
    model = str(tiny_llama_dir)
    engine = {"model": model, "num_kv_blocks": POOL_BLOCKS, "torch_threads": 1, "max_num_seqs": 8}
    scaling = autoscaling_config(
        1,
        4,
        1,
        target_kv_util=0.5,
        overrides={
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2.0,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 4.0,
        },
    )
    routing = RoutingSettings(redis_url=redis_server.url, deployment=INDEX, stats_period_s=0.5)
    app = engine_deployment(EngineConfig(**engine), routing, autoscaling=scaling, drain_timeout_s=30)
    handle = ray_serve.run(app, name=APP, route_prefix=None).options(method_name="generate", stream=True)
    try:
        assert running_replicas(ray_serve) == 1
        heavy, light, timeline = [], [], []

        async def scenario() -> None:
            t0 = time.monotonic()
            peak = 0

            def scaled_out() -> bool:  # >= 3 replicas and >= 3 of them served, or give up after 120 s
                served = {r for s, r, t in heavy[-24:] if s == "ok"}
                return (peak >= 3 and len(served) >= 3) or time.monotonic() - t0 > 120

            async def watch(stop) -> None:
                nonlocal peak
                while not stop():
                    n = running_replicas(ray_serve)
                    peak = max(peak, n)
                    timeline.append((round(time.monotonic() - t0, 1), n))
                    await asyncio.sleep(0.25)

            # 16 clients with 200-token prompts: ~13 blocks each, 200+ blocks of demand on 64-block pools.
            await asyncio.gather(load(handle, model, 16, 200, 32, scaled_out, heavy, 1), watch(scaled_out))
            assert peak >= 3, f"did not scale out: {timeline}"

            def scaled_in() -> bool:
                return (running_replicas(ray_serve) == 1 and len(light) >= 10) or time.monotonic() - t0 > 240

            # Light traffic keeps flowing while the deployment shrinks: streams on removed replicas must finish.
            await asyncio.gather(load(handle, model, 2, 24, 48, scaled_in, light, 2), watch(scaled_in))

        asyncio.run(scenario())
        outcomes = Counter(s for s, _, _ in heavy + light)
        assert set(outcomes) == {"ok"}, f"failed or short requests: {outcomes}"
        assert running_replicas(ray_serve) == 1, f"did not scale back in: {timeline[-10:]}"
        served_heavy = Counter(r for _, r, _ in heavy)
        assert len(served_heavy) >= 3, f"new replicas did not serve traffic: {served_heavy}"

        # Nothing of the removed replicas is left in the index: one registered replica, and every block
        # entry names only its slot.
        client = redis.Redis.from_url(redis_server.url)
        prefix = index_prefix(INDEX, model)
        deadline = time.monotonic() + 30  # destructors of drained replicas may still be purging
        while time.monotonic() < deadline and client.hlen(prefix + "reg") > 1:
            time.sleep(0.5)
        registered = client.hgetall(prefix + "reg")
        assert len(registered) == 1, f"removed replicas still registered: {list(registered)}"
        live_slot = next(iter(registered.values()))
        stale = set()
        for key in client.scan_iter(match=(prefix + "b:*").encode(), count=1000):
            for value in client.hvals(key):
                stale |= {value[i : i + 4] for i in range(0, len(value), 4)} - {live_slot}
        assert not stale, f"index entries of removed replicas remain (slots {stale})"
        assert not client.hlen(prefix + "pending")
        client.close()
    finally:
        ray_serve.delete(APP)
