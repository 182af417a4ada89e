"""The routers of this process as the ingress sees them: decisions by policy and reason and index lookup
latency (Prometheus), and the engine replicas they can route to (for ``/health``, ``/status`` and the bound
on a request's wait while none is alive).

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

from kvmesh.core.messages import LoadReport

INDEX_LOOKUP_SECONDS = Histogram(
    "kvmesh_index_lookup_seconds",
    "Latency of one prefix-index lookup in Redis, as seen by the router (timeouts included).",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
)


class CountsDecisions(Protocol):
    decisions: Counter[str]
    policy_name: str

    @property
    def curr_replicas(self) -> dict: ...


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


def live_replicas() -> int | None:
    """Engine replicas this process's routers can send to (Ray's view, updated when one dies); None before
    any router exists here (the first request creates it)."""
    routers = list(_routers)
    return sum(len(r.curr_replicas) for r in routers) if routers else None


def load_reports() -> list[LoadReport]:
    """The last load report of every replica this process's routers know (replicas yet to report left out)."""
    reports = []
    for router in list(_routers):
        for replica in list(router.curr_replicas.values()):
            report = LoadReport.from_dict(replica.routing_stats)
            if report is not None:
                reports.append(report)
    return reports


class _DecisionCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "kvmesh_routing_decisions", "Routing decisions by policy and reason.", labels=["policy", "reason"]
        )
        for (policy, reason), n in sorted(decision_counts().items()):
            family.add_metric([policy, reason], n)
        yield family


REGISTRY.register(_DecisionCollector())
