"""The Ray Serve ``RequestRouter`` that puts kvmesh's routing policies on the engine deployment's handle.

Every process holding a handle to the engine deployment (each ingress replica, each proxy) runs one of
these. It reads the request's precomputed block hashes from the call (a ``GenerateCall``,
``core/messages.py``), asks the shared Redis index once, combines the answer with each replica's
``LoadReport`` and the requests it routed itself since that report, and returns replicas ranked best first,
one per group, so Ray falls back to the next when one is full; replicas the policy finds tied share the
first group, for Ray to pick the one with the shortest live queue (unless other requests wait to be routed).

Where the policy priced pulling part of the prefix from a peer (``Decision.fetches``), the plans ride on the
call (``GenerateCall.fetches``) to whichever candidate Ray sends it to. It never blocks the event loop: the
index lookup is async with a short timeout, and everything else is in-memory arithmetic. Routing never fails
a request: no hashes, no index or no stats just mean less information, down to plain least-loaded.

Ray Serve ships this module to routers *by value* (cloudpickle), globals included: module-level state
must therefore be reached through other modules (``router_metrics.X``), never imported into this one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

import kvmesh.router.metrics as router_metrics
from kvmesh.core.defaults import DEFAULT_PREFILL_TOK_S, PREDICT_TTL_S
from kvmesh.core.messages import GenerateCall, LoadReport
from kvmesh.router.baselines import make_policy
from kvmesh.router.index_schema import index_redis_url
from kvmesh.router.policy import Decision, ReplicaLoad, RouteRequest
from kvmesh.router.prefix_index import IndexAnswer, PrefixIndex
from kvmesh.router.recent_routes import MAX_TRACKED, RecentRoutes
from kvmesh.router.sessions import SESSION_DECAY_S

log = logging.getLogger(__name__)

PLANNED_TTL_S = 300.0
"""A decision Ray has not acted on for this long belongs to a request cancelled while it queued."""


def route_request(pending: PendingRequest | None) -> RouteRequest | None:
    """The routing view of a call ``handle.generate.remote(GenerateCall(...))``: hashes, size, session."""
    if pending is None or not pending.args or not isinstance(call := pending.args[0], GenerateCall):
        return None
    session = call.session_id or getattr(pending.metadata, "session_id", None) or None
    return RouteRequest(call.block_hashes, call.num_tokens, call.block_size, session, call.lora_name)


def _serving(
    adapter: str, replicas: list[RunningReplica], reports: list[LoadReport | None]
) -> tuple[list[RunningReplica], list[LoadReport | None]]:
    """The replicas that can serve ``adapter`` (a worker lists it, or a kvmesh engine reads any), with their
    reports; all of them where none can (the request then gets the worker's 404)."""
    keep = [i for i, rep in enumerate(reports) if rep is None or rep.lora_served is None or adapter in rep.lora_served]
    if not keep:
        return replicas, reports
    return [replicas[i] for i in keep], [reports[i] for i in keep]


def _priced_hits(decision: Decision, device_hits: dict[str, int] | None) -> dict[str, int]:
    """The leading blocks per replica the policy priced the request with, to count what is left to prefill
    where it goes: without the index (or before it has caught up) the policy's own memory of where it sent
    the prefix, or a conversation's next turn would count as a full prefill on its home and move the
    following turns off it."""
    return decision.device_hits if decision.device_hits is not None else device_hits or {}


class _Planned:
    """A decision made for a request Ray has not sent yet."""

    __slots__ = ("at", "decision", "device_hits", "index_ids", "request")

    def __init__(
        self,
        at: float,
        request: RouteRequest,
        device_hits: dict[str, int],
        index_ids: dict[ReplicaID, str],
        decision: Decision,
    ) -> None:
        self.at, self.request, self.device_hits, self.index_ids, self.decision = (
            at,
            request,
            device_hits,
            index_ids,
            decision,
        )


class KVAwareRequestRouter(RequestRouter):
    """Configured with ``RequestRouterConfig(request_router_kwargs={...})`` -> ``initialize_state``."""

    def initialize_state(
        self,
        redis_url: str | None = None,
        deployment: str = "kvmesh",
        model: str = "",
        policy: str = "kv_aware",
        policy_kwargs: dict | None = None,
        lookup_timeout_s: float = 0.02,
        max_tracked: int = MAX_TRACKED,
        report_period_s: float = 1.0,
        predict_ttl_s: float = PREDICT_TTL_S,
    ) -> None:
        self.policy = make_policy(policy, **(policy_kwargs or {}))
        redis_url = index_redis_url(redis_url)  # None: this process's $KVMESH_REDIS_URL
        decay_s = getattr(self.policy, "session_decay_s", SESSION_DECAY_S)
        self.index = (
            PrefixIndex(redis_url, deployment, model, timeout_s=lookup_timeout_s, session_decay_s=decay_s)
            if redis_url and self.policy.uses_index
            else None
        )
        self.policy_name = policy
        self.decisions: Counter[str] = Counter()
        router_metrics.register_router(self)
        self.predict_ttl_ms = int(predict_ttl_s * 1000)
        self._tasks: set[asyncio.Task] = set()
        self.routes = RecentRoutes(report_period_s, max_tracked)
        self._max_tracked = max_tracked
        self._planned: OrderedDict[str, _Planned] = OrderedDict()
        """Decisions waiting for Ray to send the request; a request cancelled while queued never is, so
        entries older than ``PLANNED_TTL_S`` go."""

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _index_id(replica: RunningReplica, report: LoadReport | None) -> str:
        """The id under which the replica publishes to the index (in its load report)."""
        return report.index_id if report is not None else replica.replica_id.unique_id

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        return self._load_from(replica, LoadReport.from_dict(replica.routing_stats))

    def _load_from(self, replica: RunningReplica, report: LoadReport | None) -> ReplicaLoad:
        """The router's view of ``replica``: its last report (parsed once per decision) and what this router
        sent it since."""
        load = (
            ReplicaLoad.from_report(report)
            if report is not None
            else ReplicaLoad(index_id=replica.replica_id.unique_id)
        )
        load.routed_requests, load.pending_prefill_tokens, load.routed_prefill_tokens = self.routes.queued(
            replica.replica_id,
            report.reported_at if report is not None else 0.0,
            load.pending_prefill_tokens,
            load.prefill_tok_s or DEFAULT_PREFILL_TOK_S,
        )
        if report is not None:
            load.report_age_s = max(0.0, time.time() - report.reported_at)
        return load

    # ------------------------------------------------------------------ routing
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        try:
            return await self._choose(candidate_replicas, pending_request)
        except Exception:  # a routing bug must cost one good decision, never the request
            log.exception("KV-aware routing failed; falling back to the candidates in order")
            self.decisions["router_error"] += 1
            return [candidate_replicas]

    async def _choose(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all full: wait, then retry
        if not candidate_replicas:
            return []
        req = route_request(pending_request)
        reports = [LoadReport.from_dict(r.routing_stats) for r in candidate_replicas]
        if req is not None and req.lora_name:
            candidate_replicas, reports = _serving(req.lora_name, candidate_replicas, reports)
        ids = [self._index_id(r, report) for r, report in zip(candidate_replicas, reports, strict=True)]
        by_id = dict(zip(ids, candidate_replicas, strict=True))
        if req is None:
            self.decisions["no_routing_info"] += 1
            candidates = [self._load_from(r, rep) for r, rep in zip(candidate_replicas, reports, strict=True)]
            return [[by_id[ld.index_id]] for ld in sorted(candidates, key=lambda ld: (ld.queue_s, ld.num_requests))]
        answer = IndexAnswer({})
        if self.policy.uses_index:
            if self.index is None:
                answer = IndexAnswer(None)
            elif req.block_hashes:
                with router_metrics.INDEX_LOOKUP_SECONDS.time():
                    answer = await self.index.query(req.block_hashes, list(by_id))
        device_hits = answer.device_hits
        # Loads are read after the lookup: decisions made while this one awaited Redis must count.
        candidates = [self._load_from(r, rep) for r, rep in zip(candidate_replicas, reports, strict=True)]
        decision = self.policy.rank(req, candidates, device_hits, answer.starts, answer.host_hits, answer.disk_hits)
        self.decisions[decision.reason] += 1
        if pending_request is not None:  # the call travels when Ray sends it: the replica it reaches reads its plan
            pending_request.args[0].fetches = decision.fetches or None
        # Tied replicas go as one group: Ray probes their live queue lengths (every router's requests, not
        # one report period old) and takes the shortest; on_request_routed re-tracks if it is not ours. Not
        # while other requests wait here to be routed (a burst): none of them has reached a replica, so the
        # probes read equal, Ray's pick among equals is arbitrary (not the first offered), and the burst's
        # other decisions, counting this request where it was offered first, pile onto wherever Ray sent it.
        group = decision.tied_group if self.num_pending_requests <= 1 else decision.tied_group[:1]
        if pending_request is not None:
            rid = pending_request.metadata.internal_request_id
            index_ids = {r.replica_id: index_id for r, index_id in zip(candidate_replicas, ids, strict=True)}
            self._plan(rid, _Planned(time.monotonic(), req, device_hits or {}, index_ids, decision))
            # Count it against the first choice now: concurrent decisions must see each other.
            first = group[0]
            self._track(rid, by_id[first].replica_id, req, _priced_hits(decision, device_hits), first)
        rest = [rid for rid in decision.ranked if rid not in group]  # one per group: Ray's fallbacks, in order
        return [[by_id[rid] for rid in group], *([by_id[rid]] for rid in rest)]

    def _background(self, coro) -> bool:
        """Fire-and-forget on the router's loop (the hook itself must not block); False if there is none."""
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return False
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _track(
        self, rid: str, replica_id: ReplicaID, req: RouteRequest, device_hits: dict[str, int], index_id: str
    ) -> None:
        # Re-tracked (moved) when Ray fell back to a later choice.
        self.routes.add(rid, replica_id, req.num_tokens - device_hits.get(index_id, 0) * req.block_size)

    def _plan(self, rid: str, planned: _Planned) -> None:
        self._planned[rid] = planned
        while self._planned and (
            len(self._planned) > self._max_tracked or next(iter(self._planned.values())).at < planned.at - PLANNED_TTL_S
        ):
            self._planned.popitem(last=False)

    # ------------------------------------------------------------------ lifecycle hooks
    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = pending_request.metadata.internal_request_id
        planned = self._planned.pop(rid, None)
        if planned is None or replica_id not in planned.index_ids:
            return
        req, device_hits = planned.request, planned.device_hits
        index_id = planned.index_ids[replica_id]
        if self.routes.where(rid) != replica_id:  # Ray fell back to a later choice
            self._track(rid, replica_id, req, _priced_hits(planned.decision, device_hits), index_id)
        self.policy.on_routed(req, index_id, planned.decision)
        if self.index is not None and req.block_hashes and device_hits.get(index_id, 0) < len(req.block_hashes):
            self._background(self.index.predict(req.block_hashes, index_id, self.predict_ttl_ms))
        if (
            self.index is not None
            and planned.decision.opens_session
            and self._background(self._start_session(index_id))
        ):
            self.policy.sessions.unacknowledged[index_id] += 1  # until Redis has it: a burst sees its own starts

    async def _start_session(self, index_id: str) -> None:
        try:
            await self.index.start_session(index_id)
        finally:
            self.policy.sessions.unacknowledged[index_id] -= 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._planned.pop(internal_request_id, None)
        self.routes.done(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.routes.drop(replica_id)
