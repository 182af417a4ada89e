"""The routing policies kvmesh is measured against, each a faithful, working implementation.

- ``round_robin``: cycles through replicas.
- ``pow2``: power of two choices on load (Ray Serve's default router).
- ``session_hash``: rendezvous hashing on the session id (else on the prompt's first blocks) with bounded
  load (a replica more than ``1 + epsilon`` times the mean load is skipped).
- ``approx_tree``: the SGLang router / Ray PrefixCacheAffinityRouter approach: each router process keeps an
  approximate record of what it sent where and routes to the best match if the match rate passes
  ``cache_threshold``, unless load is imbalanced (``balance_abs_threshold`` and ``balance_rel_threshold``,
  SGLang's defaults), in which case it routes to the least loaded. It records block hashes instead of
  characters: the same structure (a prefix-closed set per replica) at block granularity.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import random

import xxhash

from kvmesh.router.policy import Decision, KVAwarePolicy, ReplicaLoad, RouteRequest, RoutingPolicy, least_loaded
from kvmesh.router.prefix_lru import PrefixLRU


class RoundRobinPolicy:
    name = "round_robin"
    uses_index = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(
        self, req: RouteRequest, replicas: list[ReplicaLoad], device_hits=None, shared_starts=None, *tiers, **fleet
    ) -> Decision:
        ids = sorted(r.index_id for r in replicas)
        k = next(self._counter) % len(ids)
        return Decision(ids[k:] + ids[:k], "round_robin")

    def on_routed(self, req: RouteRequest, index_id: str, decision: Decision) -> None:
        pass


class PowerOfTwoPolicy:
    name = "pow2"
    uses_index = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(
        self, req: RouteRequest, replicas: list[ReplicaLoad], device_hits=None, shared_starts=None, *tiers, **fleet
    ) -> Decision:
        pair = self._rng.sample(replicas, min(2, len(replicas)))
        pair.sort(key=lambda r: (r.num_requests, r.index_id))
        first = [r.index_id for r in pair]
        rest = [rid for rid in least_loaded(replicas) if rid not in first]
        return Decision(first + rest, "pow2")

    def on_routed(self, req: RouteRequest, index_id: str, decision: Decision) -> None:
        pass


class SessionHashPolicy:
    name = "session_hash"
    uses_index = False

    def __init__(self, epsilon: float = 0.25, key_blocks: int = 4) -> None:
        self.epsilon = epsilon
        self.key_blocks = key_blocks

    def _key(self, req: RouteRequest) -> bytes | None:
        if req.session_id:
            return req.session_id.encode()
        if req.block_hashes:
            return req.block_hashes[min(self.key_blocks, len(req.block_hashes)) - 1]
        return None

    def preferred(self, req: RouteRequest, index_ids: list[str], k: int) -> list[str]:
        """The ``k`` replicas the request's key hashes highest on: the only ones ``rank`` could pick first
        unless all of them are over the load bound (a simulator's shortlist for a thousand replicas)."""
        key = self._key(req)
        if key is None:
            return []
        return heapq.nlargest(k, index_ids, key=lambda rid: xxhash.xxh3_64_intdigest(key + rid.encode()))

    def rank(
        self, req: RouteRequest, replicas: list[ReplicaLoad], device_hits=None, shared_starts=None, *tiers, **fleet
    ) -> Decision:
        key = self._key(req)
        if key is None:
            return Decision(least_loaded(replicas), "no_key")
        order = sorted(replicas, key=lambda r: xxhash.xxh3_64_intdigest(key + r.index_id.encode()), reverse=True)
        bound = (1 + self.epsilon) * (sum(r.num_requests for r in replicas) + 1) / len(replicas)
        within = [r.index_id for r in order if r.num_requests + 1 <= bound]
        over = [r.index_id for r in order if r.num_requests + 1 > bound]
        reason = "hash" if within and within[0] == order[0].index_id else "bounded_load"
        return Decision(within + over, reason)

    def on_routed(self, req: RouteRequest, index_id: str, decision: Decision) -> None:
        pass


class ApproxTreePolicy:
    name = "approx_tree"
    uses_index = False

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        max_blocks_per_replica: int = 1 << 20,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_blocks = max_blocks_per_replica
        self._trees: dict[str, PrefixLRU] = {}

    def _match(self, index_id: str, block_hashes) -> int:
        tree = self._trees.get(index_id)
        return tree.leading(block_hashes) if tree else 0

    def rank(
        self, req: RouteRequest, replicas: list[ReplicaLoad], device_hits=None, shared_starts=None, *tiers, **fleet
    ) -> Decision:
        counts = [r.num_requests for r in replicas]
        spread = max(counts) - min(counts)
        imbalanced = spread > self.balance_abs_threshold and max(counts) > self.balance_rel_threshold * min(counts)
        if imbalanced:
            return Decision(least_loaded(replicas), "imbalanced")
        matches = {r.index_id: self._match(r.index_id, req.block_hashes) for r in replicas}
        best = max(replicas, key=lambda r: (matches[r.index_id], -r.num_requests))
        rate = matches[best.index_id] / max(len(req.block_hashes), 1)
        if rate > self.cache_threshold:
            rest = [rid for rid in least_loaded(replicas) if rid != best.index_id]
            return Decision([best.index_id, *rest], "tree_match", matches[best.index_id])
        # Low match: the replica with the smallest tree, i.e. the most free cache.
        order = sorted(replicas, key=lambda r: (len(self._trees.get(r.index_id, ())), r.num_requests, r.index_id))
        return Decision([r.index_id for r in order], "smallest_tree")

    def on_routed(self, req: RouteRequest, index_id: str, decision: Decision) -> None:
        self._trees.setdefault(index_id, PrefixLRU(self.max_blocks)).touch(req.block_hashes)


POLICIES: dict[str, type] = {
    p.name: p for p in (KVAwarePolicy, RoundRobinPolicy, PowerOfTwoPolicy, SessionHashPolicy, ApproxTreePolicy)
}


def make_policy(name: str, **kwargs) -> RoutingPolicy:
    """The policy selected by one config value (``router_policy``), with its keyword settings (``policy_kwargs``).

    A setting the policy does not take, or of the wrong type, is a ``ValueError`` naming the settings it takes."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}") from None
    try:
        return cls(**kwargs)
    except TypeError as exc:
        takes = [p for p in inspect.signature(cls).parameters if p not in ("clock", "seed")]
        raise ValueError(f"policy_kwargs of {name}: {exc}; it takes {', '.join(takes) or 'none'}") from None
