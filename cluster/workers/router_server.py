"""``kvmesh router``: kvmesh's KV-aware router in one process, without Ray, in front of external workers.

The analogue of SGLang's ``smg`` and ``vllm-router``: the cluster ingress's front door (chat template,
tokenize once, hash the prompt's blocks once) and the same routing policy (``router/policy.py``), but
each worker's cache is followed here, from its KV events (``Worker``, ``cluster/workers/worker_client.py``),
and its load is the worker's own count at its last ``/load`` with what this router sent since, never less
than what this router has in flight there. No Ray hop per request and no background stack, so the router's
own CPU stays off the engines' cores. Several routers each follow every worker's events, as Dynamo's and
SGLang's do; with ``--redis-url`` they share what each just sent (``router/shared_routes.py``). ``kvmesh
serve --worker`` is the same routing inside a Ray cluster, shared through the Redis index.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping

from kvmesh.cluster.hosting.listen import listen, serve
from kvmesh.cluster.ingress.admission import key_digests
from kvmesh.cluster.ingress.front_door import IngressSettings, front_door
from kvmesh.cluster.ingress.generation import LocalHandle
from kvmesh.cluster.ingress.http_api import HttpApi, bound_app
from kvmesh.cluster.workers.worker_client import Worker
from kvmesh.cluster.workers.worker_spec import WorkerSpec, distinct
from kvmesh.core.defaults import DEFAULT_PREFILL_TOK_S
from kvmesh.core.messages import GenerateCall, GenerateChunk, IndexCutOff, ReplicaStatus, RoutingCount
from kvmesh.router import metrics as router_metrics
from kvmesh.router.baselines import make_policy
from kvmesh.router.policy import ReplicaLoad, RouteRequest
from kvmesh.router.recent_routes import RecentRoutes
from kvmesh.router.shared_routes import SharedRoutes, SharedView
from kvmesh.router.worker_blocks import HOST

log = logging.getLogger(__name__)


class LocalRouter:
    """Routes each call to one of ``workers`` (by their URLs) with a kvmesh policy, on what this process sees."""

    def __init__(
        self,
        workers: list[Worker],
        policy: str = "kv_aware",
        policy_kwargs: dict | None = None,
        shared: SharedRoutes | None = None,
    ) -> None:
        self.workers = {w.spec.url: w for w in workers}
        self.shared = shared
        """Other ``kvmesh router`` processes' routes, through Redis (``--redis-url``); None: this router's alone."""
        self.policy = make_policy(policy, **(policy_kwargs or {}))
        self.policy_name = policy
        self.decisions: Counter[str] = Counter()
        self._waiting: dict[str, dict[str, int]] = {url: {} for url in self.workers}
        """Per worker, the requests sent there still before their first chunk: their tokens to prefill."""
        period = max((w.load_period_s for w in workers), default=1.0)
        self.routes = RecentRoutes(period)
        """What this router sent each worker since its last ``/load`` report."""
        router_metrics.register_router(self)

    @property
    def curr_replicas(self) -> dict[str, Worker]:
        """The workers answering (what ``/health`` and a request's wait for a live one count)."""
        return {url: w for url, w in self.workers.items() if not w.down}

    def choose(self, call: GenerateCall, view: SharedView | None = None) -> tuple[str, int]:
        """The worker for ``call`` and the leading blocks it holds (or will, by ``view``: other routers' routes)."""
        req = RouteRequest(call.block_hashes, call.num_tokens, call.block_size, call.session_id, call.lora_name)
        live = list(self.curr_replicas) or list(self.workers)
        if call.lora_name:  # only workers that serve the adapter, where any does
            live = [url for url in live if self.workers[url].serves(call.lora_name)] or live
        device = {url: self.workers[url].blocks.leading(req.block_hashes) for url in live}
        host = {url: self.workers[url].blocks.leading(req.block_hashes, HOST, device[url]) for url in live}
        loads = {url: self._load(url) for url in live}
        if view is not None:
            _add_others(view, device, loads)
        decision = self.policy.rank(req, list(loads.values()), device, None, host)
        self.decisions[decision.reason] += 1
        # Among near-ties: the fewest requests (fresher than the costs), then the smallest cache (new prompts
        # land apart, as hot documents should), then the order offered.
        chosen = min(decision.tied_group, key=lambda url: (loads[url].num_requests, len(self.workers[url].blocks)))
        self.policy.on_routed(req, chosen, decision)
        return chosen, device[chosen]

    def _load(self, url: str) -> ReplicaLoad:
        """The worker as the policy prices it: its measured speed and capacity where it reports them (``kvmesh
        engine``; else the defaults); for requests, its own count at its last report (every router's) with what
        this router sent since, and never less than what this router has in flight there."""
        worker, waiting = self.workers[url], self._waiting[url]
        load = ReplicaLoad(index_id=url, kv_usage=worker.gauges.get("kv_usage", 0.0), **worker.measured())
        if (report := worker.report) is not None:
            load.reported_at = report.reported_at
            load.num_running, load.num_waiting = report.num_running, report.num_waiting
            rate = load.prefill_tok_s or DEFAULT_PREFILL_TOK_S
            queued = self.routes.queued(url, report.reported_at, report.pending_prefill_tokens, rate)
            load.routed_requests, load.pending_prefill_tokens, load.routed_prefill_tokens = queued
            load.report_age_s = max(0.0, time.time() - report.reported_at)
        else:
            load.reported_at = time.time()
        load.num_running += max(0, worker.in_flight - load.num_requests)
        own_prefill = sum(waiting.values()) - load.pending_prefill_tokens - load.routed_prefill_tokens
        load.routed_prefill_tokens += max(0, own_prefill)
        return load

    async def _shared_view(self, call: GenerateCall) -> SharedView | None:
        """What other routers did that this decision needs (None without ``shared``, or if Redis is slow)."""
        if self.shared is None:
            return None
        since = {url: w.report.reported_at if w.report else 0.0 for url, w in self.workers.items()}
        return await self.shared.look(call.block_hashes, since)  # it bounds each by its window

    async def generate(self, call: GenerateCall) -> AsyncIterator[GenerateChunk]:
        url, hits = self.choose(call, await self._shared_view(call))
        waiting = self._waiting[url]
        waiting[call.request_id] = prefill = max(call.num_tokens - hits * call.block_size, 1)
        self.routes.add(call.request_id, url, prefill)
        if self.shared is not None:
            self.shared.record(call.block_hashes, url, call.request_id, prefill)
        try:
            async for chunk in self.workers[url].generate(call, url):
                waiting.pop(call.request_id, None)
                yield chunk
        finally:
            waiting.pop(call.request_id, None)
            self.routes.done(call.request_id)
            if self.shared is not None:
                self.shared.done(url, call.request_id, prefill)


def _add_others(view: SharedView, device: dict[str, int], loads: dict[str, ReplicaLoad]) -> None:
    """Other routers' routes into one decision's view: their requests since each worker's report into its load,
    and a prefix they just sent somewhere as held there, where no worker's events show it deeper (a prefix
    really cached, such as a system prompt, must not pull traffic to the latest choice; as the index's
    lookup rules)."""
    for url, (requests, tokens) in view.routed.items():
        if url in loads:
            loads[url].routed_requests += requests
            loads[url].routed_prefill_tokens += tokens
    indexed = max(device.values(), default=0)
    for url, depth in view.predicted.items():
        if url in device and depth > indexed and depth > device[url]:
            device[url] = depth


class WorkerAdapters(Mapping[str, str | None]):
    """The LoRA adapters any worker lists in its ``/v1/models``: what a request's ``model`` may name here (each
    worker reads its adapters from its own files, so no path is kept)."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    def __contains__(self, name: object) -> bool:
        return any(w.served and name in w.served for w in self.workers)

    def __getitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set().union(*(w.served or () for w in self.workers))))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class RouterServer(HttpApi):
    """The HTTP routes over the local router; status and metrics report its workers."""

    def __init__(self, router: LocalRouter, settings: IngressSettings) -> None:
        self.router = router
        self.settings = settings
        self.index = None
        self.generation, self.admission = front_door(settings, LocalHandle(router.generate))
        self.generation.adapters = WorkerAdapters(list(router.workers.values()))

    async def _replica_reports(self) -> dict[str, ReplicaStatus]:
        return {url: w.status() for url, w in self.router.workers.items()}

    no_replica_reason = "no worker answers"

    def _live_replicas(self) -> int:
        return len(self.router.curr_replicas)

    def _decisions(self) -> list[RoutingCount]:
        policy = self.router.policy_name
        return [RoutingCount(policy=policy, reason=r, count=n) for r, n in sorted(self.router.decisions.items())]

    def _cut_off(self) -> dict[str, IndexCutOff]:
        return {}  # no index to be cut off from: the workers' blocks live in this process


def run_router_server(args: argparse.Namespace, policy_kwargs: dict | None = None) -> int:
    from kvmesh.core.model_files import resolve_model_dir

    specs = distinct([WorkerSpec.parse(w) for w in args.worker])
    sock = listen(args.host, args.port)
    resolve_model_dir(args.model, weights=False)  # a bad model fails before any worker is contacted
    served = args.served_model_name or args.model
    workers = [Worker(spec, args.model, served, args.block_size, load_period_s=args.load_period_s) for spec in specs]
    shared = SharedRoutes(args.redis_url, served) if args.redis_url else None
    router = LocalRouter(workers, args.policy, policy_kwargs, shared)  # a bad policy setting fails before serving
    digests = key_digests(args.api_key or [])
    settings = IngressSettings(
        model=args.model,
        served_model_name=served,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        policy=args.policy,
        api_key_digests=digests,
        max_inflight_requests=args.max_inflight_requests,
    )
    server = RouterServer(router, settings)
    app = bound_app(server, "kvmesh router")

    async def start_workers() -> None:
        for worker in workers:
            worker.start()

    async def stop_workers() -> None:
        for worker in workers:
            await worker.aclose()
        if shared is not None:
            await shared.aclose()

    app.router.on_startup.append(start_workers)
    app.router.on_shutdown.append(stop_workers)
    serve(app, sock, f"kvmesh router ready: http://{args.host}:{args.port}/v1 ({served}, {len(workers)} worker(s))")
    return 0
