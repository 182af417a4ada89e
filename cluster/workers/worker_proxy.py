"""Engines kvmesh did not start, under Ray Serve: each external OpenAI-compatible worker (vLLM, SGLang,
``kvmesh engine``) is stood for by one replica of the engine deployment, a ``WorkerProxy``, so the KV-aware
router, the index and ``kvmesh status`` treat it as one of their own.

The ``rank``-th replica stands for ``workers[rank]`` through a ``Worker`` (``cluster/workers/worker_client.py``:
forwarding, its cache from its KV events, its load) and publishes that cache to the index under its own
replica id, with heartbeats. A worker that stops answering has its entries removed at once and reports
itself saturated, so routers rank it last; it also fails the proxy's health check, so Ray replaces the
proxy, which starts again once the worker answers (Ray retries it with a back-off).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray import serve

from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.cluster.hosting.nodes import node_address, replica_rank
from kvmesh.cluster.workers.worker_client import Worker, wait_for_worker
from kvmesh.cluster.workers.worker_spec import WorkerSpec
from kvmesh.core.messages import GenerateCall, GenerateChunk, LoadReport, ReplicaStatus
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.index_schema import index_redis_url
from kvmesh.router.worker_blocks import DEVICE, HOST

HEALTH_TIMEOUT_S = 5.0
SATURATED = 1_000_000
"""The waiting requests a down worker reports, so routers rank it last until Ray removes it."""


class WorkerProxy:
    """One external worker as a replica of the engine deployment (``generate``, load and health like
    ``EngineReplica``)."""

    def __init__(
        self,
        workers: list[WorkerSpec],
        model: str,
        served_name: str,
        block_size: int,
        redis_url: str | None = None,
        deployment: str = "kvmesh",
    ) -> None:
        context = serve.get_replica_context()
        spec = workers[replica_rank(context.rank) % len(workers)]
        self.node = node_address()
        self.worker = Worker(spec, model, served_name, block_size, on_changes=self._publish)
        wait_for_worker(spec.url, self.worker.headers)
        self.publisher = None
        redis_url = index_redis_url(redis_url)  # None: this process's $KVMESH_REDIS_URL
        name = context.replica_id.unique_id
        if redis_url:
            blocks = self.worker.blocks
            self.publisher = KVIndexPublisher(
                redis_url,
                deployment,
                model,
                name,
                lambda: blocks.snapshot(DEVICE),
                unique_name=True,
                status=self.status,
                host_snapshot=lambda: blocks.snapshot(HOST),
            ).start()
        self.index_id = self.publisher.replica_id if self.publisher else name
        self.worker.start()

    def _publish(self, changes) -> None:
        if self.publisher is not None:
            self.publisher.publish(changes)

    async def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        """Stream the worker's answer to ``call``; the last chunk carries ``Usage``."""
        async for chunk in self.worker.generate(call, self.index_id):
            yield chunk

    async def check_health(self) -> None:
        """Ray Serve's health check: the worker must answer ``/health``; else Ray replaces this proxy."""
        try:
            status, _ = await self.worker.get("/health", HEALTH_TIMEOUT_S)
        except OSError as exc:
            raise RuntimeError(f"worker {self.worker.spec.url} does not answer: {exc!r}") from exc
        if status >= 500:
            raise RuntimeError(f"worker {self.worker.spec.url} is unhealthy ({status})")

    def status(self) -> ReplicaStatus:
        return self.worker.status(self.node)

    def record_routing_stats(self) -> dict:
        w = self.worker
        report = LoadReport(
            index_id=self.index_id,
            reported_at=time.time(),
            num_running=max(w.in_flight, int(w.gauges.get("running", 0))),
            num_waiting=SATURATED if w.down else int(w.gauges.get("waiting", 0)),
            kv_usage=w.gauges.get("kv_usage", 0.0),
            node=self.node,
            index_error=self.publisher.last_error if self.publisher is not None else None,
            lora_served=sorted(w.served) if w.served is not None else None,
            **w.measured(),  # a kvmesh engine's rates and room; other workers are priced at the defaults
        )
        return report.as_dict()

    def close(self) -> None:
        """Stop following the worker and take its entries out of the index; once."""
        worker, publisher = getattr(self, "worker", None), getattr(self, "publisher", None)
        self.worker = self.publisher = None
        if worker is not None:
            worker.close()
        if publisher is not None:
            publisher.close()

    def __del__(self) -> None:
        self.close()


def worker_deployment(
    workers: list[WorkerSpec],
    model: str,
    served_name: str,
    block_size: int,
    routing: RoutingSettings,
    ray_actor_options: dict | None = None,
) -> serve.Application:
    """The engine deployment over external workers: one ``WorkerProxy`` replica per worker, the same router."""
    return serve.deployment(
        WorkerProxy,
        **routing.deployment_options(model),
        num_replicas=len(workers),
        ray_actor_options=ray_actor_options or {"num_cpus": 0},
        health_check_timeout_s=HEALTH_TIMEOUT_S * 2,
    ).bind(workers, model, served_name, block_size, routing.redis_url, routing.deployment)
