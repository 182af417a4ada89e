"""The KV-pressure autoscaling policy on synthetic metric histories, run the way Ray Serve runs it: wrapped by
Ray's own delay and bounds logic (``_apply_autoscaling_config``) and ticked like the controller, on a
simulated clock."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import ray.serve.autoscaling_policy as ray_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from kvmesh.cluster.engines.autoscaling import KVPressurePolicy, autoscaling_config
from kvmesh.core.messages import KVPressure

POOL = 100  # blocks per replica


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def time(self) -> float:
        return self.now


def metrics(n: int, demand: float, waiting: float = 0.0, preemptions: float = 0.0) -> dict:
    """The reports of ``n`` replicas sharing ``demand`` pinned blocks evenly, as Ray hands them to the policy:
    each replica's ``KVPressure.as_dict()`` regrouped field -> replica -> value."""
    report = KVPressure(
        kv_used_blocks=demand / n,
        kv_waiting_blocks=waiting / n,
        kv_total_blocks=POOL,
        num_running=4,
        num_waiting=0,
        preemptions=preemptions,
    ).as_dict()
    return {name: {f"r{i}": value for i in range(n)} for name, value in report.items()}


def run(
    policy: KVPressurePolicy,
    load: Callable[[float, int], dict],
    seconds: float,
    start: int = 1,
    min_replicas: int = 1,
    max_replicas: int = 4,
    queued: float = 0.0,
    monkeypatch=None,
    **delays,
) -> list[tuple[float, int]]:
    """Tick the wrapped policy every 0.5 s of simulated time like the controller; new replicas are up at
    once. Returns (elapsed seconds, target replicas) after each tick."""
    clock = Clock()
    monkeypatch.setattr(ray_policy, "time", clock)
    delays = {"upscale_delay_s": 5, "downscale_delay_s": 60, **delays}
    config = AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas, **delays)
    decide = ray_policy._apply_autoscaling_config(policy)
    target, state, history, t0 = start, {}, [], clock.now
    while clock.now - t0 < seconds:
        ctx = AutoscalingContext(
            deployment_id=None,
            deployment_name="engine",
            app_name="kvmesh",
            current_num_replicas=target,
            target_num_replicas=target,
            running_replicas=[],
            total_num_requests=0.0,
            total_queued_requests=queued,
            aggregated_metrics=load(clock.now - t0, target),
            raw_metrics={},
            capacity_adjusted_min_replicas=min_replicas,
            capacity_adjusted_max_replicas=max_replicas,
            policy_state=state,
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=clock.now,
            config=config,
        )
        decision, state = decide(ctx)
        target = max(min_replicas, min(max_replicas, decision))  # Ray's apply_bounds
        history.append((clock.now - t0, target))
        clock.now += 0.5
    return history


def first_change(history: list[tuple[float, int]], start: int) -> tuple[float, int] | None:
    return next(((t, n) for t, n in history if n != start), None)


def test_scales_up_on_pressure_after_the_upscale_delay(monkeypatch):
    demand = 2.5 * POOL  # 2.5 pools of demand -> ceil(2.5 / 0.7) = 4 replicas at 70 %
    history = run(KVPressurePolicy(0.7), lambda t, n: metrics(n, demand), 20, monkeypatch=monkeypatch)
    t, n = first_change(history, 1)
    assert 5 <= t <= 5.5 and n == 4
    assert history[-1][1] == 4


def test_waiting_prompts_and_router_queue_count_as_demand(monkeypatch):
    # The pool is only half pinned, but waiting prompts need 1.5 pools more: that is pressure.
    history = run(KVPressurePolicy(0.7), lambda t, n: metrics(n, 50, waiting=150), 10, monkeypatch=monkeypatch)
    assert history[-1][1] == math.ceil(200 / 70)
    # Requests queued in the routers count at the replicas' blocks per request (50 blocks / 4 requests).
    history = run(KVPressurePolicy(0.7), lambda t, n: metrics(n, 50), 10, queued=12, monkeypatch=monkeypatch)
    assert history[-1][1] == math.ceil((50 + 12 * 50 / 4) / 70)


def test_preemptions_add_a_replica_even_when_the_average_looks_fine(monkeypatch):
    history = run(
        KVPressurePolicy(0.7), lambda t, n: metrics(n, 30 * n, preemptions=0.5), 7, start=2, monkeypatch=monkeypatch
    )
    assert history[-1][1] == 3


def test_holds_under_steady_load_near_a_boundary(monkeypatch):
    # Demand wobbles between 1.3 and 1.5 pools: 3 replicas at ~47 % each, or 2 at 65-75 %. Without the
    # hysteresis band the target would flap between 2 and 3; with it, it holds for 10 minutes.
    def wobble(t: float, n: int) -> dict:
        return metrics(n, POOL * (1.4 + 0.1 * math.sin(t / 30.0)))  # below 1.4 for ~94 s at a time

    steady = run(KVPressurePolicy(0.7, downscale_band=0.2), wobble, 600, start=3, monkeypatch=monkeypatch)
    assert {n for _, n in steady} == {3}
    no_band = run(KVPressurePolicy(0.7, downscale_band=0.0), wobble, 600, start=3, monkeypatch=monkeypatch)
    assert len({n for _, n in no_band}) > 1, "the wobble should cross the boundary without a band"


def test_scales_down_only_after_the_downscale_delay_and_stops_at_the_minimum(monkeypatch):
    history = run(
        KVPressurePolicy(0.7), lambda t, n: metrics(n, 5), 90, start=4, min_replicas=1, monkeypatch=monkeypatch
    )
    t, n = first_change(history, 4)
    assert 60 <= t <= 60.5 and n == 1
    idle = run(KVPressurePolicy(0.7), lambda t, n: metrics(n, 0), 90, start=4, min_replicas=2, monkeypatch=monkeypatch)
    assert idle[-1][1] == 2


def test_respects_the_maximum_and_holds_without_reports(monkeypatch):
    history = run(
        KVPressurePolicy(0.5), lambda t, n: metrics(n, 50 * POOL), 20, max_replicas=6, monkeypatch=monkeypatch
    )
    assert max(n for _, n in history) == 6
    silent = run(KVPressurePolicy(0.7), lambda t, n: {}, 90, start=3, monkeypatch=monkeypatch)
    assert {n for _, n in silent} == {3}


def test_a_short_spike_shorter_than_the_delay_changes_nothing(monkeypatch):
    def spike(t: float, n: int) -> dict:
        return metrics(n, 3 * POOL if 10 <= t < 13 else 40)

    history = run(KVPressurePolicy(0.7), spike, 60, monkeypatch=monkeypatch)
    assert {n for _, n in history} == {1}


def test_each_replicas_pressure_is_read_back_whole_from_rays_aggregate():
    a = KVPressure(
        kv_used_blocks=10, kv_waiting_blocks=2, kv_total_blocks=100, num_running=3, num_waiting=1, preemptions=0
    )
    b = KVPressure(
        kv_used_blocks=70, kv_waiting_blocks=0, kv_total_blocks=100, num_running=9, num_waiting=0, preemptions=1
    )
    aggregated: dict[str, dict[str, float]] = {}
    for replica, report in (("a", a), ("b", b)):
        for name, value in report.as_dict().items():
            aggregated.setdefault(name, {})[replica] = value
    assert sorted(KVPressure.per_replica(aggregated), key=lambda r: r.kv_used_blocks) == [a, b]
    # A replica whose report lacks a field (it sent something else) is left out, not read as zeros.
    del aggregated["preemptions"]["b"]
    assert KVPressure.per_replica(aggregated) == [a]
    assert KVPressure.per_replica({}) == []


def test_config_validation():
    with pytest.raises(ValueError, match="target_kv_util"):
        KVPressurePolicy(0)
    with pytest.raises(ValueError, match="min_replicas"):
        autoscaling_config(3, 2, 2)
    with pytest.raises(ValueError, match="unknown scaling policy"):
        autoscaling_config(1, 2, 1, policy="cpu")
    with pytest.raises(ValueError, match="unknown settings"):
        autoscaling_config(1, 2, 1, overrides={"upscale_delay": 1})
    config = autoscaling_config(1, 4, 9, target_kv_util=0.5, overrides={"downscale_delay_s": 5})
    assert config["initial_replicas"] == 4 and config["downscale_delay_s"] == 5
    assert config["policy"]["policy_kwargs"] == {"target_kv_util": 0.5}
    assert "policy" not in autoscaling_config(1, 4, 1, policy="ongoing_requests")
