"""Prometheus metrics served at ``/metrics`` by the ingress.

Latencies and token counts are measured where the user feels them, in the ingress process (one set per
ingress replica; Prometheus sums them). Per-replica engine state (KV usage, prefix hit rate, queues,
preemptions) comes from the status reports replicas store in Redis beside their heartbeats, so any ingress
can export the whole cluster. Routing decisions and index lookup latency come from the routers in this
process (``kvmesh.router.metrics``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

import kvmesh.router.metrics  # noqa: F401  (registers the routers' metrics in this process's registry)
from kvmesh.core.messages import ReplicaStatus

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

TTFT = Histogram(
    "kvmesh_time_to_first_token_seconds",
    "Request arrival at the ingress to its first token.",
    ["model"],
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN = Histogram(
    "kvmesh_inter_token_latency_seconds",
    "Time between consecutive output tokens of a request.",
    ["model"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
E2E = Histogram(
    "kvmesh_e2e_request_latency_seconds", "Request arrival to its last token.", ["model"], buckets=LATENCY_BUCKETS
)
PROMPT_TOKENS = Counter("kvmesh_prompt_tokens", "Prompt tokens of finished requests.", ["model"])
CACHED_TOKENS = Counter("kvmesh_cached_prompt_tokens", "Prompt tokens served from a replica's prefix cache.", ["model"])
GENERATED_TOKENS = Counter("kvmesh_generation_tokens", "Output tokens generated.", ["model"])
REQUESTS = Counter("kvmesh_requests", "Requests answered, by API and outcome.", ["model", "api", "outcome"])
RETRIES = Counter(
    "kvmesh_request_retries", "Requests sent again because their replica failed before any token.", ["model"]
)
REFUSED = Counter("kvmesh_requests_refused", "Requests refused at the door (401, 413, 429).", ["reason"])

_GAUGES: tuple[tuple[str, str, Callable[[ReplicaStatus], float]], ...] = (
    (
        "kvmesh_replica_kv_usage_ratio",
        "Share of the replica's KV blocks held by running requests.",
        lambda s: s.kv_usage,
    ),
    (
        "kvmesh_replica_prefix_hit_rate",
        "Prompt tokens served from the prefix cache / admitted.",
        lambda s: s.prefix_hit_rate,
    ),
    ("kvmesh_replica_requests_running", "Requests in the replica's running batch.", lambda s: s.num_running),
    ("kvmesh_replica_requests_waiting", "Requests queued at the replica.", lambda s: s.num_waiting),
    ("kvmesh_replica_cached_blocks", "Evictable blocks holding cached prefixes.", lambda s: s.num_cached_blocks),
    (
        "kvmesh_replica_host_hit_rate",
        "Prompt tokens loaded from the host prefix tier / admitted.",
        lambda s: s.host_hit_rate,
    ),
    (
        "kvmesh_replica_host_tier_used_blocks",
        "Host-tier blocks holding evicted prefixes.",
        lambda s: s.host_tier_used_blocks,
    ),
    (
        "kvmesh_replica_host_tier_blocks",
        "Host-tier capacity for evicted prefixes, in blocks.",
        lambda s: s.host_tier_blocks,
    ),
    (
        "kvmesh_replica_disk_tier_used_blocks",
        "Blocks in the disk tier's files.",
        lambda s: s.disk_tier_used_blocks,
    ),
    (
        "kvmesh_replica_disk_tier_blocks",
        "Disk-tier capacity, in blocks (0: no disk tier).",
        lambda s: s.disk_tier_blocks,
    ),
    (
        "kvmesh_replica_disk_blocks_read",
        "Blocks read back from the disk tier since the replica started.",
        lambda s: s.disk_blocks_read,
    ),
    (
        "kvmesh_replica_disk_blocks_dropped",
        "Blocks the disk tier did not keep since the replica started (write queue full, or the write failed).",
        lambda s: s.disk_blocks_dropped,
    ),
    (
        "kvmesh_replica_prefill_busy_ratio",
        "Share of the last 10 s the replica spent prefilling (what routers price cache churn by).",
        lambda s: s.prefill_busy,
    ),
)
"""The engine's gauges: not exported for a replica whose report says it could not read its engine."""


class _ReplicaCollector(Collector):
    def __init__(self, reports: dict[str, ReplicaStatus]) -> None:
        self.reports = sorted(reports.items())

    def collect(self):
        known = [(replica, status) for replica, status in self.reports if status.error is None]
        for name, doc, value in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica, status in known:
                if (sample := value(status)) is not None:  # None: not measured (a worker's prefill_busy)
                    family.add_metric([replica], float(sample))
            yield family
        entries = GaugeMetricFamily(
            "kvmesh_replica_index_entries", "Blocks the replica has published to the index.", labels=["replica"]
        )
        for replica, status in self.reports:
            entries.add_metric([replica], float(status.index_entries))
        yield entries
        yield from _counters((("kvmesh_replica_preemptions", "Requests preempted.", "num_preemptions"),), known)
        cached = CounterMetricFamily(
            "kvmesh_replica_cached_prompt_tokens",
            "Prompt tokens served from the replica's prefix cache, by the tier that held them.",
            labels=["replica", "tier"],
        )
        for replica, status in known:
            cached.add_metric([replica, "device"], status.cached_prompt_tokens - status.cached_prompt_tokens_host)
            cached.add_metric([replica, "host"], status.cached_prompt_tokens_host)
        yield cached
        yield from _counters(_TRANSFER_COUNTERS, known)
        fallbacks = CounterMetricFamily(
            "kvmesh_replica_kv_fetch_fallbacks",
            "Prefix fetches from a peer that fell back to recompute, by reason.",
            labels=["replica", "reason"],
        )
        for replica, status in known:
            for reason, count in sorted(status.kv_fetch_fallbacks.items()):
                fallbacks.add_metric([replica, reason], count)
        yield fallbacks
        yield from _counters(_INDEX_COUNTERS, self.reports)
        followed = [(replica, status) for replica, status in self.reports if status.kv_event_batches is not None]
        yield from _counters(_EVENT_COUNTERS, followed)
        lag = GaugeMetricFamily(
            "kvmesh_replica_kv_event_lag_seconds",
            "A worker's timestamp of its last KV-event batch to that batch being applied by this process.",
            labels=["replica"],
        )
        for replica, status in followed:
            if status.kv_event_lag_s is not None:
                lag.add_metric([replica], status.kv_event_lag_s)
        yield lag


_TRANSFER_COUNTERS = (
    ("kvmesh_replica_kv_fetches", "Prefix fetches from peers.", "kv_fetches"),
    ("kvmesh_replica_kv_fetched_blocks", "KV blocks fetched from peers and adopted.", "kv_fetched_blocks"),
    ("kvmesh_replica_kv_fetched_bytes", "Bytes of KV blocks fetched from peers and adopted.", "kv_fetched_bytes"),
    ("kvmesh_replica_kv_fetch_seconds", "Seconds spent fetching prefixes from peers.", "kv_fetch_seconds"),
    ("kvmesh_replica_kv_served_blocks", "KV blocks sent to peers.", "kv_served_blocks"),
    ("kvmesh_replica_kv_served_bytes", "Bytes of KV blocks sent to peers.", "kv_served_bytes"),
)
"""KV moved between replicas (``replica/kv_peer.py``)."""
_INDEX_COUNTERS = (
    ("kvmesh_replica_index_resyncs", "Full rebuilds of the replica's index entries.", "index_resyncs"),
    (
        "kvmesh_replica_index_replayed_batches",
        "Batches of index updates sent again after Redis lost them.",
        "index_replayed_batches",
    ),
    ("kvmesh_replica_index_errors", "Failed Redis calls of the replica's index publisher (retried).", "index_errors"),
)
"""The index publisher's counters, kept for every replica (they go on when its engine cannot be read)."""
_EVENT_COUNTERS = (
    ("kvmesh_replica_kv_event_batches", "KV-event batches applied from an external worker.", "kv_event_batches"),
    ("kvmesh_replica_kv_event_gaps", "Gaps found in a worker's live KV-event stream (replayed).", "kv_event_gaps"),
    (
        "kvmesh_replica_kv_event_batches_lost",
        "Missing KV-event batches a worker's replay buffer no longer held.",
        "kv_event_batches_lost",
    ),
    (
        "kvmesh_replica_kv_event_restarts",
        "Times a worker's KV-event stream started over (its cache view rebuilt).",
        "kv_event_restarts",
    ),
)
"""How an external worker's KV-event stream is followed: only for workers whose events are followed."""


def _counters(specs, reports: list[tuple[str, ReplicaStatus]]) -> Iterator[CounterMetricFamily]:
    """One counter family per ``(name, doc, ReplicaStatus field)``, a sample per replica of ``reports``."""
    for name, doc, field in specs:
        family = CounterMetricFamily(name, doc, labels=["replica"])
        for replica, status in reports:
            family.add_metric([replica], getattr(status, field))
        yield family


class _VLLMNamesCollector(Collector):
    """One engine's state under the names other routers and gateways read from vLLM (llm-d's scorers, SGLang's
    and vLLM's routers): running and waiting requests, KV usage (0-1), and prefix-cache queries and hits in
    prompt tokens, labelled with the served model's name as vLLM labels them."""

    def __init__(self, model_name: str, status: ReplicaStatus) -> None:
        self.model_name, self.status = model_name, status

    def collect(self):
        s, labels = self.status, [self.model_name]
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family
        counters = (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens.", s.prompt_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens.", s.cached_prompt_tokens),
        )
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family


def render(replica_reports: dict[str, ReplicaStatus], vllm_names: str | None = None) -> bytes:
    """This process's metrics plus one gauge set per replica from their latest reports; with ``vllm_names`` (the
    served model's name, for a single engine's server) its state also under vLLM's metric names."""
    replicas = CollectorRegistry(auto_describe=False)
    replicas.register(_ReplicaCollector(replica_reports))
    if vllm_names is not None and len(replica_reports) == 1:
        (status,) = replica_reports.values()
        if status.error is None:
            replicas.register(_VLLMNamesCollector(vllm_names, status))
    return generate_latest(REGISTRY) + generate_latest(replicas)
