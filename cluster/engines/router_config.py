"""The engine deployment's request router and the options every kind of that deployment shares (kvmesh's
engines, external workers' proxies, both mixed); torch-free: a worker proxy's process never loads the engine."""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig

ROUTER_CLASS = "kvmesh.router.serve_router:KVAwareRequestRouter"
RAY_POW2_CLASS = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
"""``policy="pow2"`` deploys Ray Serve's own default router, the baseline users would otherwise get."""


def router_config(
    policy: str,
    redis_url: str | None,
    deployment: str,
    model_id: str,
    policy_kwargs: dict | None = None,
    stats_period_s: float = 1.0,
) -> RequestRouterConfig:
    """The engine deployment's router: kvmesh's KV-aware router (or a baseline policy), or Ray's own for pow2."""
    ray_pow2 = policy == "pow2"
    return RequestRouterConfig(
        request_router_class=RAY_POW2_CLASS if ray_pow2 else ROUTER_CLASS,
        request_router_kwargs={}
        if ray_pow2
        else {
            "redis_url": redis_url,
            "deployment": deployment,
            "model": model_id,
            "policy": policy,
            "policy_kwargs": policy_kwargs or {},
            "report_period_s": stats_period_s,
        },
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=max(stats_period_s, 1.0),
    )


def engine_deployment_options(
    model_id: str,
    redis_url: str | None,
    deployment: str,
    policy: str,
    policy_kwargs: dict | None,
    stats_period_s: float,
    max_ongoing_requests: int,
    max_queued_requests: int,
    drain_timeout_s: float | None = None,
) -> dict:
    """``serve.deployment`` options of the engine deployment, whatever its replicas are: its name, its router,
    its queue bounds and health-check period; with ``drain_timeout_s``, how long a removed replica may finish
    its streams (Ray stops routing to it at once)."""
    options = {
        "name": "engine",
        "request_router_config": router_config(policy, redis_url, deployment, model_id, policy_kwargs, stats_period_s),
        "max_ongoing_requests": max_ongoing_requests,
        "max_queued_requests": max_queued_requests,
        "health_check_period_s": 2.0,
    }
    if drain_timeout_s is not None:
        options |= {"graceful_shutdown_timeout_s": drain_timeout_s, "graceful_shutdown_wait_loop_s": 0.5}
    return options
