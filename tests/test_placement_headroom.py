"""The placement estimate of ``kvmesh bench peer_routers``: which requests a router could still place better."""

import json

import pytest

from kvmesh.bench.harness.placement_estimate import estimate, placed_on_freest, reanalyse

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
    assert out["floor_s"] == pytest.approx((0.1 + 0.5 + 1.25) / 3)  # 16 uncached: the shortest length's time
    assert out["held_wait_s"] == pytest.approx(0.9 - 0.1)


def test_a_saved_run_is_recomputed_request_by_request(tmp_path):
    requests = [
        {"prompt_tokens": 400, "cached_tokens": 384, "ttft_s": 0.3},
        {"prompt_tokens": 256, "cached_tokens": 0, "ttft_s": 0.7},
    ]
    run = {"ttft_mean_s": 0.5, "per_request": requests}
    saved = {"idle_ttft_s": {str(n): s for n, s in IDLE.items()}, "runs": {"multi_turn": {"smg": [run, run]}}}
    path = tmp_path / "peer_routers.json"
    path.write_text(json.dumps(saved))
    rows = reanalyse(path)
    assert [r[:3] for r in rows] == [["multi_turn", "smg", 1], ["multi_turn", "smg", 2]]
    mean, held, est, floor, wait, freest = rows[0][3:]
    assert (mean, held, freest) == (500, "50%", "-")  # rows without engines and send times: not judged
    assert (est, floor, wait) == pytest.approx((400, 300, 200))


def test_placed_requests_are_judged_by_the_prefills_in_flight_when_they_were_sent():
    def row(replica, sent, ttft, cached=0):
        return {"prompt_tokens": 300, "cached_tokens": cached, "ttft_s": ttft, "replica": replica, "sent_at_s": sent}

    rows = [
        row("a", 0.0, 2.0),  # placed: nothing in flight anywhere, so any engine is the freest
        row("b", 0.5, 1.0),  # placed beside nothing on b: freest
        row("a", 1.0, 1.5),  # placed on a (one in flight) while c had none: not the freest
        row("b", 1.2, 0.4, cached=288),  # held by its prefix: not judged, though b was busy
        row("c", 3.0, 0.5),  # every earlier request had its first token: freest
        row("c", 3.1, None),  # failed: not counted
    ]
    assert placed_on_freest(rows) == (3, 4)


def test_a_run_without_answers_has_no_estimate():
    out = estimate([{"prompt_tokens": 10, "cached_tokens": 0, "ttft_s": None}], IDLE)
    assert out == {"held_share": None, "estimate_s": None, "floor_s": None, "held_wait_s": None}
