"""The fleet simulator: a discrete-event model of routing policies over a trace (the same policy objects the
Ray router runs). ``kvmesh bench simulate``, ``fleet_scale``, ``suite`` and ``host_tier_sim`` run it.

N replicas, each with an LRU prefix cache of C blocks, ``max_num_seqs`` batch slots, a FIFO prefill stage
whose time is the uncached tokens over the prefill rate, and a decode stage whose step time grows with the
running batch. Requests come from Mooncake-format rows (``trace_rows``): each 512-token hash id becomes one
block (its ids are prefix-chained, so prefix structure is kept). ``compare_routers`` rescales arrival times so
the offered work, assuming a pooled LRU of N x C blocks, is ``target_load`` of the fleet's prefill capacity.
Requests are spread over K independent router processes (per-process policy state, as Ray Serve runs one
router per handle-holding process); prefix lookups read the replicas' exact caches, as the Redis index does,
extended by each routing decision until its blocks land and for ``ttl`` trace seconds; the counts of
conversation starts are shared by all of them, as the index shares them. Each replica reports what the
engine would: its queued prefill (each request's uncached tokens, from routing until its prefill ran),
running and waiting counts, its current step time and the trace's mean output length. Random tie-breaks are
seeded per router process, so a run is reproducible. Each result also counts the blocks another replica held
beyond the chosen one's (``passed_over``: moves for load). Runs are judged against bounds from the trace
alone (``benchmarks/harness/cache_bounds.py``): the pooled LRU and the replication-aware bound at
``imbalance``. ``shortlist`` k prices only the k replicas holding the prompt deepest plus k random ones per
decision, for fleets of a thousand replicas. ``Costs.fetch_tok_s`` > 0: every replica can pull a prefix's blocks
from a peer at that rate (and serves its own); where the router's decision plans a fetch, the chosen replica's
prefill first waits for those blocks, as far as the holder still holds them, then recomputes the rest. Hits are
reported by source: local (device and host tier), fetched, recomputed. With LoRA adapters (``zipf_adapters``)
each replica holds ``Costs.adapter_slots`` adapters ready (LRU) and reports them; a request's prefill on a
replica without its adapter first waits ``Costs.lora_load_s`` to read it, counted as an adapter load.

``Costs()``, a GPU-class replica documented here (not measured on a GPU): prefill 20,000 tokens/s, a decode
step takes 15 ms plus 0.25 ms per running sequence, 64 batch slots, 16 tokens per block.
``Costs.from_calibration`` reads the constants ``kvmesh bench calibrate`` measured on our real engine instead.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import json
import random
import statistics
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.bench.harness.cache_bounds import BLOCK_TOKENS, lru_hit_rate, replicated_bound
from kvmesh.core.defaults import PREDICT_TTL_S
from kvmesh.core.messages import KVFetch
from kvmesh.core.step_timing import StepTiming
from kvmesh.replica.telemetry import BusyShare
from kvmesh.router.baselines import POLICIES, make_policy
from kvmesh.router.policy import ReplicaLoad, RouteRequest
from kvmesh.router.prefix_lru import PrefixLRU
from kvmesh.router.sessions import SESSION_DECAY_S, DecayingCounts

BOUND_IMBALANCE = 1.3
"""The replication-aware bound lets the busiest replica serve this many times the mean number of requests."""
PROGRESS_EVERY = 100_000
"""Requests between two progress reports of a long simulation."""
WINDOW_SHARE = 0.1
"""A replica's prefill utilisation is averaged over this share of the trace's simulated span: the suite's traces
last about a second of simulated time at GPU-class rates, so the engine's 10 s window would never fill."""


@dataclass(frozen=True)
class Costs(StepTiming):
    """How fast a simulated replica works: the step timing (``core/step_timing.py``) and the rest of a replica."""

    slots: int = 64
    host_load_tok_s: float = 200_000.0
    """Tokens per second a host-tier prefix loads back at (PCIe-class: ~25 GB/s over ~128 KiB of KV per
    token of an 8B Llama): 10x the prefill rate. Used only by replicas with a host tier."""
    fetch_tok_s: float = 0.0
    """Tokens per second of KV a replica pulls from a peer (0: replicas neither pull nor serve blocks)."""
    adapter_slots: int = 4
    """LoRA adapters a replica holds ready at once (least recently used out), for traces with adapters."""
    lora_load_s: float = 0.05
    """Seconds a replica takes to read an adapter it does not hold, before the request's prefill."""


@dataclass
class Req:
    arrival: float
    chain: list[bytes]
    output: int
    reused_blocks: int = 0
    """Leading blocks it did not compute: device hits, those loaded from the host tier and those fetched."""
    host_hits: int = 0
    fetch: KVFetch | None = None
    """The router's plan to pull part of its prefix from a peer (None: none)."""
    fetched_blocks: int = 0
    queued: int = 0
    """Prefill tokens the replica's queue counted for it on arrival (the router's estimate of its misses)."""
    ttft: float = 0.0
    replica: int = -1
    passed_over: int = 0
    """Leading blocks another replica held (as the index answered) beyond the chosen one's: left for load."""
    opened: bool = False
    """The router took it for a new conversation (placed with bounded loads)."""
    adapter: int | None = None
    """The LoRA adapter it runs on (None: the base model)."""

    @property
    def tokens(self) -> int:
        return len(self.chain) * BLOCK_TOKENS


class HolderIndex:
    """Which replicas hold each block, kept by their inserts and evictions (the Redis index's shape): a lookup
    touches the replicas that hold the prompt, not the whole fleet."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[int]] = {}

    def update(self, replica: int, added: list[bytes], evicted: list[bytes]) -> None:
        for h in added:
            self._holders.setdefault(h, set()).add(replica)
        for h in evicted:
            held = self._holders.get(h)
            if held is not None:
                held.discard(replica)
                if not held:
                    del self._holders[h]

    def deepest(self, chain: list[bytes], k: int) -> list[int]:
        """Up to ``k`` replicas holding the deepest blocks of ``chain`` (deepest first)."""
        out: dict[int, None] = {}
        for h in reversed(chain):
            for replica in self._holders.get(h, ()):
                out[replica] = None
                if len(out) >= k:
                    return list(out)
        return list(out)


@dataclass
class Replica:
    rid: str
    capacity: int
    costs: Costs
    host_capacity: int = 0
    """Blocks of the host prefix tier: what the device evicts goes there (LRU), exclusive with the device."""
    cache: PrefixLRU = field(init=False)
    host: PrefixLRU = field(init=False)
    prefill_queue: deque = field(default_factory=deque)
    slot_waiters: deque = field(default_factory=deque)
    running: int = 0
    prefill_busy: bool = False
    queued_tokens: int = 0
    served: int = 0
    index: HolderIndex | None = None
    """The fleet's block index this replica keeps current (None: no shortlist, every replica is asked)."""
    busy: BusyShare = field(default_factory=BusyShare)
    """How busy its prefill has been, as the engine measures it (``replica/telemetry.py``)."""
    mean_output_steps: float = 1.0
    """What the engine reports as ``mean_output_tokens`` (one simulated decode step per output row unit)."""
    adapters: OrderedDict = field(default_factory=OrderedDict)
    """The LoRA adapters it holds ready, least recently used first."""
    adapter_loads: int = 0

    def __post_init__(self) -> None:
        self.cache = PrefixLRU(self.capacity)
        self.host = PrefixLRU(self.host_capacity)

    def use_adapter(self, adapter: int) -> float:
        """Seconds before a request on ``adapter`` can start here: 0 where it is held, else its read (which
        evicts the least recently used adapter once the slots are full)."""
        if adapter in self.adapters:
            self.adapters.move_to_end(adapter)
            return 0.0
        self.adapters[adapter] = None
        if len(self.adapters) > self.costs.adapter_slots:
            self.adapters.popitem(last=False)
        self.adapter_loads += 1
        return self.costs.lora_load_s

    def leading_hits(self, chain: list[bytes]) -> int:
        return self.cache.leading(chain)

    def host_hits(self, chain: list[bytes], start: int) -> int:
        """Blocks of ``chain`` after its first ``start`` that the host tier holds, in a row."""
        return self.host.leading(chain[start:])

    def insert(self, chain: list[bytes]) -> None:
        for h in chain:
            self.host.discard(h)  # loaded back or recomputed: the device holds it now
        evicted = self.cache.touch(chain)
        if self.host_capacity:
            for h in evicted:
                self.host.touch((h,))
        if self.index is not None:
            self.index.update(int(self.rid[1:]), chain, evicted)

    def step_s(self) -> float:
        """A decode step's time at the current batch."""
        return self.costs.step_s(0, self.running)

    def load(self, now: float = 0.0) -> ReplicaLoad:
        return ReplicaLoad(
            index_id=self.rid,
            pending_prefill_tokens=self.queued_tokens,
            num_running=self.running,
            num_waiting=len(self.slot_waiters),
            prefill_tok_s=self.costs.prefill_tok_s,
            decode_s_per_seq=self.costs.decode_s_per_seq,
            max_num_seqs=self.costs.slots,
            step_s=self.step_s(),
            mean_output_tokens=self.mean_output_steps,
            cache_fill=len(self.cache) / self.capacity,
            kv_total_blocks=self.capacity,
            prefill_busy=self.busy.at(now),
            host_load_tok_s=self.costs.host_load_tok_s if self.host_capacity else None,
            fetch_tok_s=self.costs.fetch_tok_s or None,
            kv_address=self.rid if self.costs.fetch_tok_s else None,
            loras=[f"a{a}" for a in self.adapters],
            lora_slots=self.costs.adapter_slots,
            lora_load_s=self.costs.lora_load_s,
        )


def trace_rows(records) -> list[tuple[float, list[bytes], int]]:
    """Simulator rows (arrival s, block chain, decode steps) from Mooncake-format records (dicts)."""
    return [
        (r["timestamp"] / 1000.0, [struct.pack("<q", h) for h in r["hash_ids"]], max(1, r["output_length"] // 32))
        for r in records
    ]


def zipf_adapters(rows, adapters: int, exponent: float, seed: int = 0) -> list[int]:
    """An adapter per row for a trace of many fine-tunes: each prefix family (rows sharing their first block past
    the prefix the whole trace shares: a conversation and its turns, a task's prompts) runs on one adapter,
    drawn with Zipf popularity (adapter k, from 0, with weight ``1 / (k + 1) ** exponent``)."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** exponent for k in range(adapters)]
    first = rows[0][1] if rows else []
    shared = min((_common(first, chain) for _, chain, _ in rows), default=0)
    family: dict[tuple, int] = {}
    out = []
    for _, chain, _ in rows:
        root = tuple(chain[: shared + 1])
        if root not in family:
            family[root] = rng.choices(range(adapters), weights)[0]
        out.append(family[root])
    return out


def _common(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def load_trace(path: Path, limit: int | None) -> list[tuple[float, list[bytes], int]]:
    with path.open() as f:
        return trace_rows(json.loads(line) for line in itertools.islice(f, limit))


def predicted_hits(predicted: dict, chain: list[bytes], now: float, ttl: float, landed: list[bool]) -> dict[str, int]:
    """Per replica, the deepest block of the chain a router recently sent it (as the lookup script reads
    the Redis predictions: each depth on its own, since shared shallow blocks name the latest choice).

    A prediction ``(replica, routed at, request)`` stands until that request's blocks land in the replica's
    cache (its KV events reach the index) and for ``ttl`` simulated seconds after routing, whichever is later.
    """
    out: dict[str, int] = {}
    for i, h in enumerate(chain):
        entry = predicted.get(h)
        if entry is None:
            break
        if now - entry[1] <= ttl or not landed[entry[2]]:
            out[entry[0]] = i + 1
    return out


class FleetSim:
    """One run of ``policy_name`` over ``rows`` on ``n`` replicas of ``capacity`` blocks, with requests spread
    over ``processes`` router processes and arrivals at ``scale`` x their trace times.

    ``ttl``: how long a routing decision is remembered as a prediction, in trace seconds (the router's own
    ``predict_ttl_s`` too, unless ``policy_kwargs`` set it): compressing arrivals compresses conversations'
    think times, and a TTL left in simulated seconds would outlast them, telling the router where every history
    went. ``adapters``: per row, the LoRA adapter it runs on (``zipf_adapters``; None: the base model's trace).
    ``shortlist`` k > 0: each decision prices only the k replicas holding the prompt deepest, k drawn at
    random and those a prediction names (a router's cost at a thousand replicas); a policy that hashes
    (``preferred``) shortlists its own k top choices instead; 0: every replica. Events are arrivals, prefills
    ending and requests finishing, taken in time order from one heap."""

    def __init__(
        self,
        rows,
        n: int,
        capacity: int,
        policy_name: str,
        policy_kwargs: dict,
        processes: int,
        scale: float,
        ttl: float,
        costs: Costs = Costs(),
        host_capacity: int = 0,
        shortlist: int = 0,
        adapters: list[int] | None = None,
    ) -> None:
        self.costs, self.shortlist, self.host_capacity = costs, shortlist, host_capacity
        self.ttl_s = ttl * scale
        window = max(rows[-1][0] - rows[0][0], 1e-9) * scale * WINDOW_SHARE
        self.index = HolderIndex() if shortlist else None
        mean_output = statistics.fmean(out for _, _, out in rows)
        self.replicas = [
            Replica(
                f"r{i}",
                capacity,
                costs,
                host_capacity,
                index=self.index,
                busy=BusyShare(window),
                mean_output_steps=mean_output,
            )
            for i in range(n)
        ]
        self.ids = [rep.rid for rep in self.replicas]
        self.sampler = random.Random(0)
        self.clock = 0.0  # simulated time: the shared counts of conversation starts (the index's session.lua), TTLs
        self.routers = self._routers(policy_name, policy_kwargs, processes)
        self.uses_index = self.routers[0].uses_index
        self.predicted: dict[bytes, tuple[str, float, int]] = {}  # Redis predict-on-route entries, all routers'
        self.landed = [False] * len(rows)  # per request: its blocks are in its replica's cache, so the index has them
        decay_s = getattr(self.routers[0], "session_decay_s", SESSION_DECAY_S)
        self.starts = DecayingCounts(decay_s, clock=lambda: self.clock)
        self.reqs = [Req(t * scale, chain, out) for t, chain, out in rows]
        for r, adapter in zip(self.reqs, adapters or (), strict=False):
            r.adapter = adapter
        self.span_s = max(rows[-1][0] - rows[0][0], 1e-9) * scale
        self.seq = itertools.count()
        self.events = [(r.arrival, next(self.seq), "arrive", i) for i, r in enumerate(self.reqs)]
        heapq.heapify(self.events)

    def _routers(self, name: str, kwargs: dict, processes: int) -> list:
        """One policy object per router process, random tie-breaks seeded per process (reproducible runs),
        reading simulated time where the policy keeps time."""
        accepts = inspect.signature(POLICIES[name]).parameters
        simulated = {"clock": lambda: self.clock} if "clock" in accepts else {}
        if "predict_ttl_s" in accepts and "predict_ttl_s" not in kwargs:
            simulated["predict_ttl_s"] = self.ttl_s
        if "disaggregate_tokens" in accepts and "disaggregate_tokens" not in kwargs:
            simulated["disaggregate_tokens"] = 0  # prefilling on one replica for another is not simulated
        seeded = [{"seed": k} if "seed" in accepts else {} for k in range(processes)]
        return [make_policy(name, **seed, **simulated, **kwargs) for seed in seeded]

    def run(self, progress: Callable[[int], None] | None = None) -> dict[str, float]:
        """Serve the whole trace; ``progress`` hears the number of requests routed, every ``PROGRESS_EVERY``."""
        handlers = {"arrive": self.arrive, "prefilled": self.prefilled, "done": self.done}
        while self.events:
            now, _, kind, i = heapq.heappop(self.events)
            if progress is not None and kind == "arrive" and i and i % PROGRESS_EVERY == 0:
                progress(i)
            handlers[kind](i, now)
        return self.summary()

    def _push(self, at: float, kind: str, i: int) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, i))

    def _asked(self, policy, req: RouteRequest, forecast: dict[str, int]) -> list[Replica]:
        """The replicas this decision prices: all of them, or the shortlist."""
        if not self.shortlist:
            return self.replicas
        n = len(self.replicas)
        pool = [
            *self.index.deepest(req.block_hashes, self.shortlist),
            *self.sampler.sample(range(n), min(self.shortlist, n)),
        ]
        if hasattr(policy, "preferred"):  # a hashing policy's own top choices, not the holders
            pool = [int(rid[1:]) for rid in policy.preferred(req, self.ids, self.shortlist)] or pool
        return [self.replicas[j] for j in dict.fromkeys([*pool, *(int(o[1:]) for o in forecast)])]

    def _hits(self, chain: list[bytes], asked: list[Replica], forecast: dict[str, int]) -> tuple[dict, dict]:
        """What the index answers: leading device hits per replica (extended by predictions past what any
        replica holds, as the lookup script does) and host-tier hits past them."""
        device = {rep.rid: rep.leading_hits(chain) for rep in asked}
        host = {rep.rid: rep.host_hits(chain, device[rep.rid]) for rep in asked} if self.host_capacity else {}
        known = max(device.values())
        for owner, k in forecast.items():
            if k > known:
                device[owner] = max(device[owner], k)
        return device, host

    def arrive(self, i: int, now: float) -> None:
        """Route request ``i`` as its router process would, then queue it on the chosen replica."""
        r = self.reqs[i]
        policy = self.routers[i % len(self.routers)]
        lora = f"a{r.adapter}" if r.adapter is not None else None
        req = RouteRequest(r.chain, r.tokens, BLOCK_TOKENS, lora_name=lora)
        forecast = predicted_hits(self.predicted, r.chain, now, self.ttl_s, self.landed) if self.uses_index else {}
        asked = self._asked(policy, req, forecast)
        device_hits, host = self._hits(r.chain, asked, forecast) if self.uses_index else (None, {})
        candidates = [rep.load(now) for rep in asked]
        self.clock = now
        shared = {load.index_id: self.starts.get(load.index_id) for load in candidates} if self.uses_index else None
        decision = policy.rank(req, candidates, device_hits, shared, host, fleet_size=len(self.replicas))
        rid = decision.ranked[0]
        policy.on_routed(req, rid, decision)
        if device_hits:
            r.passed_over = max(device_hits.values()) - device_hits[rid]
        r.opened = decision.opens_session
        r.fetch = decision.fetches.get(rid)
        if self.uses_index:
            for h in r.chain:
                self.predicted[h] = (rid, now, i)
            if decision.opens_session:
                self.starts.add(rid)
        r.replica = int(rid[1:])
        rep = self.replicas[r.replica]
        # What the router believes the replica must prefill (not what it fetches), never below the last token:
        # a prediction can deepen the device hits past where the host tier's blocks were counted from.
        believed = max((device_hits or {}).get(rid, 0) + host.get(rid, 0), r.fetch.num_blocks if r.fetch else 0)
        believed *= BLOCK_TOKENS
        r.queued = r.tokens - min(believed, r.tokens - 1)
        rep.queued_tokens += r.queued
        if rep.running < self.costs.slots:
            rep.running += 1
            rep.prefill_queue.append(i)
            self.start_prefill(rep, now)
        else:
            rep.slot_waiters.append(i)

    def start_prefill(self, rep: Replica, now: float) -> None:
        """Start the replica's next queued prefill if its prefill stage is free: it takes fetching the blocks
        its router planned to pull from a peer, then the tokens not cached when it starts, plus loading the
        host tier's blocks back."""
        if rep.prefill_busy or not rep.prefill_queue:
            return
        i = rep.prefill_queue.popleft()
        r = self.reqs[i]
        device = rep.leading_hits(r.chain)
        r.host_hits = rep.host_hits(r.chain, device) if rep.host_capacity else 0
        r.fetched_blocks = self._fetchable(r, device + r.host_hits)
        r.reused_blocks = device + r.host_hits + r.fetched_blocks
        uncached = r.tokens - r.reused_blocks * BLOCK_TOKENS
        rep.prefill_busy = True
        done = now + uncached / self.costs.prefill_tok_s + r.host_hits * BLOCK_TOKENS / self.costs.host_load_tok_s
        if r.fetched_blocks:
            done += r.fetched_blocks * BLOCK_TOKENS / self.costs.fetch_tok_s
        if r.adapter is not None:
            done += rep.use_adapter(r.adapter)
        rep.busy.add(now, done - now)
        self._push(done, "prefilled", i)

    def _fetchable(self, r: Req, local: int) -> int:
        """Blocks of ``r``'s plan past the ``local`` ones its replica holds that the holder still holds (device
        or host tier): the rest of a fetch of blocks evicted since is recomputed, as the engine falls back."""
        if r.fetch is None:
            return 0
        holder = self.replicas[int(r.fetch.holder[1:])]
        held = holder.leading_hits(r.chain)
        held += holder.host_hits(r.chain, held) if holder.host_capacity else 0
        return max(min(r.fetch.num_blocks, held) - local, 0)

    def prefilled(self, i: int, now: float) -> None:
        """Request ``i``'s first token: its blocks land in the cache; it decodes at the batch's step time."""
        r = self.reqs[i]
        rep = self.replicas[r.replica]
        rep.prefill_busy = False
        rep.queued_tokens -= r.queued
        r.ttft = now - r.arrival
        rep.insert(r.chain)
        self.landed[i] = True
        rep.served += 1
        self._push(now + r.output * rep.step_s(), "done", i)
        self.start_prefill(rep, now)

    def done(self, i: int, now: float) -> None:
        """Request ``i`` finished: its slot goes to the first waiter."""
        rep = self.replicas[self.reqs[i].replica]
        rep.running -= 1
        if rep.slot_waiters:
            rep.running += 1
            rep.prefill_queue.append(rep.slot_waiters.popleft())
            self.start_prefill(rep, now)

    def summary(self) -> dict[str, float]:
        reqs = self.reqs
        ttfts = sorted(r.ttft for r in reqs)
        served = [rep.served for rep in self.replicas]
        blocks = sum(len(r.chain) for r in reqs)
        reused, fetched = sum(r.reused_blocks for r in reqs), sum(r.fetched_blocks for r in reqs)
        return {
            "hit_rate": reused / blocks,
            "local_hit_rate": (reused - fetched) / blocks,
            "fetched_rate": fetched / blocks,
            "recomputed_rate": 1 - reused / blocks,
            "host_hit_rate": sum(r.host_hits for r in reqs) / blocks,
            "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_p50_s": ttfts[len(ttfts) // 2],
            "ttft_p99_s": ttfts[int(0.99 * len(ttfts))],
            "imbalance": max(served) / statistics.fmean(served),
            "passed_over": sum(r.passed_over for r in reqs) / blocks,
            "passed_over_opening": sum(r.passed_over for r in reqs if r.opened) / blocks,
            "adapter_loads_per_request": sum(rep.adapter_loads for rep in self.replicas) / len(reqs),
            "adapter_loads_per_min": sum(rep.adapter_loads for rep in self.replicas) / (self.span_s / 60),
        }


def offered_scale(rows, replicas: int, capacity: int, target_load: float, costs: Costs) -> tuple[float, float, float]:
    """The factor on trace times that keeps a fleet's prefill ``target_load`` busy on the pooled-LRU bound
    (``replicas x capacity`` blocks), with that bound's hit rate and the infinite cache's."""
    span = max(rows[-1][0] - rows[0][0], 1e-9)
    pooled, pooled_work = lru_hit_rate(rows, replicas * capacity, costs.prefill_tok_s)
    infinite, _ = lru_hit_rate(rows, None, costs.prefill_tok_s)
    return pooled_work / (target_load * replicas * span), pooled, infinite


def compare_routers(
    rows,
    replicas: int,
    capacity: int,
    target_load: float,
    processes: int,
    runs: list[tuple[str, str, dict]],
    costs: Costs = Costs(),
    ttl: float = PREDICT_TTL_S,
    on_result: Callable[[str, dict], None] | None = None,
    host_capacity: int = 0,
    imbalance: float = BOUND_IMBALANCE,
    shortlist: int = 0,
    progress: Callable[[str, int], None] | None = None,
    adapters: list[int] | None = None,
) -> tuple[dict[str, float], dict[str, dict]]:
    """The cache bounds of ``rows`` (``benchmarks/harness/cache_bounds.py``: infinite, pooled LRU of ``replicas x
    capacity`` blocks, replication-aware at ``imbalance``, its ceiling and its placed floor) and, per run
    ``(label, policy name, policy kwargs)``, the simulated result with time scaled so that prefill (the
    contended resource) is ``target_load`` busy on the pooled bound. ``on_result`` sees each run as it ends.
    ``host_capacity``: blocks of each replica's host tier (0: none); the bounds and load ignore it.
    ``shortlist``, ``adapters``: as ``FleetSim``'s; ``progress(label, routed)`` hears from long runs."""
    scale, pooled, infinite = offered_scale(rows, replicas, capacity, target_load, costs)
    replicated = replicated_bound(rows, replicas, capacity, imbalance, pooled)
    results = {}
    for label, name, kw in runs:
        t0 = time.perf_counter()
        report = None if progress is None else lambda n, label=label: progress(label, n)
        sim = FleetSim(
            rows, replicas, capacity, name, kw, processes, scale, ttl, costs, host_capacity, shortlist, adapters
        )
        res = sim.run(report)
        res["sim_seconds"] = time.perf_counter() - t0
        results[label] = res
        if on_result is not None:
            on_result(label, res)
    bounds = {
        "infinite": infinite,
        "pooled_lru": pooled,
        "replicated": replicated.ceiling,
        "replicated_placed": replicated.placed,
    }
    return bounds, results
