"""The asynchronous step loop gives exactly the synchronous loop's outputs.

With ``async_scheduling`` a step is scheduled and launched before the previous one's tokens are on the
host (its inputs are filled on the device), forks happen at launch, stop strings are found one step late
(the extra token is dropped) and aborts can land while a step is in flight. The same mixed workload runs
synchronously, asynchronously (the same code path with the device run inline, as in CI on a CPU) and
asynchronously with the forward pass in a worker thread (the CPU's overlap): every output must agree.
"""

from __future__ import annotations

import pytest

from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams

MODES = {
    "sync": {"async_scheduling": False},
    "async": {"async_scheduling": True},
    "async+thread": {"async_scheduling": True, "device_thread": True},
}


def workload(stop: str) -> list[tuple[list[int], SamplingParams]]:
    greedy = dict(temperature=0, ignore_eos=True)
    return [
        (list(range(100, 140)), SamplingParams(max_tokens=30, **greedy)),
        (list(range(100, 140)), SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)),
        (list(range(300, 310)), SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=5, n=3)),
        (list(range(500, 620)), SamplingParams(max_tokens=40, stop=[stop], **greedy)),
        (list(range(700, 705)), SamplingParams(max_tokens=1, **greedy)),
        (list(range(800, 880)), SamplingParams(max_tokens=50, temperature=1.0, min_p=0.1, seed=9, ignore_eos=True)),
    ]


def run(model_dir, mode: str, stop: str, abort_at: int | None = None, **config) -> dict:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), num_kv_blocks=16, max_num_seqs=6, max_num_batched_tokens=64, **MODES[mode], **config
        )
    )
    ids = [engine.add_request(p, params, f"r{i}") for i, (p, params) in enumerate(workload(stop))]
    finals, texts, steps = {}, {}, 0
    while engine.has_unfinished:
        for out in engine.step():
            key = (out.request_id, out.index)
            texts[key] = texts.get(key, "") + out.delta_text
            if out.finished:
                finals[key] = (out.token_ids, out.text, out.finish_reason)
        engine.check_integrity()
        steps += 1
        if abort_at is not None and steps == abort_at:
            engine.abort_request(ids[1])
    assert engine.pool.num_used == 0 and not engine.requests
    assert engine.stats().num_preemptions > 0, "the pool was meant to overflow"
    for key, (_, text, _) in finals.items():
        assert texts[key] == text, "streamed deltas must add up to the final text"
    return finals


@pytest.mark.parametrize(
    "config", [{}, {"preemption_mode": "recompute"}, {"preemption_mode": "swap"}], ids=["default", "recompute", "swap"]
)
def test_async_and_threaded_loops_match_the_synchronous_one(tiny_llama_dir, config):
    """A small pool (preemptions), chunked prefills, n=3 forks, a stop string, a one-token request."""
    sync = run(tiny_llama_dir, "sync", stop="zz")
    stop = sync[("r3", 0)][1][10:13]  # a stop string the greedy request really produces
    assert stop.strip()
    sync = run(tiny_llama_dir, "sync", stop=stop, **config)
    assert sync[("r3", 0)][2] == "stop" and len(sync) == 8
    assert run(tiny_llama_dir, "async", stop=stop, **config) == sync
    assert run(tiny_llama_dir, "async+thread", stop=stop, **config) == sync


def test_an_abort_while_a_step_is_in_flight_frees_everything(tiny_llama_dir):
    for mode in MODES:
        finals = run(tiny_llama_dir, mode, stop="zz", abort_at=3)
        assert ("r1", 0) not in finals and len(finals) == 7
