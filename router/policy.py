"""Routing policies as plain objects: no Ray, no Redis, no torch.

The same objects drive the Ray Serve request router (``router/serve_router.py``) and the trace simulator,
so what is benchmarked is what is deployed. A policy sees the request (its block hashes, token count,
optional session id), the candidate replicas' load, and, for prefix-aware policies, the index's answer
(leading blocks held per replica, or ``None`` when the index is down). It returns candidates ranked best
first plus the reason for the choice, which is counted in metrics.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from router.hashing import BlockHash

DEFAULT_PREFILL_TOK_S = 2000.0
"""Prefill rate assumed for a replica that has not reported one yet (tokens/s)."""
DEFAULT_DECODE_TOKEN_S = 0.0005
"""Per running sequence, seconds it adds to every engine step, when not reported."""
SESSION_DECAY_S = 600.0
"""Time constant over which counts of conversation starts fade (about a conversation's lifetime)."""


@dataclass
class RouteRequest:
    block_hashes: list[BlockHash]
    num_tokens: int
    block_size: int = 16
    session_id: str | None = None
    opens_session: bool = False
    """Set by ``KVAwarePolicy.rank``: a new conversation on a shared prefix (some replica holds part of the
    prompt, none holds half of it: its own history)."""


@dataclass
class ReplicaLoad:
    """What the router knows of one replica: its last report plus what it routed there since."""

    replica_id: str
    pending_prefill_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    cache_fill: float = 1.0
    """Share of the KV pool holding pinned or cached blocks; at 1.0 every new block evicts a cached one.
    Unknown counts as full: the conservative (sticky) assumption."""
    prefill_tok_s: float | None = None
    """None until measured; routing then assumes the peers' median (or the module default)."""
    decode_token_s: float | None = None
    max_num_seqs: int = 256
    step_s: float = 0.02
    """Mean duration of one engine step."""
    mean_output_tokens: float = 128.0
    """Mean tokens generated per finished request: how long a batch slot stays taken."""
    inflight_requests: int = 0
    """Routed by this router since the replica's last report."""
    inflight_prefill_tokens: int = 0
    kv_free_blocks: int | None = None
    """KV blocks a newcomer could take after the replica's queue (free or evictable, less what waiting
    prompts need); None when not reported: room is then assumed."""
    kv_total_blocks: int | None = None
    sessions: float | None = None
    """Conversations recently started here by every router (shared through the index, decaying); None when
    the index did not say, and the policy counts only its own."""

    PREFILL_TOK_S_DEFAULT: ClassVar[float] = DEFAULT_PREFILL_TOK_S
    DECODE_TOKEN_S_DEFAULT: ClassVar[float] = DEFAULT_DECODE_TOKEN_S

    @property
    def queue_s(self) -> float:
        """Seconds before a new request's first token could start: queued prefill, slowed by every running
        sequence, plus the wait for a free batch slot once the replica already holds ``max_num_seqs``."""
        prefill_rate = self.prefill_tok_s or DEFAULT_PREFILL_TOK_S
        prefill = (self.pending_prefill_tokens + self.inflight_prefill_tokens) / max(prefill_rate, 1e-6)
        running = min(self.load, self.max_num_seqs)
        excess = max(0, self.load + 1 - self.max_num_seqs)
        slot_wait = excess * self.mean_output_tokens * self.step_s / max(self.max_num_seqs, 1)
        return prefill + running * (self.decode_token_s or DEFAULT_DECODE_TOKEN_S) + slot_wait

    def kv_wait_s(self, tokens: int, block_size: int) -> float:
        """Seconds a newcomer needing ``tokens`` of new KV would wait for running sequences to free blocks.

        Queued prefill (``queue_s``) does not show it: a replica whose one running request is decoding has
        an empty queue but may have no room for a long prompt, which then waits for that request to finish
        while another replica's pool sits empty. Running sequences finish spread over one decode lifetime
        (``mean_output_tokens`` steps), so freeing a fraction f of the pinned blocks takes ~f of it.
        """
        if self.kv_free_blocks is None or not self.kv_total_blocks:
            return 0.0
        free = self.kv_free_blocks - self.inflight_prefill_tokens / block_size  # routed since the report
        shortfall = -(-tokens // block_size) - free
        if shortfall <= 0:
            return 0.0
        pinned = max(self.kv_total_blocks - self.kv_free_blocks, 1)
        return min(shortfall / pinned, 1.0) * self.mean_output_tokens * self.step_s

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting + self.inflight_requests


@dataclass
class Decision:
    ranked: list[str]
    """Replica ids, best first: the caller tries them in order (a full replica falls to the next)."""
    reason: str
    """Why the first was chosen: hit, load_override, miss, index_unavailable, ... (counted in metrics)."""
    matched_blocks: int = 0
    costs: dict[str, float] = field(default_factory=dict)
    tied: int = 1
    """How many of the first ``ranked`` are interchangeable on what the router knows: the caller lets a
    fresher signal choose among them (Ray probes their live queue lengths)."""


class RoutingPolicy(Protocol):
    name: str
    uses_index: bool

    def rank(self, req: RouteRequest, replicas: list[ReplicaLoad], hits: dict[str, int] | None) -> Decision: ...

    def on_routed(self, req: RouteRequest, replica_id: str) -> None: ...


class KVAwarePolicy:
    """Ours: minimise the expected time to first token, in seconds.

    ``cost(r) = queue_s(r) + kv_wait_s(r) + uncached_tokens(r) / prefill_rate(r)
               + (miss_weight - 1) * cache_fill(r) * uncached_tokens(r) / median_prefill_rate
               + decode_weight * mean_output_tokens(r) * load(r) * decode_token_s(r)``

    The churn term (the fourth) prices the blocks a miss evicts at the fleet's median rate, not at the
    replica's own: it counts blocks, and priced per replica it would multiply small differences in
    measured speed by ``miss_weight`` until they outweighed real waits (a full pool, a queue).

    The last term is what the newcomer's generation will lose to sharing every decode step with the
    ``load(r)`` sequences already there (``decode_token_s`` is the replica's measured marginal cost of one
    more sequence per step). It trades time to first token for inter-token latency and balance, so it is
    off by default: on the simulated fleet (miss weight 8) ``decode_weight=1`` raised mean TTFT from 26 to
    65 ms (hit rate 95% -> 87% of the pooled bound); operators who weigh decode speed or even load can turn
    it on.

    A miss is weighted more than its own prefill time because it also copies the prefix onto a second
    replica, evicting other prefixes there, which later requests then miss. That cost exists only where
    the cache is full: on a replica with empty blocks a miss costs just its own prefill, so
    while caches have room, new conversations spread over the replicas instead of herding onto whichever
    first cached the shared system prompt. The full-cache weight, 16x by default, comes from the trace
    simulator (``benchmarks/simulate.py``, Mooncake conversation trace, 16 replicas x 3,000 blocks, linear
    decode steps): against 8x it keeps 97.8-98.4% of the pooled-LRU hit rate instead of 95-96% at 60 / 80 /
    90% load, with mean TTFT +3.6% / +0.8% / -3.8%; 4x loses ~6 points of hit rate, 32x costs TTFT. A
    replica holding the prefix therefore wins until its queue is worth more than re-prefilling elsewhere,
    which spreads a hot shared prefix over several replicas instead of pinning it to one. A holder of most
    of the request (its conversation history) also keeps it when the cheapest other replica saves less than
    ``override_margin_s``: estimates that close are noise, and moving a conversation for them duplicates its
    prefix for nothing. Holding only a short shared prefix earns no such bias, or new conversations would
    herd onto whichever replica first cached the system prompt. When the index cannot answer,
    the policy falls back to the prefix-ownership it remembers from its own recent decisions, then to load.

    New conversations on a shared prefix (some replica holds part of the prompt, none holds half) are also
    placed with bounded loads (consistent hashing with bounded loads, Mirrokni et al.): a replica that
    already started its fair share of the recent conversations, plus the whole conversations
    ``session_balance`` x that share allows beyond it, is ranked after the others. Counts are shared by
    every router process through the index (each router bounding only its own share let two routers fill
    the same replicas and leave one empty) and decay over ``session_decay_s``, so a replica added later
    is not flooded until it catches up with the lifetime totals of the others.
    Conversations stick to where their history is, so where they start decides the long-run load; the
    cheapest replica by cost alone is usually one holding the shared system prompt, and without the bound
    those few replicas collect every conversation (4 replicas on this repo's real-cluster chat benchmark:
    36/28/0/0 requests). A prompt no replica holds any of is placed by cost alone: no cached prefix pulls
    such prompts together, queues and KV room spread them, and counting them would hand a replica the
    autoscaler just added every one of them until its count caught up (measured: two clients queued on the
    new replica for a minute while the old one idled). 0 turns the bound off.

    Replicas that cache as much of the prompt as the cheapest and cost at most ``tie_margin`` times the
    request's own prefill time more are reported as tied (``Decision.tied``): the router's loads are up to
    a report period old and miss what other routers sent since, so between such replicas a fresh count
    is worth more than the estimate. The serve router offers them to Ray as one group; Ray probes their
    queue lengths, which count every router's requests, and takes the shortest. Without it, two ingress
    routers placing two agents' long prompts on two idle-looking replicas sent both to the same one for
    14 of 83 requests after a scale-out (autoscaling benchmark, ramp), setting its p99; grouped within a
    quarter of a prefill 9 of 81, within one prefill (the default: less than one request another router
    may have sent) 8 of 90, and the p99 fell below the default policy's. Replicas this router itself just
    sent different numbers of requests are never tied: those may not have arrived where a probe counts.
    0 turns it off. (It was off for a while because the real-cluster multi-turn test saw conversations
    move after turn 1; that happened without it too, and came from stale load reports, now drained by
    age in the serve router, and from warm-up decode slopes, now bounded by a recent step.)
    """

    name = "kv_aware"
    uses_index = True

    def __init__(
        self,
        miss_weight: float = 16.0,
        decode_weight: float = 0.0,
        override_margin_s: float = 0.005,
        predict_ttl_s: float = 2.0,
        memory_size: int = 65536,
        session_balance: float = 1.25,
        session_decay_s: float = SESSION_DECAY_S,
        tie_margin: float = 1.0,
    ) -> None:
        if miss_weight < 0 or decode_weight < 0 or override_margin_s < 0 or tie_margin < 0:
            raise ValueError("miss_weight, decode_weight, override_margin_s and tie_margin must be >= 0")
        if session_balance and session_balance < 1:
            raise ValueError("session_balance must be 0 (off) or >= 1")
        self.session_balance = session_balance
        self.session_decay_s = session_decay_s
        self._sessions = DecayingCounts(session_decay_s)
        """Conversations this router started on each replica: the fallback when the index does not say."""
        self.miss_weight = miss_weight
        self.decode_weight = decode_weight
        self.override_margin_s = override_margin_s
        self.tie_margin = tie_margin
        self.predict_ttl_s = predict_ttl_s
        self._recent = _RecentOwners(memory_size)
        self._rng = random.Random()

    def rank(self, req: RouteRequest, replicas: list[ReplicaLoad], hits: dict[str, int] | None) -> Decision:
        if not replicas:
            raise ValueError("no replicas to route to")
        fill_unmeasured_rates(replicas)
        reason_prefix = ""
        ids = [r.replica_id for r in replicas]
        if hits is None:
            hits = self._recent.match(req.block_hashes, ids)
            reason_prefix = "index_unavailable_"
        elif self.predict_ttl_s > 0:  # what we just routed may not have reached the index yet
            predicted = self._recent.match(req.block_hashes, ids, self.predict_ttl_s)
            known = max((hits.get(rid, 0) for rid in ids), default=0)  # extend the index, never contradict it
            hits = {rid: max(hits.get(rid, 0), predicted[rid] if predicted[rid] > known else 0) for rid in ids}
        costs, own_prefill_s = {}, {}
        rates = {r.replica_id: max(r.prefill_tok_s or 1.0, 1e-6) for r in replicas}
        median_rate = sorted(rates.values())[len(rates) // 2]
        for r in replicas:
            cached = min(hits.get(r.replica_id, 0) * req.block_size, max(req.num_tokens - 1, 0))
            uncached = req.num_tokens - cached
            fill = min(max(r.cache_fill, 0.0), 1.0)
            own_prefill_s[r.replica_id] = uncached / rates[r.replica_id]
            prefill_s = min(self.miss_weight, 1.0) * own_prefill_s[r.replica_id]
            prefill_s += max(self.miss_weight - 1.0, 0.0) * fill * uncached / median_rate  # churn, in blocks
            decode_s = self.decode_weight * r.mean_output_tokens * r.load * (r.decode_token_s or 0.0)
            costs[r.replica_id] = r.queue_s + r.kv_wait_s(uncached + 1, req.block_size) + prefill_s + decode_s
        jitter = {rid: self._rng.random() for rid in costs}  # equal costs: no herding on the first id
        ranked = sorted(costs, key=lambda rid: (costs[rid], jitter[rid]))
        holder = max(ranked, key=lambda rid: hits.get(rid, 0))  # longest match; cheapest among equals
        holder_share = hits.get(holder, 0) * req.block_size / max(req.num_tokens, 1)
        # A new conversation on a shared prefix (a system prompt): some replica holds part of it, none its history.
        req.opens_session = 0 < holder_share < 0.5
        if not req.opens_session and holder != ranked[0] and costs[holder] - costs[ranked[0]] <= self.override_margin_s:
            ranked = [holder, *(rid for rid in ranked if rid != holder)]  # hysteresis: no churn on noise
        capped: set[str] = set()
        if req.opens_session and self.session_balance:
            ranked, capped = self._bounded(ranked, {r.replica_id: r.sessions for r in replicas})
        best_hit = max((hits.get(r.replica_id, 0) for r in replicas), default=0)
        chosen_hit = hits.get(ranked[0], 0)
        if best_hit == 0:
            reason = "miss"
        elif chosen_hit == best_hit:
            reason = "hit"
        else:
            reason = "load_override"
        tied = 1
        if self.tie_margin and ranked[0] not in capped:
            limit = costs[ranked[0]] + self.tie_margin * own_prefill_s[ranked[0]] + 1e-9
            # Requests this router sent that no probe can see yet (not arrived): never tie across them, or a
            # burst of concurrent decisions would all probe zeros and pile onto one replica.
            own = {r.replica_id: r.inflight_requests for r in replicas}
            for rid in ranked[1:]:
                if rid in capped or hits.get(rid, 0) != chosen_hit or costs[rid] > limit or own[rid] != own[ranked[0]]:
                    break
                tied += 1
        return Decision(ranked, reason_prefix + reason, chosen_hit, costs, tied)

    def on_routed(self, req: RouteRequest, replica_id: str) -> None:
        self._recent.record(req.block_hashes, replica_id)
        if req.opens_session:
            self._sessions.add(replica_id)

    def _bounded(self, ranked: list[str], shared: dict[str, float | None]) -> tuple[list[str], set[str]]:
        """``ranked`` with the replicas at their conversation cap moved last (order kept otherwise), and them.

        The cap is the fair share rounded up, plus the slack ``session_balance`` allows only once it
        amounts to a whole conversation (rounded down): rounding the whole bound up instead lets a few
        replicas take ``ceil(1.25 x 2) = 3`` each of 8 conversations and leaves the last with none.
        """
        if all(shared.get(rid) is not None for rid in ranked):
            counts = [shared[rid] for rid in ranked]
        else:
            counts = [self._sessions.get(rid) for rid in ranked]
        share = (sum(counts) + 1) / len(ranked)
        cap = max(math.ceil(share - 1e-9), math.floor(self.session_balance * share + 1e-9))
        full = {rid for rid, c in zip(ranked, counts, strict=True) if c + 1 > cap + 1e-9}
        return [rid for rid in ranked if rid not in full] + [rid for rid in ranked if rid in full], full


def decayed(count: float, age_s: float, tau_s: float) -> float:
    """A count as it stands ``age_s`` after it was taken: the one fading rule of conversation counts (the
    index's ``session.lua`` applies the same on writes)."""
    return count * math.exp(-max(age_s, 0.0) / tau_s) if count else 0.0


class DecayingCounts:
    """Counts per key that fade as ``exp(-age / tau)``: what happened recently, not since start-up.

    The same arithmetic as the index's shared counts (``router/lua/session.lua``); the clock is injectable
    so the trace simulator can run it on simulated time."""

    def __init__(self, tau_s: float, clock=time.monotonic) -> None:
        if tau_s <= 0:
            raise ValueError("session_decay_s must be > 0")
        self.tau_s = tau_s
        self.clock = clock
        self._counts: dict[str, tuple[float, float]] = {}

    def get(self, key: str) -> float:
        count, at = self._counts.get(key, (0.0, 0.0))
        return decayed(count, self.clock() - at, self.tau_s)

    def add(self, key: str, amount: float = 1.0) -> None:
        self._counts[key] = (self.get(key) + amount, self.clock())


class _RecentOwners:
    """Bounded memory of which replica this router last sent each block to, and when.

    Two uses: predict-on-route (a burst of siblings on a brand-new prefix lands together before the
    replica's KV events reach the index) and the fallback when the index is down.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._owner: dict[BlockHash, tuple[str, float]] = {}

    def record(self, block_hashes: list[BlockHash], replica_id: str) -> None:
        now = time.monotonic()
        for h in block_hashes:
            self._owner.pop(h, None)
            self._owner[h] = (replica_id, now)  # re-insert: dicts keep insertion order, oldest first
        while len(self._owner) > self.size:
            del self._owner[next(iter(self._owner))]

    def match(
        self, block_hashes: list[BlockHash], candidates: list[str], max_age_s: float = math.inf
    ) -> dict[str, int]:
        """Per candidate, the deepest block of the chain last sent to it (it received the whole prefix).

        Shallow shared blocks (a system prompt) are re-recorded by every request, so their owner is just
        the latest router choice; each replica's depth is therefore read independently, not as one chain.
        """
        out = dict.fromkeys(candidates, 0)
        oldest = time.monotonic() - max_age_s
        for i, h in enumerate(block_hashes):
            entry = self._owner.get(h)
            if entry is None:
                break  # nobody was sent this deep: nothing deeper either
            if entry[1] >= oldest and entry[0] in out:
                out[entry[0]] = i + 1
        return out


def fill_unmeasured_rates(replicas: list[ReplicaLoad]) -> None:
    """A replica that has not measured its speed yet (new, idle) is assumed as fast as its peers' median.

    Replicas of one deployment run the same model on the same hardware; a pessimistic default would make
    every fresh replica look expensive and herd traffic onto the first one that measured itself.
    """
    for attr in ("prefill_tok_s", "decode_token_s"):
        known = sorted(getattr(r, attr) for r in replicas if getattr(r, attr) is not None)
        fallback = known[len(known) // 2] if known else getattr(ReplicaLoad, attr.upper() + "_DEFAULT")
        for r in replicas:
            if getattr(r, attr) is None:
                setattr(r, attr, fallback)


def least_loaded(replicas: list[ReplicaLoad]) -> list[str]:
    return [r.replica_id for r in sorted(replicas, key=lambda r: (r.queue_s, r.load, r.replica_id))]
