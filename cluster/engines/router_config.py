"""How the engine deployment is routed and bounded (``RoutingSettings``), whatever its replicas are: kvmesh's
engines, external workers' proxies, or both mixed. Torch-free: a worker proxy's process never loads the engine.
Ray-free at import: ``ClusterConfig`` holds one, and ``kvmesh serve`` must set Ray's environment before Ray is
first imported (``cluster/launch/launcher.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import RequestRouterConfig

ROUTER_CLASS = "kvmesh.router.serve_router:KVAwareRequestRouter"
RAY_POW2_CLASS = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
"""``policy="pow2"`` deploys Ray Serve's own default router, the baseline users would otherwise get."""


@dataclass(frozen=True, kw_only=True)
class RoutingSettings:
    """The engine deployment's router and queue bounds (``ClusterConfig.routing()`` builds it)."""

    redis_url: str | None = None
    """The index's Redis; None: every process reads ``$KVMESH_REDIS_URL``, so the password never travels in
    deployment arguments."""
    deployment: str = "kvmesh"
    """The index namespace the replicas publish under and the routers read."""
    policy: str = "kv_aware"
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    stats_period_s: float = 1.0
    """How often each replica reports its load to the routers."""
    max_ongoing_requests: int = 64
    """Requests one replica accepts at once; more wait in the router's queue."""
    max_queued_requests: int = -1
    """Requests each router may hold waiting for a replica (-1: no bound)."""

    def router_config(self, model_id: str) -> RequestRouterConfig:
        """kvmesh's KV-aware router (or a baseline policy) for ``model_id``, or Ray's own for ``pow2``."""
        from ray.serve.config import RequestRouterConfig

        kwargs = {
            "redis_url": self.redis_url,
            "deployment": self.deployment,
            "model": model_id,
            "policy": self.policy,
            "policy_kwargs": dict(self.policy_kwargs),
            "report_period_s": self.stats_period_s,
        }
        ray_pow2 = self.policy == "pow2"
        return RequestRouterConfig(
            request_router_class=RAY_POW2_CLASS if ray_pow2 else ROUTER_CLASS,
            request_router_kwargs={} if ray_pow2 else kwargs,
            request_routing_stats_period_s=self.stats_period_s,
            request_routing_stats_timeout_s=max(self.stats_period_s, 1.0),
        )

    def deployment_options(self, model_id: str, drain_timeout_s: float | None = None) -> dict[str, Any]:
        """``serve.deployment`` options of the engine deployment: its name, its router, its queue bounds and
        health-check period; with ``drain_timeout_s``, how long a removed replica may finish its streams (Ray
        stops routing to it at once)."""
        options = {
            "name": "engine",
            "request_router_config": self.router_config(model_id),
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "health_check_period_s": 2.0,
        }
        if drain_timeout_s is not None:
            options |= {"graceful_shutdown_timeout_s": drain_timeout_s, "graceful_shutdown_wait_loop_s": 0.5}
        return options
