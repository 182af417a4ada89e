"""The engine deployment's request router, for kvmesh's engines and external workers alike (torch-free: a
worker proxy's process never loads the engine)."""

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
