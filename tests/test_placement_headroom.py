"""The placement estimate of ``benchmarks/peer_routers.py``: which requests a router could still place better."""

import pytest

from benchmarks.placement_headroom import estimate

IDLE = {16: 0.1, 256: 0.5, 1024: 2.0}


def test_held_requests_keep_their_ttft_and_placed_ones_get_the_idle_engines():
    rows = [
        {"prompt_tokens": 400, "cached_tokens": 384, "ttft_s": 0.9},  # a next turn, held where its history is
        {"prompt_tokens": 400, "cached_tokens": 144, "ttft_s": 1.5},  # 256 uncached: idle engine 0.5 s
        {"prompt_tokens": 640, "cached_tokens": 0, "ttft_s": 3.0},  # between 256 and 1024: 1.25 s
        {"prompt_tokens": 50, "cached_tokens": 0, "ttft_s": None},  # failed: not counted
    ]
    out = estimate(rows, IDLE)
    assert out["held_share"] == pytest.approx(1 / 3)
    assert out["estimate_s"] == pytest.approx((0.9 + 0.5 + 1.25) / 3)


def test_a_run_without_answers_has_no_estimate():
    assert estimate([{"prompt_tokens": 10, "cached_tokens": 0, "ttft_s": None}], IDLE) == {
        "held_share": None,
        "estimate_s": None,
    }
