"""External workers and kvmesh's own engines in one engine deployment, behind one router.

``kvmesh serve`` with ``workers:`` and ``replicas: N`` deploys ``len(workers) + N`` replicas of ``MixedReplica``:
the first ``len(workers)`` ranks each stand for a worker (a ``WorkerProxy``), the others each run a kvmesh
engine (an ``EngineReplica``). The KV-aware router sees one deployment and prices every replica the same way,
from the index (fed by the workers' KV events and the engines' own publishers) and each one's ``LoadReport``.

A Ray Serve deployment gives every replica the same actor options, so the engines' options must claim no GPU
or other resource a proxy would then hold too (``ClusterConfig`` refuses it), and the deployment has a fixed
size: ranks decide roles, so it does not autoscale.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from kvmesh.cluster.engine_replica import EngineReplica
from kvmesh.cluster.nodes import replica_rank
from kvmesh.cluster.router_config import engine_deployment_options
from kvmesh.cluster.worker_proxy import HEALTH_TIMEOUT_S, WorkerProxy
from kvmesh.shared.messages import GenerateCall, GenerateChunk


class MixedReplica:
    """A worker's proxy or a kvmesh engine, by this replica's rank; Ray Serve's calls go to the one it is."""

    def __init__(self, workers: list[dict], proxy: dict, engine: dict) -> None:
        rank = replica_rank(serve.get_replica_context().rank)
        if rank < len(workers):
            self.role: WorkerProxy | EngineReplica = WorkerProxy(workers, **proxy)
        else:
            self.role = EngineReplica(**engine, rank_offset=len(workers))

    async def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        async for chunk in self.role.generate(call):
            yield chunk

    async def check_health(self) -> None:
        """A worker's proxy checks its worker (``WorkerProxy.check_health``); an engine is alive if it answers."""
        if isinstance(self.role, WorkerProxy):
            await self.role.check_health()

    def record_routing_stats(self) -> dict:
        return self.role.record_routing_stats()

    def __del__(self) -> None:
        if getattr(self, "role", None) is not None:
            self.role.__del__()


def mixed_deployment(
    workers: list[dict],
    proxy: dict,
    engine: dict,
    num_engines: int,
    routing: dict,
    ray_actor_options: dict,
    drain_timeout_s: float = 60.0,
) -> serve.Application:
    """The engine deployment over ``workers`` (``proxy``: ``WorkerProxy``'s other arguments) and ``num_engines``
    kvmesh engines (``engine``: ``EngineReplica``'s arguments); ``routing`` as ``engine_deployment`` takes it."""
    return serve.deployment(
        MixedReplica,
        **engine_deployment_options(proxy["model"], **routing, drain_timeout_s=drain_timeout_s),
        num_replicas=len(workers) + num_engines,
        ray_actor_options=ray_actor_options,
        health_check_timeout_s=HEALTH_TIMEOUT_S * 2,
    ).bind(workers, proxy, engine)
