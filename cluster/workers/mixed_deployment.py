"""External workers and kvmesh's own engines in one engine deployment, behind one router.

``kvmesh serve`` with ``workers:`` and ``replicas: N`` deploys ``len(workers) + N`` replicas of ``MixedReplica``:
the first ``len(workers)`` ranks each stand for a worker (a ``WorkerProxy``), the others each run a kvmesh
engine. The KV-aware router sees one deployment and prices every replica the same way, from the index (fed by
the workers' KV events and the engines' own publishers) and each one's ``LoadReport``.

A Ray Serve deployment gives every replica the same actor options, so the replicas themselves claim nothing
(``num_cpus: 0``, as a proxy needs) and an engine's replica runs its engine in a Ray actor it owns
(``OwnedEngine``), placed by the engines' own actor options (a GPU, a node's cores, a custom resource). The
deployment has a fixed size: ranks decide roles, so it does not autoscale.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.cluster.hosting.nodes import replica_rank
from kvmesh.cluster.workers.worker_proxy import HEALTH_TIMEOUT_S, WorkerProxy
from kvmesh.cluster.workers.worker_spec import WorkerSpec
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.kv_event_wire import KVEventsConfig
from kvmesh.core.messages import GenerateCall, GenerateChunk

log = logging.getLogger(__name__)

START_REPORT_S = 30.0
"""How often a replica waiting for its engine actor to start says so (in its log)."""
CLOSE_TIMEOUT_S = 30.0
"""How long a removed replica waits for its engine actor to leave the index before killing it."""


@dataclass(frozen=True, kw_only=True)
class OwnedEngines:
    """kvmesh's engines of a mixed deployment: each runs ``engine`` in a Ray actor started with
    ``actor_options`` (the replicas themselves claim nothing)."""

    engine: EngineConfig
    actor_options: dict[str, Any]
    replicas_per_node: int = 1
    """Engines that may share one node's cores (each CPU engine takes its share)."""
    kv_events: KVEventsConfig | None = None


class OwnedEngine:
    """A kvmesh engine (``EngineReplica``) in a Ray actor this replica owns, started with ``actor_options``,
    under this replica's Serve identity (the router matches the engine's index entries and load reports to
    it); Ray ends the actor with its owner. Calls and streams are relayed, a chunk per object."""

    def __init__(self, engines: OwnedEngines, routing: RoutingSettings, rank_offset: int) -> None:
        from kvmesh.cluster.engines.engine_replica import EngineReplica  # here, so a worker's proxy never loads torch

        context = serve.get_replica_context()
        identity = (context.replica_id.unique_id, context.rank)
        actor = ray.remote(EngineReplica).options(**engines.actor_options)
        self.actor = actor.remote(
            engines.engine,
            redis_url=routing.redis_url,
            deployment=routing.deployment,
            replicas_per_node=engines.replicas_per_node,
            kv_events=engines.kv_events,
            rank_offset=rank_offset,
            identity=identity,
        )
        claims = {k: v for k, v in engines.actor_options.items() if k != "runtime_env"}  # its env: the index password
        started, t0 = self.actor.status.remote(), time.monotonic()
        while not ray.wait([started], timeout=START_REPORT_S)[0]:  # a GPU node may be on its way, a model loading
            log.warning(
                "engine actor of replica %s not ready after %.0f s (waiting for a node with %s, or loading its model)",
                identity[0],
                time.monotonic() - t0,
                claims,
            )
        ray.get(started)  # raises the engine's own start error (IndexUnreachable, ...)

    async def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        stream = self.actor.generate.options(num_returns="streaming").remote(call)
        finished = False
        try:
            async for ref in stream:
                yield await ref
            finished = True
        finally:
            if not finished:  # the caller left (or the engine failed): the engine aborts the request. Ray
                ray.cancel(stream)  # does so too when it cancels the Serve call this one runs under, not otherwise

    async def check_health(self) -> None:
        """The engine actor answers (a lost actor raises ``RayActorError``, and Ray replaces this replica)."""
        await self.actor.status.remote()

    async def record_routing_stats(self) -> dict:
        return await self.actor.record_routing_stats.remote()

    def close(self) -> None:
        """Let the engine leave the index, then end its actor (its owner's exit would end it anyway)."""
        actor, self.actor = getattr(self, "actor", None), None
        if actor is None:
            return
        with contextlib.suppress(ray.exceptions.RayError):  # gone or stuck: its entries expire with its heartbeats
            ray.get(actor.close.remote(), timeout=CLOSE_TIMEOUT_S)
        ray.kill(actor)


class MixedReplica:
    """A worker's proxy or a kvmesh engine, by this replica's rank; Ray Serve's calls go to the one it is."""

    def __init__(
        self, workers: list[WorkerSpec], served_name: str, routing: RoutingSettings, engines: OwnedEngines
    ) -> None:
        rank = replica_rank(serve.get_replica_context().rank)
        if rank < len(workers):
            engine = engines.engine
            args = (engine.model, served_name, engine.block_size, routing.redis_url, routing.deployment)
            self.role: WorkerProxy | OwnedEngine = WorkerProxy(workers, *args)
        else:
            self.role = OwnedEngine(engines, routing, rank_offset=len(workers))

    async def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        async for chunk in self.role.generate(call):
            yield chunk

    async def check_health(self) -> None:
        await self.role.check_health()

    async def record_routing_stats(self) -> dict:
        if isinstance(self.role, OwnedEngine):
            return await self.role.record_routing_stats()
        return self.role.record_routing_stats()

    def __del__(self) -> None:
        if getattr(self, "role", None) is not None:
            self.role.close()


def mixed_deployment(
    workers: list[WorkerSpec],
    served_name: str,
    routing: RoutingSettings,
    engines: OwnedEngines,
    num_engines: int,
    ray_actor_options: dict | None = None,
    drain_timeout_s: float = 60.0,
) -> serve.Application:
    """The engine deployment over ``workers`` and ``num_engines`` kvmesh engines (``engines``), behind the router
    ``routing`` sets; ``ray_actor_options``: the replicas' own, which claim no resource (default
    ``num_cpus: 0``; an environment may be added)."""
    return serve.deployment(
        MixedReplica,
        **routing.deployment_options(engines.engine.model, drain_timeout_s=drain_timeout_s),
        num_replicas=len(workers) + num_engines,
        ray_actor_options=ray_actor_options or {"num_cpus": 0},
        health_check_timeout_s=HEALTH_TIMEOUT_S * 2,
    ).bind(workers, served_name, routing, engines)
