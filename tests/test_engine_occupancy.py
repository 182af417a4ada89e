"""The engine-occupancy summary of ``benchmarks/peer_routers.py --probe-load``."""

import pytest

from kvmesh.bench.harness.engine_occupancy import summarize


def test_busy_engines_and_queued_requests_are_counted_per_sample():
    samples = [
        [(0, 0), (0, 0), (0, 0)],  # all idle
        [(1, 0), (0, 0), (0, 0)],  # one running
        [(2, 1), (1, 0), (0, 0)],  # two busy, one request waiting
        [(0, 1), (1, 0), (3, 0)],  # a waiting request alone makes an engine busy
    ]
    out = summarize(samples)
    assert out["samples"] == 4
    assert out["busy_engines_share"] == pytest.approx([0.25, 0.25, 0.25, 0.25])
    assert out["waiting_share"] == pytest.approx(0.5)


def test_no_samples_give_no_shares():
    assert summarize([]) == {"samples": 0, "busy_engines_share": [], "waiting_share": None}
