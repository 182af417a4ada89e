"""Engines kvmesh did not start: each external OpenAI-compatible worker (vLLM, SGLang, ``kvmesh engine``) is stood
for by one Ray Serve replica of the engine deployment, a ``WorkerProxy``, so the KV-aware router, the index and
``kvmesh status`` treat it as one of their own.

A proxy (the ``rank``-th replica stands for ``workers[rank]``) forwards each ``GenerateCall`` to its worker's
``/v1/completions`` as token ids (the ingress tokenized with the served model's tokenizer, so the router's block
hashes are the worker's prompt), streaming, with the tenant's ``cache_salt``; chunks, usage and the worker's
cached-token count come back, errors as the worker said them. It follows the worker's KV events
(``kvmesh/router/kv_event_subscriber.py``), turns them into kvmesh hashes (``kvmesh/router/worker_blocks.py``)
and publishes them to the index under its own replica id, with heartbeats. Its load report is what it has in
flight plus the worker's Prometheus gauges where it exports vLLM's (running, waiting, KV usage). A worker that
stops answering fails the proxy's health check: Ray replaces the proxy, whose entries leave the index when its
heartbeat stops; the new proxy starts once the worker answers again (Ray retries it with a back-off).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import httpx
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from kvmesh.cluster.nodes import node_address
from kvmesh.cluster.router_config import router_config
from kvmesh.cluster.worker_spec import WorkerSpec
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.index_schema import index_redis_url
from kvmesh.router.kv_event_subscriber import KVEventSubscriber
from kvmesh.router.worker_blocks import DEVICE, HOST, WorkerBlocks
from kvmesh.shared.errors import InvalidRequest, RequestFailed
from kvmesh.shared.hashing import model_seed
from kvmesh.shared.messages import GenerateCall, GenerateChunk, LoadReport, ReplicaStatus, Usage
from kvmesh.shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)

METRICS_PERIOD_S = 1.0
DOWN_AFTER = 2
"""Consecutive unanswered polls (one a second) after which a worker counts as down."""
SATURATED = 1_000_000
"""The waiting requests a down worker reports, so routers rank it last until Ray removes it."""
HEALTH_TIMEOUT_S = 5.0
START_TIMEOUT_S = 10.0
"""How long a starting proxy waits for its worker's ``/health``; then it fails its start (Ray retries it)."""


class WorkerUnreachable(RuntimeError):
    """The worker did not answer ``/health`` (the message names its URL)."""


def wait_for_worker(url: str, headers: dict[str, str], timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once ``url/health`` answers below 500; raise ``WorkerUnreachable`` after ``timeout_s``."""
    deadline, error = time.monotonic() + timeout_s, "no answer"
    with httpx.Client(base_url=url, headers=headers, timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                status = client.get("/health").status_code
                if status < 500:
                    return
                error = f"HTTP {status}"
            except httpx.HTTPError as exc:
                error = repr(exc)
            time.sleep(0.5)
    raise WorkerUnreachable(f"worker {url} does not answer /health ({error}) after {timeout_s:.0f} s")


def completion_body(call: GenerateCall, model: str) -> dict:
    """The worker's ``/v1/completions`` request for ``call``: its token ids and every sampling setting the
    OpenAI API (and vLLM's extensions) can say."""
    p: SamplingParams = call.params
    body = {
        "model": model,
        "prompt": call.prompt_token_ids,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "n": p.n,
        "return_token_ids": True,
    }
    extras = {
        "top_k": p.top_k or None,
        "min_p": p.min_p or None,
        "seed": p.seed,
        "stop": p.stop or None,
        "stop_token_ids": p.stop_token_ids or None,
        "ignore_eos": p.ignore_eos or None,
        "logit_bias": {str(k): v for k, v in p.logit_bias.items()} or None,
        "presence_penalty": p.presence_penalty or None,
        "frequency_penalty": p.frequency_penalty or None,
        "min_tokens": p.min_tokens or None,
        "cache_salt": call.cache_salt,
    }
    if p.logprobs is not None or p.prompt_logprobs is not None or p.json_schema is not None:
        raise InvalidRequest("logprobs and response_format are not forwarded to external workers yet", "logprobs")
    return body | {k: v for k, v in extras.items() if v is not None}


def prometheus_gauges(text: str) -> dict[str, float]:
    """A worker's load gauges from its ``/metrics`` page (vLLM's, SGLang's or ``kvmesh engine``'s names), summed
    over label sets: running and waiting requests, KV usage (0-1)."""
    wanted = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",
        "sglang:num_running_reqs": "running",
        "sglang:num_queue_reqs": "waiting",
        "sglang:token_usage": "kv_usage",
        "kvmesh_replica_requests_running": "running",
        "kvmesh_replica_requests_waiting": "waiting",
        "kvmesh_replica_kv_usage_ratio": "kv_usage",
    }
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            key = wanted.get(family.name)
            if key is not None:
                out[key] = sum(sample.value for sample in family.samples)
    except ValueError:  # not a Prometheus page: no gauges
        return {}
    return out


class WorkerProxy:
    """One external worker as a replica of the engine deployment (``generate``, load and health like
    ``EngineReplica``)."""

    def __init__(
        self,
        workers: list[dict],
        model: str,
        served_name: str,
        block_size: int,
        redis_url: str | None = None,
        deployment: str = "kvmesh",
    ) -> None:
        context = serve.get_replica_context()
        rank = context.rank if isinstance(context.rank, int) else context.rank.rank
        self.spec = WorkerSpec(**workers[rank % len(workers)])
        self.node = node_address()
        self.model = self.spec.model or served_name
        headers = {"Authorization": f"Bearer {self.spec.api_key}"} if self.spec.api_key else {}
        wait_for_worker(self.spec.url, headers)
        self.client = httpx.AsyncClient(base_url=self.spec.url, headers=headers, timeout=httpx.Timeout(None, connect=5))
        self.blocks = WorkerBlocks(model_seed(model), block_size)
        self.in_flight = 0
        self.down = False
        self.gauges: dict[str, float] = {}
        self.prompt_tokens = self.cached_tokens = 0
        self.publisher = None
        self.subscriber = None
        redis_url = index_redis_url(redis_url)  # None: this process's $KVMESH_REDIS_URL
        name = context.replica_id.unique_id
        if redis_url:
            self.publisher = KVIndexPublisher(
                redis_url,
                deployment,
                model,
                name,
                lambda: self.blocks.snapshot(DEVICE),
                unique_name=True,
                status=self.status,
                host_snapshot=lambda: self.blocks.snapshot(HOST),
            ).start()
        if self.spec.kv_events:
            self.subscriber = KVEventSubscriber(
                self.spec.kv_events, self.spec.replay, self._on_batch, self._on_restart, self.spec.topic, self.spec.url
            ).start()
        self.index_id = self.publisher.replica_id if self.publisher else name
        self._poller = asyncio.get_running_loop().create_task(self._poll_metrics())

    def _on_batch(self, batch) -> None:
        changes = self.blocks.apply(batch)
        if self.publisher is not None and changes:
            self.publisher.publish(changes)

    def _on_restart(self) -> None:
        changes = self.blocks.clear()
        if self.publisher is not None:
            self.publisher.publish(changes)

    async def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        """Stream the worker's answer to ``call`` as kvmesh chunks; the last carries ``Usage``."""
        body = completion_body(call, self.model)
        if self.down:
            raise RequestFailed(f"worker {self.spec.url} does not answer")
        self.in_flight += 1
        try:
            async with self.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise _worker_error(response.status_code, (await response.aread()).decode(errors="replace"))
                async for chunk in self._chunks(response, call):
                    yield chunk
        except httpx.HTTPError as exc:
            raise RequestFailed(f"worker {self.spec.url} failed: {exc!r}") from exc
        finally:
            self.in_flight -= 1

    async def _chunks(self, response: httpx.Response, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        usage = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RequestFailed(f"worker {self.spec.url}: {event['error'].get('message', event['error'])}")
            for choice in event.get("choices") or []:
                # Workers that do not return ids (only vLLM does, on request) count one token per text chunk.
                ids = choice.get("token_ids") or ([0] if choice.get("text") else [])
                yield GenerateChunk(
                    index=choice.get("index", 0),
                    text=choice.get("text") or "",
                    token_ids=list(ids),
                    finish_reason=choice.get("finish_reason"),
                    num_cached_tokens=0,
                    replica=self.index_id,
                )
            if event.get("usage"):
                usage = event["usage"]
        if usage is None:
            raise RequestFailed(f"worker {self.spec.url} ended the stream without usage")
        cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        self.prompt_tokens += usage.get("prompt_tokens", call.num_tokens)
        self.cached_tokens += cached
        yield GenerateChunk(
            index=0,
            text="",
            token_ids=[],
            finish_reason=None,
            num_cached_tokens=cached,
            replica=self.index_id,
            usage=Usage(
                prompt_tokens=usage.get("prompt_tokens", call.num_tokens),
                completion_tokens=usage.get("completion_tokens", 0),
                cached_tokens=cached,
            ),
        )

    async def _poll_metrics(self) -> None:
        """Read the worker's gauges every second; after ``DOWN_AFTER`` unanswered polls it is down: its index
        entries go at once and routers rank it last, until it answers again (its cache is then rebuilt from
        its event stream) or Ray's health check replaces this proxy."""
        failures = 0
        while True:
            try:
                response = await self.client.get("/metrics", timeout=2.0)
                answered = response.status_code < 500
                if response.status_code == 200:
                    self.gauges = prometheus_gauges(response.text)
            except httpx.HTTPError:
                answered = False
            failures = 0 if answered else failures + 1
            if failures == DOWN_AFTER:
                log.warning("worker %s stopped answering: its index entries are removed", self.spec.url)
                self.down = True
                self._on_restart()
            elif answered and self.down:
                log.warning("worker %s answers again: rebuilding its cache from its events", self.spec.url)
                self.down = False
                if self.subscriber is not None:
                    self.subscriber.request_rebuild()
            await asyncio.sleep(METRICS_PERIOD_S)

    async def check_health(self) -> None:
        """Ray Serve's health check: the worker must answer ``/health``; else Ray replaces this proxy."""
        try:
            response = await self.client.get("/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"worker {self.spec.url} does not answer: {exc!r}") from exc
        if response.status_code >= 500:
            raise RuntimeError(f"worker {self.spec.url} is unhealthy ({response.status_code})")

    def status(self) -> ReplicaStatus:
        """What ``kvmesh status`` shows of the worker: its gauges, and the prefix hits of what this proxy sent."""
        return ReplicaStatus(
            node=self.node,
            num_running=max(self.in_flight, int(self.gauges.get("running", 0))),
            num_waiting=int(self.gauges.get("waiting", 0)),
            kv_usage=self.gauges.get("kv_usage", 0.0),
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_tokens,
            prefix_hit_rate=self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        )

    def record_routing_stats(self) -> dict:
        running = max(self.in_flight, int(self.gauges.get("running", 0)))
        report = LoadReport(
            index_id=self.index_id,
            reported_at=time.time(),
            num_running=running,
            num_waiting=SATURATED if self.down else int(self.gauges.get("waiting", 0)),
            kv_usage=self.gauges.get("kv_usage", 0.0),
            node=self.node,
            index_error=self.publisher.last_error if self.publisher is not None else None,
        )
        return report.as_dict()

    def __del__(self) -> None:
        if getattr(self, "subscriber", None) is not None:
            self.subscriber.close()
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()


def _worker_error(status: int, text: str) -> Exception:
    """The worker's refusal as the ingress reports engine errors: 4xx as the client's (400), else a failure."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:500]
    if 400 <= status < 500:
        return InvalidRequest(f"worker refused the request: {message}", "prompt")
    return RequestFailed(f"worker answered {status}: {message}")


def worker_deployment(
    workers: list[dict],
    model: str,
    served_name: str,
    block_size: int,
    redis_url: str | None = None,
    deployment: str = "kvmesh",
    policy: str = "kv_aware",
    policy_kwargs: dict | None = None,
    stats_period_s: float = 1.0,
    max_ongoing_requests: int = 64,
    max_queued_requests: int = -1,
    ray_actor_options: dict | None = None,
) -> serve.Application:
    """The engine deployment over external workers: one ``WorkerProxy`` replica per worker, the same router."""
    return serve.deployment(
        WorkerProxy,
        name="engine",
        num_replicas=len(workers),
        ray_actor_options=ray_actor_options or {"num_cpus": 0},
        max_ongoing_requests=max_ongoing_requests,
        max_queued_requests=max_queued_requests,
        request_router_config=router_config(policy, redis_url, deployment, model, policy_kwargs, stats_period_s),
        health_check_period_s=2.0,
        health_check_timeout_s=HEALTH_TIMEOUT_S * 2,
    ).bind(workers, model, served_name, block_size, redis_url, deployment)
