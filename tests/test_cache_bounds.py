"""The replication-aware bound against brute force: every placement of small traces, every replica's own cache."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.bench.harness.cache_bounds import (
    packed_placement,
    per_replica_cap,
    placed_hit_rate,
    replicated_bound,
    replication_misses,
)


def rows_of(chains):
    return [(float(t), [bytes([b]) for b in chain], 1) for t, chain in enumerate(chains)]


def best_placement(rows, replicas, capacity, cap):
    """The best hit rate of any placement that gives no replica more than ``cap`` requests."""
    best = 0.0
    for placement in itertools.product(range(replicas), repeat=len(rows)):
        if max(placement.count(r) for r in range(replicas)) <= cap:
            best = max(best, placed_hit_rate(rows, placement, replicas, capacity))
    return best


@st.composite
def prefix_traces(draw):
    """Up to 7 requests, each an earlier request's prefix (any length) extended by 0-2 new blocks."""
    chains, fresh = [], itertools.count()
    for _ in range(draw(st.integers(2, 7))):
        base = draw(st.sampled_from(chains)) if chains and draw(st.booleans()) else []
        keep = draw(st.integers(0, len(base)))
        chain = base[:keep] + [next(fresh) for _ in range(draw(st.integers(0 if keep else 1, 2)))]
        chains.append(chain)
    return rows_of(chains)


@settings(max_examples=60, deadline=None)
@given(prefix_traces(), st.integers(2, 3), st.sampled_from([1.0, 1.5, 2.0]))
def test_the_best_placement_lies_between_the_bounds(rows, replicas, imbalance):
    """Unbounded caches: no placement within the load cap beats the ceiling, and the trie-order placement is
    one of them, so the optimum is in [placed, ceiling]."""
    pooled = 1 - len({h for _, chain, _ in rows for h in chain}) / sum(len(c) for _, c, _ in rows)
    bound = replicated_bound(rows, replicas, None, imbalance, pooled)
    best = best_placement(rows, replicas, None, bound.cap)
    assert bound.placed - 1e-12 <= best <= bound.ceiling + 1e-12


@settings(max_examples=40, deadline=None)
@given(prefix_traces(), st.integers(1, 3))
def test_the_placement_is_reachable_with_small_caches(rows, capacity):
    """With caches of a few blocks the placed rate is still what some placement within the cap reaches."""
    pooled = 1.0  # no capacity reference: the ceiling is then the replication term alone
    bound = replicated_bound(rows, 2, capacity, 1.5, pooled)
    assert bound.placed <= best_placement(rows, 2, capacity, bound.cap) + 1e-12


def test_a_prefix_read_by_every_request_is_computed_once_per_replica_it_must_span():
    """Ten requests on one system prompt, at most three per replica: it is computed on four replicas, and
    the bound is exact (the best placement reaches it)."""
    rows = rows_of([[0, 1 + i] for i in range(10)])
    assert replication_misses(rows, 3) == 4 + 10
    bound = replicated_bound(rows, 4, None, 1.2, pooled=9 / 20)
    assert bound.cap == 3
    assert bound.ceiling == pytest.approx(6 / 20)
    assert bound.placed == pytest.approx(6 / 20)


def test_conversations_stay_whole_in_trie_order():
    """Turns of one conversation (each extending the last) are placed together even when they arrive
    interleaved with another conversation's."""
    a = [[0, 1], [0, 1, 2], [0, 1, 2, 3]]
    b = [[0, 4], [0, 4, 5], [0, 4, 5, 6]]
    rows = rows_of([a[0], b[0], a[1], b[1], a[2], b[2]])
    placement = packed_placement(rows, 2, 3)
    assert placement[0] == placement[2] == placement[4] != placement[1] == placement[3] == placement[5]


def test_the_load_cap_rounds_as_a_replica_count_must():
    assert per_replica_cap(10, 4, 1.0) == 3  # someone takes the remainder
    assert per_replica_cap(100, 8, 1.3) == 16
    with pytest.raises(ValueError, match="imbalance"):
        per_replica_cap(10, 4, 0.9)
    with pytest.raises(ValueError, match="cannot hold"):
        packed_placement(rows_of([[0]] * 5), 2, 2)
