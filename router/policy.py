"""Routing policies as plain objects: no Ray, no Redis, no torch.

The same objects drive the Ray Serve request router (``router/serve_router.py``) and the trace simulator,
so what is benchmarked is what is deployed. A policy sees the request (its block hashes, token count,
optional session id), the candidate replicas' load, and, for prefix-aware policies, the index's answer
(leading blocks held per replica, or ``None`` when the index is down). It returns candidates ranked best
first plus the reason for the choice, which is counted in metrics.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.core.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_PREFILL_TOK_S, PREDICT_TTL_S
from kvmesh.core.hashing import BlockHash
from kvmesh.core.messages import KVFetch, LoadReport
from kvmesh.router.sessions import SESSION_DECAY_S, SessionCounts

"""Prefill rate assumed for a replica that has not reported one yet (tokens/s)."""
DEFAULT_DECODE_S_PER_SEQ = 0.0005
"""Per running sequence, seconds it adds to every engine step, when not reported."""
FULL_PRESSURE_BUSY = 0.8
"""Prefill utilisation from which churn is priced at the full ``miss_weight`` (the load it was tuned at);
below it, less (``KVAwarePolicy._pressure``). Above it no higher: a saturated fleet is no reason never to
move (its queues are priced already)."""
DEFAULT_LORA_LOAD_S = 0.05
"""Seconds a replica that has not measured it is assumed to take to read a LoRA adapter."""
ADAPTERS_REMEMBERED = 64
"""Per replica, the adapters a router remembers sending it requests on (the most recent)."""
_NO_FETCH: tuple[None, int, float] = (None, 0, 0.0)
"""``KVAwarePolicy._fetch``'s answer where a replica would recompute: no plan, no tokens, no seconds."""


@dataclass
class RouteRequest:
    block_hashes: list[BlockHash]
    num_tokens: int
    block_size: int = DEFAULT_BLOCK_SIZE
    session_id: str | None = None
    lora_name: str | None = None
    """The LoRA adapter the request runs on; None: the base model."""


_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(LoadReport))


@dataclass(kw_only=True)
class ReplicaLoad(LoadReport):
    """What the router knows of one replica: its last ``LoadReport`` plus what it routed there since.

    Unknown ``cache_fill`` counts as full (every new block evicts a cached one): the conservative, sticky
    assumption. ``kv_free_blocks`` None: room is assumed. Unmeasured rates: the peers' median, else the
    module defaults.
    """

    routed_requests: int = 0
    """Routed by this router since the replica's last report."""
    routed_prefill_tokens: int = 0
    report_age_s: float = 0.0
    """Seconds since the report was taken: the sequences it counted running have decoded since."""

    @classmethod
    def from_report(cls, report: LoadReport) -> ReplicaLoad:
        """The router's view of a replica from its last report (what it sent since is added by the router)."""
        return cls(**{name: getattr(report, name) for name in _REPORT_FIELDS})

    @property
    def queue_s(self) -> float:
        """Seconds before a new request's first token could start: queued prefill, slowed by every running
        sequence, plus the wait for a free batch slot once the replica already holds ``max_num_seqs``."""
        return self.queue_s_at(None)

    def queue_s_at(self, routed_tok_s: float | None) -> float:
        """``queue_s`` with the prefill routed here since the report priced at ``routed_tok_s`` (None: the
        replica's own rate, like the reported backlog)."""
        prefill_rate = max(self.prefill_tok_s or DEFAULT_PREFILL_TOK_S, 1e-6)
        routed_rate = max(routed_tok_s, 1e-6) if routed_tok_s else prefill_rate
        prefill = self.pending_prefill_tokens / prefill_rate + self.routed_prefill_tokens / routed_rate
        running = min(self.num_requests, self.max_num_seqs)
        return prefill + running * (self.decode_s_per_seq or DEFAULT_DECODE_S_PER_SEQ) + self.slot_wait_s

    @property
    def slot_wait_s(self) -> float:
        """Seconds a newcomer waits for a batch slot once the replica holds ``max_num_seqs``: until the soonest
        running sequence ends where the report says (``slot_free_steps``), then one mean lifetime spread over
        the batch per request ahead of it (ends staggered); all of it from the mean where it does not."""
        excess = max(0, self.num_requests + 1 - self.max_num_seqs)
        between_ends = self.mean_output_tokens / max(self.max_num_seqs, 1) * self.step_s
        if not excess or self.slot_free_steps is None:
            return excess * between_ends
        return max(self.slot_free_steps * self.step_s - self.report_age_s, 0.0) + (excess - 1) * between_ends

    def kv_wait_s(self, tokens: int, block_size: int) -> float:
        """Seconds a newcomer needing ``tokens`` of new KV would wait for running sequences to free blocks.

        Queued prefill (``queue_s``) does not show it: a replica whose one running request is decoding has
        an empty queue but may have no room for a long prompt, which then waits for that request to finish
        while another replica's pool sits empty. Running sequences finish spread over one decode lifetime
        (``mean_output_tokens`` steps), so freeing a fraction f of the pinned blocks takes ~f of it, counted
        from when the report was taken: a report from while a short request ran must not keep its replica
        looking full after it finished.
        """
        if self.kv_free_blocks is None or not self.kv_total_blocks:
            return 0.0
        free = self.kv_free_blocks - self.routed_prefill_tokens / block_size  # routed since the report
        shortfall = -(-tokens // block_size) - free
        if shortfall <= 0:
            return 0.0
        pinned = max(self.kv_total_blocks - self.kv_free_blocks, 1)
        return max(min(shortfall / pinned, 1.0) * self.mean_output_tokens * self.step_s - self.report_age_s, 0.0)

    @property
    def num_requests(self) -> int:
        """Requests it holds or will: running, waiting, and routed by this router since its report."""
        return self.num_running + self.num_waiting + self.routed_requests


@dataclass
class Decision:
    ranked: list[str]
    """Replica ids, best first: the caller tries them in order (a full replica falls to the next)."""
    reason: str
    """Why the first was chosen: hit, host_hit, fetch, load_override, miss, session, index_unavailable_*
    (counted in metrics)."""
    matched_blocks: int = 0
    costs: dict[str, float] = field(default_factory=dict)
    tied: int = 1
    """How many of the first ``ranked`` are interchangeable on what the router knows: the caller lets a
    fresher signal choose among them (Ray probes their live queue lengths)."""
    tie_order: list[str] | None = None
    """The tied replicas in the order to offer them, the one this router used least recently first (None:
    ``ranked``'s): where the fresher signal is equal too, the first wins, and cost differences within a tie
    (a gauge one poll stale) would otherwise hand it the same replica every time."""
    opens_session: bool = False
    """A new conversation on a shared prefix (some replica holds part of the prompt, none half of it: its
    own history; or it branches off a prefix conversations grow from): counted as a conversation start
    where it goes."""
    known_blocks: int = 0
    """Leading blocks of the prompt this router had routed before (its own memory, not the index's)."""
    device_hits: dict[str, int] | None = None
    """Leading blocks each replica holds as priced: the index's answer extended by this router's recent
    decisions, or those alone without the index (None: the policy used the index's answer as given)."""
    fetches: dict[str, KVFetch] = field(default_factory=dict)
    """Per replica of ``ranked`` whose price counted on pulling prefix blocks from a peer, the plan: the holder
    and the leading block to pull up to (the replica pulls those it lacks), for the caller to hand on with the call
    (``GenerateCall.fetches``)."""

    @property
    def tied_group(self) -> list[str]:
        """The near-tied replicas, in the order to offer them."""
        return self.tie_order or self.ranked[: self.tied]


class RoutingPolicy(Protocol):
    name: str
    uses_index: bool

    def rank(
        self,
        req: RouteRequest,
        replicas: list[ReplicaLoad],
        device_hits: dict[str, int] | None,
        shared_starts: dict[str, float] | None = None,
        host_hits: dict[str, int] | None = None,
        disk_hits: dict[str, int] | None = None,
        fleet_size: int | None = None,
    ) -> Decision:
        """Candidates best first. ``device_hits``: leading blocks each holds on its device (None: the index did not
        answer); ``shared_starts``: recent conversation starts per replica across routers (the index's
        counts); ``host_hits``: blocks past ``device_hits`` each replica's host tier holds; ``disk_hits``:
        blocks past those its disk tier holds; ``fleet_size``: how many replicas serve, where ``replicas``
        is a shortlist of them (None: ``replicas`` is the fleet)."""
        ...

    def on_routed(self, req: RouteRequest, index_id: str, decision: Decision) -> None: ...


class KVAwarePolicy:
    """Ours: minimise the expected time to first token, in seconds.

    ``cost(r) = queue_s(r) + kv_wait_s(r) + uncached_tokens(r) / prefill_rate(r)
               + host_tokens(r) / host_load_rate(r)
               + max((miss_weight - 1) * cache_fill(r) * pressure, busy) * uncached_tokens(r) / median_prefill_rate
               + decode_weight * mean_output_tokens(r) * load(r) * decode_s_per_seq(r)``
    ``busy = busy_weight * median_queue_s / (num_tokens / median_prefill_rate)``
    ``pressure = min(u / 0.8, 1) ** 2``, ``u`` the replicas' median measured prefill utilisation

    A prefix in a replica's host tier (``host_hits``) is charged what loading it back costs at the rate that
    replica measured and reported, not a fixed fraction of a hit: on equal load a device hit beats a host
    hit beats a miss, and a host hit on an idle replica beats a device hit behind a long queue.
    On such a replica the blocks a miss evicts go to its host tier, so the churn part of the fifth term is
    scaled by the reload / recompute cost ratio. ``host_tier=False`` routes blind to the tier (host hits
    priced as misses, evictions as losses), for comparison. A chain continuing onto a replica's disk tier
    (``disk_hits``) is charged at the disk load rate it reports, where that beats recomputing.
    With ``peer_fetch``, the part of the prefix another replica serving KV blocks (``kv_address``) holds
    beyond a replica's own is charged what pulling it costs there (``fetch_tok_s``, plus one step of the
    holder's), where that beats recomputing it: a fetch is no fleet compute, so no churn or busy charge.

    The fifth term prices what a miss costs others, at the fleet's median rate: the cache churn it causes
    (it evicts other prefixes, which later requests miss), in proportion to how full the pool is and to how
    much a recompute later delays others (``pressure``: 1 on a fleet whose prefill is 80% busy or more, where
    ``miss_weight`` was tuned; near 0 on an idle one, where a recompute costs only its own time), or, when
    more, the delay its extra prefill adds to the requests queued behind it on a busy fleet. The last
    term, off by default, charges a newcomer the decode speed it would take from the sequences already
    there.

    A request on a LoRA adapter pays, where a replica does not hold the adapter (``loras``, with this router's
    own sends since), the time it takes to read one (``lora_load_s``, x ``adapter_weight``; 0: adapter-blind),
    twice where the read evicts a live adapter: a cold adapter stays where it is held, a hot one spreads once
    its holder's queue costs more.

    Around the cost: a replica holding most of the request (its conversation history), or the one its
    session last went to, keeps it unless another is cheaper by more than ``override_margin_s``; new
    conversations on a shared prefix are placed with bounded loads (``session_balance`` x the fair share of
    recent starts, ``router/sessions.py``); on fleets of ``history_min_replicas`` or more, a
    conversation's turn prices the recompute of the history a replica lacks at least ``history_weight x
    pressure`` (churn priced by fill calls it free while caches have room, and a wide fleet always has an
    idle replica to move to), and the sole holder of a short prefix may take one start beyond the bound;
    replicas caching as much as the cheapest and costing at most ``tie_margin`` x the request's own prefill
    more are reported as tied, for the caller to let a fresher signal choose. A one-off request on a prefix
    many requests branch off (a document, a few-shot or tenant prompt; not a conversation's history) goes
    nowhere its own expected wait (queue, KV wait, its own prefill) exceeds ``wait_cap`` x the best on offer:
    a burst on a hot prefix copies it to a second replica rather than queueing behind its holder. Without the
    index's answer the policy falls back to the prefix ownership it remembers from its own recent decisions.
    ``docs/routing.md`` explains each term and the measurements behind the defaults.
    """

    name = "kv_aware"
    uses_index = True

    def __init__(
        self,
        miss_weight: float = 16.0,
        decode_weight: float = 0.0,
        override_margin_s: float = 0.005,
        predict_ttl_s: float = PREDICT_TTL_S,
        memory_size: int = 65536,
        session_balance: float = 1.25,
        session_decay_s: float = SESSION_DECAY_S,
        tie_margin: float = 1.0,
        busy_weight: float = 2.0,
        host_tier: bool = True,
        wait_cap: float = 2.0,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        history_weight: float = 16.0,
        history_min_replicas: int = 32,
        peer_fetch: bool = True,
        disaggregate_tokens: int = 1024,
        decode_protect: float = 1.0,
        adapter_weight: float = 1.0,
    ) -> None:
        weights = (miss_weight, decode_weight, override_margin_s, tie_margin, busy_weight, history_weight)
        if min(*weights, adapter_weight) < 0:
            raise ValueError(
                "miss_weight, decode_weight, override_margin_s, tie_margin, busy_weight, history_weight and "
                "adapter_weight must be >= 0"
            )
        self.adapter_weight = adapter_weight
        if history_min_replicas < 1:
            raise ValueError("history_min_replicas must be >= 1")
        self.history_weight = history_weight
        self.history_min_replicas = history_min_replicas
        self.busy_weight = busy_weight
        self.host_tier = host_tier
        self.peer_fetch = peer_fetch
        self.disaggregate_tokens = disaggregate_tokens
        self.decode_protect = decode_protect
        self.wait_cap = wait_cap
        if session_balance and session_balance < 1:
            raise ValueError("session_balance must be 0 (off) or >= 1")
        if wait_cap and wait_cap < 1:
            raise ValueError("wait_cap must be 0 (off) or >= 1")
        self.session_balance = session_balance
        self.sessions = SessionCounts(session_decay_s, clock=clock)
        self.miss_weight = miss_weight
        self.decode_weight = decode_weight
        self.override_margin_s = override_margin_s
        self.tie_margin = tie_margin
        self.predict_ttl_s = predict_ttl_s
        self._recent = _RecentOwners(memory_size, clock)
        self._rng = random.Random(seed)  # seeded only to make simulations reproducible
        self._clock = clock
        self._adapters_sent: dict[str, OrderedDict[str, float]] = {}
        """Per replica, the adapters this router last sent it requests on and when (oldest first): what it
        reads and evicts before its next report says so."""
        self._chosen: dict[str, int] = {}
        """When this router last sent a request to each replica (a decision count): equal costs go to the
        one it used least recently, so idle replicas take new work in turn instead of by chance."""
        self._decisions = 0

    @property
    def session_decay_s(self) -> float:
        return self.sessions.decay_s

    def rank(
        self,
        req: RouteRequest,
        replicas: list[ReplicaLoad],
        device_hits: dict[str, int] | None,
        shared_starts: dict[str, float] | None = None,
        host_hits: dict[str, int] | None = None,
        disk_hits: dict[str, int] | None = None,
        fleet_size: int | None = None,
    ) -> Decision:
        """Replicas from cheapest to dearest for ``req``: price each, keep the holder on noise, cap the wait
        of a one-off request on a shared prefix, bound where new conversations start, group near-ties, and
        keep a conversation at its home."""
        if not replicas:
            raise ValueError("no replicas to route to")
        fill_unmeasured_rates(replicas)
        reason_prefix = "index_unavailable_" if device_hits is None else ""
        device_hits, known = self._merged_hits(req, [r.index_id for r in replicas], device_hits)
        depth, on_disk = self._depths(req, replicas, device_hits, host_hits, disk_hits)
        median_rate = sorted(max(r.prefill_tok_s or 1.0, 1e-6) for r in replicas)[len(replicas) // 2]
        pressure = self._pressure(replicas)
        costs, own_prefill_s, own_s, churn, fetches = self._price(
            req, replicas, device_hits, depth, on_disk, median_rate, pressure
        )
        if self.peer_fetch and self.disaggregate_tokens:
            self._disaggregate(req, replicas, costs, own_prefill_s, own_s, fetches)
        _drop_prefill_only(replicas, costs)
        # Equal costs (and near-ties, in tie_order): the replica this router used least recently, then chance.
        jitter = {rid: (self._chosen.get(rid, -1), self._rng.random()) for rid in costs}
        ranked = sorted(costs, key=lambda rid: (costs[rid], jitter[rid]))
        holder = max(ranked, key=lambda rid: depth[rid])  # longest match (either tier); cheapest among equals
        holder_share = depth[holder] * req.block_size / max(req.num_tokens, 1)
        # A new conversation on a shared prefix: some replica holds part, none its history; or it branches off
        # a prefix conversations grow from, held nowhere deeper than this router routed it (another router
        # may have routed its earlier turns).
        branches = self.sessions.branches
        fork = req.block_hashes[min(depth[holder], len(req.block_hashes)) - 1] if depth[holder] else None
        history = self.history_weight > 0 and (fleet_size or len(replicas)) >= self.history_min_replicas
        short = 0 < holder_share < 0.5
        opens = short or (depth[holder] <= known and branches.opens(req.block_hashes, known))
        own = holder if short and history and not self._looks_shared(fork, depth, holder) else None
        if not opens and history and fork is not None and branches.fresh(fork):
            floor = self.history_weight * pressure
            per_block = {rid: max(floor - c, 0.0) * req.block_size / median_rate for rid, c in churn.items()}
            ranked = self._price_history(costs, depth, holder, per_block, jitter)
        if not opens:
            ranked = self._keep_holder(ranked, holder, costs)
            if self.wait_cap and 0 < depth[holder] <= known and branches.shared(fork):
                ranked = self._cap_wait(ranked, own_s)
        capped: set[str] = set()
        if opens and self.session_balance:
            starts, crowded = self.sessions.starts(ranked, shared_starts), self._crowded(req, replicas)
            ranked, capped = self._bounded(ranked, starts, own, crowded)
        best_hit, chosen_hit = max(depth.values(), default=0), depth[ranked[0]]
        reason = "miss" if best_hit == 0 else "hit" if chosen_hit == best_hit else "load_override"
        if reason == "hit" and device_hits.get(ranked[0], 0) < chosen_hit:
            reason = "host_hit"  # served in part from its host tier
        if ranked[0] in fetches:
            reason = "disaggregated" if fetches[ranked[0]].prefill else "fetch"  # a peer prefills / holds it
        # Where the first holds the request's adapter, none that must read it first is a tie.
        reads = {r.index_id for r in replicas if self._adapter_s(req, r)[0]} if req.lora_name else set()
        untied = capped if ranked[0] in reads else capped | reads
        tied = self._ties(ranked, untied, depth, costs, own_prefill_s, replicas)
        home = self.sessions.home(req.session_id)
        if home in costs and home != ranked[0] and costs[home] - costs[ranked[0]] <= self.override_margin_s:
            ranked, tied, reason_prefix = [home, *(rid for rid in ranked if rid != home)], 1, ""
            reason = ("disaggregated" if fetches[home].prefill else "fetch") if home in fetches else "session"
        order = sorted(ranked[:tied], key=jitter.__getitem__) if tied > 1 else None
        return Decision(
            ranked, reason_prefix + reason, chosen_hit, costs, tied, order, opens, known, device_hits, fetches
        )

    def _merged_hits(
        self, req: RouteRequest, ids: list[str], device_hits: dict[str, int] | None
    ) -> tuple[dict[str, int], int]:
        """Leading blocks each replica holds, by the index and by this router's recent decisions, and how
        many of the request's blocks this router knows it routed. Without the index (``device_hits`` None), memory
        alone answers."""
        if device_hits is None:
            return self._recent.match(req.block_hashes, ids)
        # What we just routed may not have reached the index yet: recent decisions extend its answer, never
        # contradict it. A candidate it has no answer for (no live heartbeat: its publisher stalled or lost
        # Redis for a moment) is answered from memory, as when the whole index is down.
        unknown = [rid for rid in ids if rid not in device_hits]
        remembered = self._recent.match(req.block_hashes, unknown)[0] if unknown else {}
        predicted, known = self._recent.match(req.block_hashes, ids, self.predict_ttl_s)
        if self.predict_ttl_s <= 0:
            predicted = dict.fromkeys(ids, 0)
        indexed = max((device_hits.get(rid, 0) for rid in ids), default=0)
        merged = {
            rid: remembered[rid]
            if rid in remembered
            else max(device_hits[rid], predicted[rid] if predicted[rid] > indexed else 0)
            for rid in ids
        }
        return merged, known

    def _price(
        self,
        req: RouteRequest,
        replicas: list[ReplicaLoad],
        device_hits: dict[str, int],
        depth: dict[str, int],
        on_disk: dict[str, int],
        median_rate: float,
        pressure: float,
    ) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float], dict[str, KVFetch]]:
        """Each replica's cost (seconds to the first token plus what the miss costs others), its own prefill
        (load from the host tier and fetch from a peer included), its own wait (queue, KV room, prefill), the
        churn weight its uncached tokens were charged and, where its price counts on one, the fetch plan;
        ``median_rate`` and ``pressure`` are the fleet's median prefill rate and churn pressure."""
        costs, own_prefill_s, own_s, churns, fetches = {}, {}, {}, {}, {}
        rates = {r.index_id: max(r.prefill_tok_s or 1.0, 1e-6) for r in replicas}
        # What this router sent since a replica's report is priced at the fleet's median rate, not the
        # replica's own: identical replicas' measured rates differ several-fold (one warm-up step each, on
        # shared cores), and priced per replica a burst of new prompts multiplies that difference by its
        # size until the replica measured fastest takes most of it (4 or 5 of 6 new conversations on 3).
        queues = {r.index_id: r.queue_s_at(median_rate) for r in replicas}
        # A miss's extra prefill also delays whoever queues behind it: on a fleet whose typical (median)
        # queue holds q jobs of this request's size, each second of work costs about q seconds of others'
        # waiting. The median, not the mean: one overloaded replica does not make its idle peers busy.
        typical_s = max(req.num_tokens / median_rate, 1e-6)
        # Prefill work queued, that is: a full batch's wait for a slot holds no prefill back.
        prefill_queues = sorted(queues[r.index_id] - r.slot_wait_s for r in replicas)
        busy = self.busy_weight * prefill_queues[len(prefill_queues) // 2] / typical_s
        sources = self._sources(replicas, depth, queues) if self.peer_fetch else []
        own_weight = min(self.miss_weight, 1.0)
        most = max(req.num_tokens - 1, 0)  # the last token is always computed
        for r in replicas:
            rid = r.index_id
            cached = min(device_hits.get(rid, 0) * req.block_size, most)
            hosted = min(depth[rid] * req.block_size, most) - cached
            uncached = req.num_tokens - cached - hosted
            disked = min(on_disk.get(rid, 0) * req.block_size, hosted)  # the chain's last loaded blocks
            load_s = (hosted - disked) / r.host_load_tok_s if hosted > disked else 0.0
            load_s += disked / r.disk_load_tok_s if disked else 0.0
            churn = churns[rid] = self._churn(r, rates[rid], pressure, busy)
            per_token = own_weight / rates[rid] + churn / median_rate  # a recompute's, to itself and others
            plan, fetched, fetch_s = self._fetch(req, r, sources, cached + hosted, per_token) if sources else _NO_FETCH
            if plan is not None:
                fetches[rid] = plan
            recomputed = uncached - fetched
            read_s, evict_s = self._adapter_s(req, r)
            own_prefill_s[rid] = recomputed / rates[rid] + load_s + fetch_s + read_s
            prefill_s = own_weight * own_prefill_s[rid] + churn * recomputed / median_rate
            decode_s = self.decode_weight * r.mean_output_tokens * r.num_requests * (r.decode_s_per_seq or 0.0)
            kv_wait = r.kv_wait_s(uncached + hosted + 1, req.block_size)  # fetched blocks need room too
            costs[rid] = queues[rid] + kv_wait + prefill_s + decode_s + evict_s
            own_s[rid] = queues[rid] + kv_wait + own_prefill_s[rid]
        return costs, own_prefill_s, own_s, churns, fetches

    def _adapter_s(self, req: RouteRequest, r: ReplicaLoad) -> tuple[float, float]:
        """Seconds ``r`` spends reading the request's adapter before it can start (none where it holds it, as
        far as this router knows: ``_ready``), and what the read costs others: where ``r``'s adapter slots are
        full it evicts the least recently used adapter, and if that one is live (this router sent it a request
        within a conversation's live time) the next turn on it reads it again. Evicting an idle adapter costs
        nothing now: charged alike, it would only pull new conversations onto the replicas already busiest
        with live ones, where their adapters take turns evicting each other."""
        name = req.lora_name
        if name is None or not self.adapter_weight:
            return 0.0, 0.0
        held = self._ready(r)
        if name in held:
            return 0.0, 0.0
        read_s = self.adapter_weight * (r.lora_load_s or DEFAULT_LORA_LOAD_S)
        full = r.lora_slots and len(held) >= r.lora_slots
        return read_s, read_s if full and self._live(r.index_id, held[0]) else 0.0

    def _live(self, index_id: str, adapter: str) -> bool:
        """Whether this router sent ``index_id`` a request on ``adapter`` within a conversation's live time."""
        at = self._adapters_sent.get(index_id, {}).get(adapter)
        return at is not None and self._clock() - at <= self.sessions.live.live_s

    def _ready(self, r: ReplicaLoad) -> list[str]:
        """The adapters ``r`` holds as this router expects, least recently used first: its report's, then each
        adapter this router sent it a request on since (within ``predict_ttl_s`` before the report too, for
        requests still on their way), the least recently used out once its slots are full. Without the
        evictions a burst would send requests to replicas whose report still names an adapter a read just
        evicted, and every such request reads it again."""
        sent = self._adapters_sent.get(r.index_id)
        if not sent:
            return r.loras
        horizon = self._clock() - r.report_age_s - self.predict_ttl_s
        held = list(r.loras)
        for name, at in sent.items():
            if at < horizon:
                continue
            if name in held:
                held.remove(name)
            held.append(name)
            if r.lora_slots and len(held) > r.lora_slots:
                held.pop(0)
        return held

    def _disaggregate(
        self,
        req: RouteRequest,
        replicas: list[ReplicaLoad],
        costs: dict[str, float],
        own_prefill_s: dict[str, float],
        own_s: dict[str, float],
        fetches: dict[str, KVFetch],
    ) -> None:
        """Where it pays, plan a replica's request as prefilled on another and fetched (``KVFetch.prefill``).

        Colocated, a replica's prefill of what it lacks takes ``own_s`` to the first token and stalls each of
        its running streams for the prefill's length. Disaggregated, the replica that prefills this prompt
        soonest (its own wait, a dedicated prefill replica first among equals) computes it, and the decoding
        replica pulls the blocks: the first token comes after that prefill and the fetch (or the decoder's own
        queue, if longer), and only the prefill replica's streams stall. Each stall counts ``decode_protect``
        seconds per stream; a replica takes the plan, and its cost drops by the saving, where the plan's total
        is lower. Only for prompts with ``disaggregate_tokens`` or more left to compute there."""
        by_id = {r.index_id: r for r in replicas}
        serving = [r for r in replicas if r.kv_address]
        # The two soonest prefillers, found once (no candidate prefills for itself): O(n) per decision.
        soonest = heapq.nsmallest(2, serving, key=lambda s: (own_s[s.index_id], s.role != "prefill"))
        if not soonest:
            return
        most = max(req.num_tokens - 1, 0) // req.block_size
        for rid in costs:
            r = by_id[rid]
            prefill = own_prefill_s[rid] * (r.prefill_tok_s or DEFAULT_PREFILL_TOK_S)  # tokens it would compute
            fast = r.fetch_tok_s and r.fetch_tok_s > (r.prefill_tok_s or 0.0)
            if r.role == "prefill" or prefill < self.disaggregate_tokens or not fast or rid in fetches:
                continue
            p = next((s for s in soonest if s.index_id != rid), None)
            if p is None:
                continue
            fetch_s = req.num_tokens / r.fetch_tok_s + p.step_s
            colocated = own_s[rid] + self.decode_protect * r.num_running * own_prefill_s[rid]
            split_s = max(own_s[p.index_id] + fetch_s, own_s[rid] - own_prefill_s[rid])
            split = split_s + self.decode_protect * p.num_running * own_prefill_s[p.index_id]
            if split < colocated:
                costs[rid] -= colocated - split
                fetches[rid] = KVFetch(
                    holder=p.index_id, address=p.kv_address, num_blocks=most, prefill=True, expected_s=split_s
                )

    def _churn(self, r: ReplicaLoad, rate: float, pressure: float, busy: float) -> float:
        """The weight each token ``r`` recomputes is charged for others (at the median rate): the prefixes it
        evicts, in proportion to how full its pool is and to ``pressure``, or, when more, the delay its extra
        prefill adds to those queued (``busy``)."""
        fill = min(max(r.cache_fill, 0.0), 1.0)
        evictions = max(self.miss_weight - 1.0, 0.0) * fill * pressure
        if self._tiered(r):  # what it evicts goes to the host tier: later requests reload it, not recompute
            evictions *= rate / r.host_load_tok_s
        return max(evictions, busy)

    @staticmethod
    def _sources(
        replicas: list[ReplicaLoad], depth: dict[str, int], queues: dict[str, float]
    ) -> list[tuple[ReplicaLoad, KVFetch]]:
        """Where a replica would pull the request's prefix from, with the plan to pull from each (up to its
        depth): of those serving KV blocks (``kv_address``), the two holding it deepest, the least queued
        first among equal depths (two: none pulls from itself)."""
        serving = [r for r in replicas if r.kv_address and depth[r.index_id]]
        deepest = heapq.nsmallest(2, serving, key=lambda r: (-depth[r.index_id], queues[r.index_id]))
        return [(h, KVFetch(holder=h.index_id, address=h.kv_address, num_blocks=depth[h.index_id])) for h in deepest]

    def _fetch(
        self,
        req: RouteRequest,
        r: ReplicaLoad,
        sources: list[tuple[ReplicaLoad, KVFetch]],
        held: int,
        per_token: float,
    ) -> tuple[KVFetch | None, int, float]:
        """The fetch ``r`` would make instead of recomputing, the tokens it brings (those the holder has past
        the ``held`` ones ``r`` serves itself) and their seconds: at ``r``'s fetch rate, plus one step of the
        holder's (it exports between its steps). Made where that costs less than recomputing them at
        ``per_token`` (a fetch is no compute: it charges others nothing); else ``(None, 0, 0.0)``."""
        if not r.fetch_tok_s or r.fetch_tok_s <= (r.prefill_tok_s or 0.0):
            return _NO_FETCH
        source = sources[0] if sources[0][0] is not r else sources[1] if len(sources) > 1 else None  # not itself
        if source is None:
            return _NO_FETCH
        holder, plan = source
        tokens = min(plan.num_blocks * req.block_size, max(req.num_tokens - 1, 0)) - held
        seconds = tokens / r.fetch_tok_s + holder.step_s
        if tokens <= 0 or min(self.miss_weight, 1.0) * seconds >= tokens * per_token:
            return _NO_FETCH
        return plan, tokens, seconds

    def _looks_shared(self, fork: BlockHash, depth: dict[str, int], holder: str) -> bool:
        """With ``history_weight`` on a wide fleet: whether a prefix held short of half the prompt is a
        shared one (a system prompt) rather than perhaps a conversation's history that the new turn outgrew:
        another replica holds it as deep, or requests branched off it here. Where it is not, its holder may
        take one start beyond the bound: at hundreds of replicas the fair share is about one conversation, and
        the bound would otherwise move every turn that adds more than it resends off its history (counting
        such a turn as a continuation instead cost new conversations on a prefix one replica holds their
        spreading: `docs/routing.md`)."""
        return any(d >= depth[holder] for rid, d in depth.items() if rid != holder) or self.sessions.branches.shared(
            fork
        )

    @staticmethod
    def _price_history(
        costs: dict[str, float],
        depth: dict[str, int],
        holder: str,
        per_block: dict[str, float],
        jitter: dict[str, tuple],
    ) -> list[str]:
        """Charge each replica ``per_block[rid]`` for each block of the history it lacks, and re-rank.

        ``per_block`` tops the churn already charged up to ``history_weight x pressure`` x one block's
        recompute at the median rate: leaving a conversation's history costs the fleet that work again,
        whether or not caches are full (the churn term's fill weighting calls it free while they have room)."""
        for rid in costs:
            costs[rid] += (depth[holder] - depth[rid]) * per_block[rid]
        return sorted(costs, key=lambda rid: (costs[rid], jitter[rid]))

    def _keep_holder(self, ranked: list[str], holder: str, costs: dict[str, float]) -> list[str]:
        """The replica holding the most keeps the request unless another is clearly cheaper (hysteresis: no
        churn on noise)."""
        if holder != ranked[0] and costs[holder] - costs[ranked[0]] <= self.override_margin_s:
            return [holder, *(rid for rid in ranked if rid != holder)]
        return ranked

    def _cap_wait(self, ranked: list[str], own_s: dict[str, float]) -> list[str]:
        """A one-off request on a shared prefix waits for its own sake at most ``wait_cap`` x the best own
        wait on offer: under a burst the prefix is copied to a second replica instead of queueing behind it."""
        limit = self.wait_cap * min(own_s.values()) + 1e-9
        return [rid for rid in ranked if own_s[rid] <= limit] + [rid for rid in ranked if own_s[rid] > limit]

    def _ties(
        self,
        ranked: list[str],
        capped: set[str],
        depth: dict[str, int],
        costs: dict[str, float],
        own_prefill_s: dict[str, float],
        replicas: list[ReplicaLoad],
    ) -> int:
        """How many leading replicas are near-ties (same hit, cost within ``tie_margin`` x the first's own
        prefill), handed to Ray as one group to choose by live queue length."""
        tied = 1
        if not self.tie_margin or ranked[0] in capped:
            return tied
        limit = costs[ranked[0]] + self.tie_margin * own_prefill_s[ranked[0]] + 1e-9
        # Requests this router sent that no probe can see yet (not arrived): never tie across them, or a
        # burst of concurrent decisions would all probe zeros and pile onto one replica.
        own = {r.index_id: r.routed_requests for r in replicas}
        chosen_hit = depth[ranked[0]]
        for rid in ranked[1:]:
            if rid in capped or depth[rid] != chosen_hit or costs[rid] > limit or own[rid] != own[ranked[0]]:
                break
            tied += 1
        return tied

    @staticmethod
    def _pressure(replicas: list[ReplicaLoad]) -> float:
        """The share of ``miss_weight`` churn is priced at: 1 on a busy fleet, little on an idle one.

        An evicted prefix is recomputed when it is next asked for. On an idle fleet that costs the asker its
        own prefill; on a busy one it also delays everyone queued behind it, more the busier the fleet.
        ``(u / FULL_PRESSURE_BUSY) ** 2`` at the replicas' median prefill utilisation ``u`` priced it best in
        the simulator (``docs/routing.md``). Unreported: 1.
        """
        busy = sorted(r.prefill_busy for r in replicas if r.prefill_busy is not None)
        if not busy:
            return 1.0
        return min(max(busy[len(busy) // 2], 0.0) / FULL_PRESSURE_BUSY, 1.0) ** 2

    def _depths(
        self,
        req: RouteRequest,
        replicas: list[ReplicaLoad],
        device_hits: dict[str, int],
        host: dict[str, int] | None,
        disk: dict[str, int] | None = None,
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica, the leading blocks it can serve without recomputing: its device hits, continued by
        its host tier where the policy counts that tier and loading beats recomputing on that replica, then
        by its disk tier where reading and loading beat recomputing; and how many of them are on disk."""
        depth = {r.index_id: device_hits.get(r.index_id, 0) for r in replicas}
        on_disk: dict[str, int] = {}
        for r in replicas:
            rid = r.index_id
            if not self._tiered(r):
                continue
            hosted = host.get(rid, 0) if host else 0
            depth[rid] += hosted
            if disk and disk.get(rid) and r.disk_load_tok_s and r.disk_load_tok_s > (r.prefill_tok_s or 0.0):
                on_disk[rid] = disk[rid]
                depth[rid] += disk[rid]
        return depth, on_disk

    def _tiered(self, r: ReplicaLoad) -> bool:
        """Whether the policy counts ``r``'s host tier: it has one, and loading from it beats recomputing."""
        return self.host_tier and bool(r.host_load_tok_s) and r.host_load_tok_s > (r.prefill_tok_s or 0.0)

    def on_routed(self, req: RouteRequest, index_id: str, decision: Decision) -> None:
        self._decisions += 1
        self._chosen[index_id] = self._decisions
        self._recent.record(req.block_hashes, index_id)
        if req.lora_name is not None:
            sent = self._adapters_sent.setdefault(index_id, OrderedDict())
            sent[req.lora_name] = self._clock()
            sent.move_to_end(req.lora_name)
            while len(sent) > ADAPTERS_REMEMBERED:
                sent.popitem(last=False)
        conversation, continued = self.sessions.branches.routed(req.block_hashes, decision.known_blocks)
        blocks = len(req.block_hashes)
        self.sessions.routed(req.session_id, index_id, decision.opens_session, conversation, continued, blocks)

    def _crowded(self, req: RouteRequest, replicas: list[ReplicaLoad]) -> set[str]:
        """The replicas whose KV pool cannot hold the new conversation beside the histories of the live ones
        this router sent there: placed there, it would evict theirs (their next turns recompute) while they
        evict its own. None when every replica is so (then counts alone decide)."""
        held = self.sessions.live.blocks([r.index_id for r in replicas])
        need = len(req.block_hashes)
        crowded = {r.index_id for r in replicas if r.kv_total_blocks and held[r.index_id] + need > r.kv_total_blocks}
        return crowded if len(crowded) < len(replicas) else set()

    def _bounded(
        self,
        ranked: list[str],
        starts: dict[str, float],
        own: str | None = None,
        crowded: frozenset | set = frozenset(),
    ) -> tuple[list[str], set[str]]:
        """``ranked`` with the replicas at their conversation cap, or ``crowded``, moved last (order kept
        otherwise), and them. ``own``, the sole holder of a short prefix on a wide fleet, may take one start
        more: the request may be the next turn of a conversation it already counted.

        The cap is the fair share rounded up, plus the slack ``session_balance`` allows only once it
        amounts to a whole conversation (rounded down): rounding the whole bound up instead lets a few
        replicas take ``ceil(1.25 x 2) = 3`` each of 8 conversations and leaves the last with none.
        """
        counts = [starts[rid] for rid in ranked]
        share = (sum(counts) + 1) / len(ranked)
        cap = max(math.ceil(share - 1e-9), math.floor(self.session_balance * share + 1e-9))
        full = {rid for rid, c in zip(ranked, counts, strict=True) if c + 1 > cap + (rid == own) + 1e-9} | crowded
        return [rid for rid in ranked if rid not in full] + [rid for rid in ranked if rid in full], full


class _RecentOwners:
    """Bounded memory of which replica this router last sent each block to, and when.

    Two uses: predict-on-route (a burst of siblings on a brand-new prefix lands together before the
    replica's KV events reach the index) and the fallback when the index is down. The clock is injectable
    so the trace simulator can run the prediction's time-to-live on simulated time.
    """

    def __init__(self, size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.size = size
        self.clock = clock
        self._owner: OrderedDict[BlockHash, tuple[str, float]] = OrderedDict()
        """Oldest first. An ordered dict, not a dict: deleting a plain dict's first entry over and over
        leaves a run of dead slots that every later "first entry" lookup walks (31 us per block once full)."""

    def record(self, block_hashes: list[BlockHash], index_id: str) -> None:
        now = self.clock()
        owner = self._owner
        for h in block_hashes:
            owner[h] = (index_id, now)
            owner.move_to_end(h)
        while len(owner) > self.size:
            owner.popitem(last=False)

    def match(
        self, block_hashes: list[BlockHash], candidates: list[str], max_age_s: float = math.inf
    ) -> tuple[dict[str, int], int]:
        """Per candidate, the deepest block of the chain last sent to it (it received the whole prefix), and
        how many leading blocks of the chain were sent anywhere.

        Shallow shared blocks (a system prompt) are re-recorded by every request, so their owner is just
        the latest router choice; each replica's depth is therefore read independently, not as one chain.
        """
        out = dict.fromkeys(candidates, 0)
        oldest = self.clock() - max_age_s
        known = 0
        for h in block_hashes:
            entry = self._owner.get(h)
            if entry is None:
                break  # nobody was sent this deep: nothing deeper either
            known += 1
            if entry[1] >= oldest and entry[0] in out:
                out[entry[0]] = known
        return out, known


def _drop_prefill_only(replicas: list[ReplicaLoad], costs: dict[str, float]) -> None:
    """Dedicated prefill replicas take no request (only prefills for others), unless no other replica is there."""
    prefill_only = [r.index_id for r in replicas if r.role == "prefill"]
    if len(prefill_only) < len(costs):
        for rid in prefill_only:
            costs.pop(rid, None)


def fill_unmeasured_rates(replicas: list[ReplicaLoad]) -> None:
    """A replica that has not measured its speed yet (new, idle) is assumed as fast as its peers' median.

    Replicas of one deployment run the same model on the same hardware; a pessimistic default would make
    every fresh replica look expensive and herd traffic onto the first one that measured itself.
    """
    for attr, default in (("prefill_tok_s", DEFAULT_PREFILL_TOK_S), ("decode_s_per_seq", DEFAULT_DECODE_S_PER_SEQ)):
        known = sorted(getattr(r, attr) for r in replicas if getattr(r, attr) is not None)
        fallback = known[len(known) // 2] if known else default
        for r in replicas:
            if getattr(r, attr) is None:
                setattr(r, attr, fallback)


def least_loaded(replicas: list[ReplicaLoad]) -> list[str]:
    return [r.index_id for r in sorted(replicas, key=lambda r: (r.queue_s, r.num_requests, r.index_id))]
