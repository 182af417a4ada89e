"""Prometheus metrics of the routers in this process: decisions by policy and reason, index lookup latency.

Every process holding an engine handle runs its own router, so these live in the process's default
registry and whoever serves ``/metrics`` there (the ingress) exports them. Decisions are counted once, in
each router's ``decisions`` Counter; a collector reads the live routers at scrape time instead of keeping
a second count.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

INDEX_LOOKUP_SECONDS = Histogram(
    "kvmesh_index_lookup_seconds",
    "Latency of one prefix-index lookup in Redis, as seen by the router (timeouts included).",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
)


class CountsDecisions(Protocol):
    decisions: Counter[str]
    policy_name: str


_routers: weakref.WeakSet = weakref.WeakSet()


def register_router(router: CountsDecisions) -> None:
    _routers.add(router)


def decision_counts() -> Counter[tuple[str, str]]:
    """(policy, reason) -> decisions, summed over this process's live routers."""
    total: Counter[tuple[str, str]] = Counter()
    for router in list(_routers):
        for reason, n in list(router.decisions.items()):
            total[(router.policy_name, reason)] += n
    return total


class _DecisionCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "kvmesh_routing_decisions", "Routing decisions by policy and reason.", labels=["policy", "reason"]
        )
        for (policy, reason), n in sorted(decision_counts().items()):
            family.add_metric([policy, reason], n)
        yield family


REGISTRY.register(_DecisionCollector())
