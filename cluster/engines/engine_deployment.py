"""The engine deployment: Ray Serve replicas of ``EngineReplica`` (``kvmesh/cluster/engine_replica.py``), each one
paged KV engine and its index publisher, with the KV-aware router (``kvmesh/router/serve_router.py``) on the
deployment's handle. Callers pass one ``GenerateCall`` per request (``generate.remote(call)``) and get a stream
of ``GenerateChunk`` back.
"""

from __future__ import annotations

from ray import serve

from kvmesh.cluster.engine_replica import EngineReplica
from kvmesh.cluster.router_config import engine_deployment_options
from kvmesh.replica import EngineConfig


def engine_deployment(
    engine: dict,
    num_replicas: int = 1,
    redis_url: str | None = None,
    deployment: str = "kvmesh",
    policy: str = "kv_aware",
    policy_kwargs: dict | None = None,
    stats_period_s: float = 1.0,
    max_ongoing_requests: int = 64,
    max_queued_requests: int = -1,
    ray_actor_options: dict | None = None,
    autoscaling: dict | None = None,
    drain_timeout_s: float = 60.0,
    replicas_per_node: int | None = None,
    kv_events: dict | None = None,
) -> serve.Application:
    """The engine deployment with the KV-aware router (or a baseline policy) on its handles.

    ``redis_url`` None: replicas and routers read ``$KVMESH_REDIS_URL`` from their environment, so the
    password is not part of the deployment's arguments (no index if that is unset too).

    ``autoscaling`` (from ``kvmesh.cluster.autoscaling.autoscaling_config``) replaces the fixed ``num_replicas``.
    A replica being removed (scale-down, redeploy, shutdown) gets ``drain_timeout_s`` to finish its streams:
    Ray stops routing to it at once and waits for them before its destructor clears its index entries.
    ``replicas_per_node`` (default: all of them on one node) sizes each CPU replica's threads on its node.
    ``kv_events``: vLLM's ``--kv-events-config`` keys; each replica publishes on the ports plus its rank.
    """
    model_id = EngineConfig(**engine).model
    routing = (redis_url, deployment, policy, policy_kwargs, stats_period_s, max_ongoing_requests, max_queued_requests)
    sizing = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": num_replicas}
    return serve.deployment(
        EngineReplica,
        **engine_deployment_options(model_id, *routing, drain_timeout_s=drain_timeout_s),
        **sizing,
        ray_actor_options=ray_actor_options or {"num_cpus": 0},
    ).bind(
        engine,
        redis_url,
        deployment,
        replicas_per_node or max(num_replicas, (autoscaling or {}).get("max_replicas", 0)),
        kv_events,
    )
