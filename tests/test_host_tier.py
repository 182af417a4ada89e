"""The host prefix tier on a real (tiny) engine: blocks the device pool evicts are kept in host memory and
loaded back on a later hit, giving the same tokens as computing them."""

from __future__ import annotations

import pytest

from kvmesh.core.hashing import hash_blocks
from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def run(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and the prefix hit of one request run alone to completion."""
    rid = engine.add_request(prompt, GREEDY)
    tokens, cached = [], -1
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.delta_token_ids
                cached = out.num_cached_tokens
        engine.check_integrity()
    return tokens, cached


def make(
    model: str, host_tier_blocks: int, device_blocks: int = 24, dtype: str | None = None, kv_cache_dtype: str = "auto"
) -> LLMEngine:
    probe = LLMEngine(
        EngineConfig(
            model=model,
            block_size=BLOCK,
            num_kv_blocks=1,
            swap_space_bytes=0,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
        )
    )
    per_block = probe.bytes_per_block
    return LLMEngine(
        EngineConfig(
            model=model,
            block_size=BLOCK,
            num_kv_blocks=device_blocks,
            swap_space_bytes=0,
            host_cache_bytes=host_tier_blocks * per_block,
            max_num_batched_tokens=512,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
        )
    )


@pytest.fixture(scope="module", params=["auto", "int4"])
def engines(tiny_llama_dir, request):
    model = str(tiny_llama_dir)
    return make(model, 0, kv_cache_dtype=request.param), make(model, 64, kv_cache_dtype=request.param)


def test_a_prefix_evicted_from_the_device_is_served_from_the_host_tier(engines):
    """Also on an int4 cache: the host tier keeps the packed bytes and their scales."""
    blind, tiered = engines
    history = [100 + i for i in range(10 * BLOCK)]  # a conversation's 10 full blocks
    follow_up = [*history, 7, 8, 9]
    reference, _ = run(blind, follow_up)  # the same request on an engine that must compute everything
    blind.reset_prefix_cache()

    run(tiered, history)
    for k in range(3):  # other conversations fill the 24-block pool and evict every block of the history
        run(tiered, [5000 + 300 * k + i for i in range(15 * BLOCK)])
    on_device = [tiered.pool.lookup(h) for h in hash_blocks(history, BLOCK, tiered.hash_seed)]
    assert not any(on_device), "the other conversations were meant to evict the whole history"
    before = tiered.stats()
    assert before.host_tier_used_blocks >= 10 and before.host_tier_blocks == 64

    tokens, cached = run(tiered, follow_up)
    assert tokens == reference, "a prefix loaded from the host tier must give the tokens computing it gives"
    assert cached == 10 * BLOCK, "every block of the history counts as cached"
    after = tiered.stats()
    assert after.cached_prompt_tokens_host - before.cached_prompt_tokens_host == 10 * BLOCK, "served by the host"
    assert after.num_recomputed_tokens == before.num_recomputed_tokens


def test_without_a_host_tier_the_evicted_prefix_is_recomputed(engines):
    blind, _ = engines
    history = [900 + i for i in range(10 * BLOCK)]
    run(blind, history)
    for k in range(3):
        run(blind, [9000 + 300 * k + i for i in range(15 * BLOCK)])
    _, cached = run(blind, [*history, 1, 2])
    assert cached == 0


def test_the_host_tier_is_bounded_and_keeps_the_most_recent_blocks(tiny_llama_dir):
    engine = make(str(tiny_llama_dir), host_tier_blocks=8)
    for k in range(6):
        run(engine, [20_000 + 400 * k + i for i in range(15 * BLOCK)])
    assert engine.stats().host_tier_used_blocks == 8
    engine.check_integrity()
    assert engine.reset_prefix_cache() and engine.stats().host_tier_used_blocks == 0
