"""Autoscaling the engine deployment by KV pressure instead of request counts.

An LLM replica runs out of KV memory before it runs out of compute: when its pool is full, requests queue
and get preempted and cached prefixes are evicted, while the number of ongoing requests (Ray Serve's
default signal) says little about it: ten requests with long contexts fill a pool that a hundred short
ones do not. Each replica therefore reports its KV demand (``EngineReplica.record_autoscaling_stats``, a
``KVPressure``): blocks pinned by running requests (cached-but-evictable blocks are free capacity, not
demand), blocks its waiting requests' prompts need, its pool size, its queue and its preemptions.
``KVPressurePolicy`` sizes the deployment so that demand sits at ``target_kv_util`` of the pooled capacity.

Ray Serve runs the policy on its controller every control-loop tick and wraps it: a decision must persist
for ``upscale_delay_s`` / ``downscale_delay_s`` before it takes effect, and ``min_replicas`` /
``max_replicas`` bound it. The policy adds a hysteresis band (scale down only once the demand would fit
the smaller deployment at ``target_kv_util * (1 - downscale_band)``) so a steady load near a boundary
does not flap. Scale-down drains: Ray stops routing to the replica at once, waits up to the graceful-
shutdown timeout for its in-flight streams, then its destructor removes its index entries.

Ray pickles this module *by value* into the controller: keep its imports to the standard library and
``kvmesh.core.messages`` (torch-free; the controller imports it by reference, from the same installation
as the replicas).
"""

from __future__ import annotations

import math
from typing import Any

from kvmesh.core.messages import KVPressure

SCALING_POLICIES = ("kv_pressure", "ongoing_requests")
"""``kv_pressure``: ``KVPressurePolicy``; ``ongoing_requests``: Ray Serve's default (the baseline)."""

POLICY_PATH = "kvmesh.cluster.engines.autoscaling:KVPressurePolicy"

DEFAULTS: dict[str, Any] = {
    "metrics_interval_s": 2.0,
    "look_back_period_s": 10.0,
    "upscale_delay_s": 5.0,
    "downscale_delay_s": 60.0,
}
"""kvmesh's defaults for Ray's ``AutoscalingConfig`` fields: react within seconds (replicas take ~10-60 s
to load a model, so a later reaction only adds to the queue), shrink only after a minute of low demand."""


class KVPressurePolicy:
    """Ray Serve custom autoscaling policy (``AutoscalingPolicy(policy_function=POLICY_PATH, policy_kwargs=...)``).

    Returns the replica count that keeps KV demand near ``target_kv_util`` per replica; Ray applies the
    delays and bounds. Demand (blocks) = pinned + needed by waiting prompts + an estimate for requests
    still queued in the routers. Preemptions in the look-back window mean the pools overflowed: at least
    one replica more, whatever the averages say.
    """

    def __init__(self, target_kv_util: float = 0.7, downscale_band: float = 0.2) -> None:
        if not 0.0 < target_kv_util <= 1.0:
            raise ValueError(f"target_kv_util must be in (0, 1], got {target_kv_util}")
        if not 0.0 <= downscale_band < 1.0:
            raise ValueError(f"downscale_band must be in [0, 1), got {downscale_band}")
        self.target_kv_util = target_kv_util
        self.downscale_band = downscale_band

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        current = ctx.target_num_replicas
        reports = KVPressure.per_replica(ctx.aggregated_metrics or {})
        if not reports:  # nothing reported yet (replicas starting): keep the current target
            return current, {"kv_reason": "no reports"}
        capacity = sum(r.kv_total_blocks for r in reports) / len(reports)
        if capacity <= 0:
            return current, {"kv_reason": "no pool size"}
        demand = sum(r.kv_used_blocks + r.kv_waiting_blocks for r in reports)
        requests = sum(r.num_running + r.num_waiting for r in reports)
        queued = float(ctx.total_queued_requests or 0.0)
        if queued > 0:
            demand += queued * (demand / requests if requests > 0 else 1.0)
        preempting = any(r.preemptions > 0 for r in reports)

        per_replica = self.target_kv_util * capacity
        desired = math.ceil(demand / per_replica - 1e-9)
        if preempting:
            desired = max(desired, current + 1)
        if desired <= current:  # shrink only when the demand fits the smaller size with room to spare
            shrunk = math.ceil(demand / (per_replica * (1.0 - self.downscale_band)) - 1e-9)
            desired = shrunk if shrunk < current else current
        desired = max(ctx.capacity_adjusted_min_replicas, min(desired, ctx.capacity_adjusted_max_replicas))
        state = {
            "kv_demand_blocks": round(demand, 1),
            "kv_util": round(demand / (capacity * len(reports)), 3),
            "kv_preempting": preempting,
            "kv_reason": "preemptions" if preempting else "demand",
        }
        return desired, state


def autoscaling_config(
    min_replicas: int,
    max_replicas: int,
    initial_replicas: int,
    policy: str = "kv_pressure",
    target_kv_util: float = 0.7,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The engine deployment's Ray ``autoscaling_config``: kvmesh's defaults, then ``overrides`` (any Ray
    ``AutoscalingConfig`` field, e.g. ``downscale_delay_s`` or, for the baseline, ``target_ongoing_requests``)."""
    if policy not in SCALING_POLICIES:
        raise ValueError(f"unknown scaling policy {policy!r}; choose from {list(SCALING_POLICIES)}")
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {min_replicas}, {max_replicas}")
    KVPressurePolicy(target_kv_util)  # validates
    config: dict[str, Any] = {
        **DEFAULTS,
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "initial_replicas": max(min_replicas, min(initial_replicas, max_replicas)),
        **(overrides or {}),
    }
    if policy == "kv_pressure":
        config["policy"] = {"policy_function": POLICY_PATH, "policy_kwargs": {"target_kv_util": target_kv_util}}
    from ray.serve.config import AutoscalingConfig  # checks every field and value now, not at deploy time

    unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ValueError(f"autoscaling: unknown settings {unknown}; known: {sorted(AutoscalingConfig.model_fields)}")
    try:
        AutoscalingConfig(**config)
    except Exception as exc:  # pydantic's ValidationError: show it as a settings error
        raise ValueError(f"autoscaling: {exc}") from None
    return config
