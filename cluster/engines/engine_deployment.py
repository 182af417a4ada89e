"""The engine deployment: Ray Serve replicas of ``EngineReplica`` (``cluster/engines/engine_replica.py``), each one
paged KV engine and its index publisher, with the KV-aware router (``router/serve_router.py``) on the
deployment's handle. Callers pass one ``GenerateCall`` per request (``generate.remote(call)``) and get a stream
of ``GenerateChunk`` back.
"""

from __future__ import annotations

from ray import serve

from kvmesh.cluster.engines.engine_replica import EngineReplica
from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.kv_event_wire import KVEventsConfig


def engine_deployment(
    engine: EngineConfig,
    routing: RoutingSettings,
    *,
    num_replicas: int = 1,
    ray_actor_options: dict | None = None,
    autoscaling: dict | None = None,
    drain_timeout_s: float = 60.0,
    replicas_per_node: int | None = None,
    kv_events: KVEventsConfig | None = None,
    prefill_replicas: int = 0,
    keep_kv: bool = True,
) -> serve.Application:
    """The engine deployment with the KV-aware router (or a baseline policy) on its handles; ``engine`` and
    ``kv_events`` reach every replica as themselves.

    ``autoscaling`` (from ``kvmesh.cluster.engines.autoscaling.autoscaling_config``) replaces the fixed
    ``num_replicas``. A replica being removed (scale-down, redeploy, shutdown) gets ``drain_timeout_s`` to
    finish its streams: Ray stops routing to it at once and waits for them before its destructor clears its
    index entries. ``replicas_per_node`` (default: all of them on one node) sizes each CPU replica's threads
    on its node. ``kv_events``: vLLM's ``--kv-events-config``; each replica publishes on the ports plus its rank.
    ``prefill_replicas``: the replicas of the lowest ranks that only prefill for others (``role="prefill"``).
    ``keep_kv``: replicas start warm from their peers' hottest blocks and hand theirs over when removed.
    """
    sizing = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": num_replicas}
    per_node = replicas_per_node or max(num_replicas, (autoscaling or {}).get("max_replicas", 0))
    return serve.deployment(
        EngineReplica,
        **routing.deployment_options(engine.model, drain_timeout_s=drain_timeout_s),
        **sizing,
        ray_actor_options=ray_actor_options or {"num_cpus": 0},
    ).bind(
        engine,
        redis_url=routing.redis_url,
        deployment=routing.deployment,
        replicas_per_node=per_node,
        kv_events=kv_events,
        prefill_replicas=prefill_replicas,
        keep_kv=keep_kv,
    )
