"""The swap tier: preempted sequences move to host memory and come back instead of being recomputed."""

from __future__ import annotations

import pytest

from kvmesh.core.engine_config import EngineConfig
from kvmesh.replica import LLM, SamplingParams

PROMPTS = [list(range(300 + 50 * i, 345 + 50 * i)) for i in range(4)]  # 45 tokens each: 3 blocks
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _run(model_dir, **kwargs):
    llm = LLM(str(model_dir), dtype="float32", **kwargs)  # the block sizes below are fp32's, on any device
    outs = llm.generate(PROMPTS, GREEDY)
    llm.engine.check_integrity()
    return [o.token_ids for o in outs], llm.engine.stats(), llm.engine


@pytest.fixture(scope="module")
def unpressured(tiny_llama_dir):
    tokens, stats, _ = _run(tiny_llama_dir, num_kv_blocks=64)
    assert stats.num_preemptions == 0
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_swapped_sequences_resume_without_recomputing(tiny_llama_dir, unpressured, kv_cache_dtype):
    """A 12-block pool for four 85-token sequences forces preemptions; with swap every one of them swaps
    out and back, nothing is recomputed, and the greedy tokens equal the unpressured run's."""
    swap = {"preemption_mode": "swap", "swap_space_bytes": 1 << 20}
    tokens, stats, engine = _run(tiny_llama_dir, num_kv_blocks=12, kv_cache_dtype=kv_cache_dtype, **swap)
    assert stats.num_preemptions > 0 and stats.num_swapped_out == stats.num_preemptions
    assert engine.scheduler.num_swapped_in == stats.num_swapped_out
    assert stats.num_recomputed_tokens == 0
    assert engine.swap.num_free == engine.swap.num_blocks  # every host block came back
    if kv_cache_dtype == "auto":
        assert tokens == unpressured
    else:
        assert tokens == _run(tiny_llama_dir, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)[0]


def test_recompute_mode_and_a_full_swap_space_recompute(tiny_llama_dir, unpressured):
    tokens, stats, _ = _run(tiny_llama_dir, num_kv_blocks=12, preemption_mode="recompute")
    assert tokens == unpressured and stats.num_swapped_out == 0 and stats.num_recomputed_tokens > 0
    # A swap space of two blocks holds no 3-block sequence: those preemptions fall back to recompute.
    tokens, stats, engine = _run(tiny_llama_dir, num_kv_blocks=12, preemption_mode="swap", swap_space_bytes=1)
    assert engine.swap is None and tokens == unpressured and stats.num_recomputed_tokens > 0
    per_block = 16 * 2 * 2 * 2 * 16 * 4  # tokens x K,V x layers x KV heads x head_dim x fp32
    tokens, stats, engine = _run(
        tiny_llama_dir, num_kv_blocks=12, preemption_mode="swap", swap_space_bytes=2 * per_block
    )
    assert engine.swap.num_blocks == 2 and tokens == unpressured
    assert stats.num_preemptions > stats.num_swapped_out and stats.num_recomputed_tokens > 0


def test_auto_mode_swaps_long_sequences_and_recomputes_short_ones(tiny_llama_dir):
    """The cost model: two copies of a sequence's bytes at the measured host bandwidth vs its prefill."""
    engine = LLM(str(tiny_llama_dir), num_kv_blocks=32, dtype="float32").engine
    swap = engine.swap
    assert swap.num_blocks == 16 and swap.block_bytes == 8192  # half the pool; 16 x 2 x 2 x 2 x 16 x 4 B
    swap.copy_bytes_s, engine.rates.prefill_tok_s = 1e9, 1e5  # 16 us to move a block out and back; 10 us/token
    assert swap.worth_it(num_tokens=128, num_blocks=8)  # 131 us of copies < 1.28 ms of prefill
    assert not swap.worth_it(num_tokens=1, num_blocks=1)  # 16 us of copies > 10 us of prefill
    engine.rates.prefill_tok_s = 1e9  # a prefill nearly free: recompute always wins
    assert not swap.worth_it(num_tokens=128, num_blocks=8)
    engine.rates.prefill_tok_s = 1.0
    assert not swap.worth_it(num_tokens=10**6, num_blocks=17)  # does not fit


def test_aborting_a_swapped_request_returns_its_host_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=12, preemption_mode="swap", swap_space_bytes=1 << 20)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    while not engine.kv.num_swapped_blocks:
        engine.step()
    swapped = next(r for r in engine.scheduler.waiting if engine.kv.is_swapped(r))
    engine.abort_request(swapped.request_id)
    engine.check_integrity()
    while engine.has_unfinished:
        engine.step()
    engine.check_integrity()
    assert engine.swap.num_free == engine.swap.num_blocks and len(ids) == 4


def test_bad_swap_settings_are_clear_errors():
    with pytest.raises(ValueError, match="preemption_mode must be one of auto, swap, recompute"):
        EngineConfig(preemption_mode="offload")
    with pytest.raises(ValueError, match="swap_space_bytes must be >= 0"):
        EngineConfig(swap_space_bytes=-1)


def test_a_stall_while_measuring_the_copy_bandwidth_does_not_set_it(tiny_llama_dir, monkeypatch):
    """The bandwidth prices every host-tier load for routers and the swap decision: one timing taken while
    the process was descheduled (a busy core) must not make the tier look slower than recomputing."""
    import time

    from kvmesh.replica.swap import SwapSpace

    engine = LLM(str(tiny_llama_dir), num_kv_blocks=32, dtype="float32").engine
    steady = engine.swap._measure_bandwidth()
    copy, calls = SwapSpace._copy, []

    def stalled_once(*args):
        calls.append(1)
        if len(calls) == 2:  # the first timed copy (the one before it touches the pages)
            time.sleep(0.05)
        copy(*args)

    monkeypatch.setattr(SwapSpace, "_copy", staticmethod(stalled_once))
    measured = engine.swap._measure_bandwidth()
    stalled = 8 * engine.swap.block_bytes / 0.05
    assert measured > 10 * stalled and measured > steady / 10
