"""Parallel sampling (``n > 1``) on a real (tiny) engine: one prefill, copy-on-write forks, exact block counts.

Every run steps the engine by hand and checks the pool's integrity after every step.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh.replica import AsyncLLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from kvmesh.replica.kv_events import BlockStored
from tests.test_sampling_and_api import hang_up_after_three_tokens

BLOCK = 16
PARTIAL = list(range(100, 137))  # 37 tokens: 2 full blocks + a last block with 5 slots written
FULL = list(range(200, 232))  # 32 tokens: exactly 2 full blocks


def make_engine(model_dir, num_blocks: int = 96, caching: bool = True, **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir), block_size=BLOCK, num_kv_blocks=num_blocks, enable_prefix_caching=caching, **kw
    )
    return LLMEngine(config)


def greedy(max_tokens: int = 24, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)


def sampled(seed: int | None, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True, seed=seed, n=n)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, max_seqs: int | None = None) -> list[list[int]]:
    """Generate one request to the end, checking integrity (and the seat limit) after every step; the
    token ids of its sequences by index."""
    rid = engine.add_request(prompt, params)
    final: dict[int, RequestOutput] = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == rid
            if out.finished:
                final[out.index] = out
        engine.check_integrity()
        assert len(engine.scheduler.running) <= (max_seqs or engine.scheduler.max_num_seqs)
    assert sorted(final) == list(range(params.n))
    assert engine.pool.num_used == 0 and not engine.requests
    return [final[i].token_ids for i in range(params.n)]


@pytest.fixture(scope="module")
def shared_engine(tiny_llama_dir) -> LLMEngine:
    """Synchronous: these tests count steps and read the KV cache between them. The engines built in the
    other tests run the default asynchronous loop."""
    return make_engine(tiny_llama_dir, async_scheduling=False)


@pytest.fixture
def engine(shared_engine):
    """The module's engine with an empty prefix cache; whatever a test leaves running is aborted after it."""
    assert shared_engine.reset_prefix_cache()
    shared_engine.pool.reset_peak()
    yield shared_engine
    for rid in list(shared_engine.requests):
        shared_engine.abort_request(rid)
    shared_engine.kv_event_sinks.clear()


@pytest.mark.parametrize("prompt", [PARTIAL, FULL], ids=["partial-last-block", "full-last-block"])
@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_greedy_children_equal_the_single_run(tiny_llama_dir, prompt, caching):
    engine = make_engine(tiny_llama_dir, caching=caching)
    (single,) = run(engine, prompt, greedy())
    engine.reset_prefix_cache()
    assert run(engine, prompt, greedy(n=4)) == [single] * 4


def test_seeded_children_differ_reproduce_and_equal_single_runs_seeded_by_index(engine):
    """Child i samples with seed + i: it equals the n=1 request seeded seed + i. That needs the K/V of the
    copied partial block to be right, since these children write different tokens into it."""
    children = run(engine, PARTIAL, sampled(seed=7, n=4))
    assert len({tuple(c) for c in children}) == 4
    engine.reset_prefix_cache()
    assert run(engine, PARTIAL, sampled(seed=7, n=4)) == children
    assert [run(engine, PARTIAL, sampled(seed=7 + i))[0] for i in range(4)] == children
    unseeded = run(engine, PARTIAL, sampled(seed=None, n=4))
    assert len({tuple(c) for c in unseeded}) > 1


def blocks_of(engine: LLMEngine) -> list[list[int]]:
    return [engine.kv.block_ids(r) for r in engine.scheduler.running]


def test_memory_after_a_fork_grows_only_by_the_copied_partial_block(engine):
    pool = engine.pool
    engine.add_request(PARTIAL, greedy(max_tokens=40, n=4))
    engine.step()  # prefill 37 tokens once, fork, sample one token per child
    tables = blocks_of(engine)
    assert len(tables) == 4 and all(t == tables[0] for t in tables)
    assert pool.num_used == 3 and [pool.blocks[b].ref_count for b in tables[0]] == [4, 4, 4]
    shared_partial = tables[0][2]
    k_before = [layer.k[shared_partial, :5].clone() for layer in engine.runner.kv_caches]

    engine.step()  # each child writes slot 5 of the partial block: 3 copy it, the last writes in place
    engine.check_integrity()
    tables = blocks_of(engine)
    assert pool.num_used == 3 + 3
    assert [t[:2] for t in tables] == [tables[0][:2]] * 4
    assert [pool.blocks[b].ref_count for b in tables[0][:2]] == [4, 4]
    partials = [t[2] for t in tables]
    assert len(set(partials)) == 4 and shared_partial in partials
    assert all(pool.blocks[b].ref_count == 1 for b in partials)
    for layer, before in zip(engine.runner.kv_caches, k_before, strict=True):
        for b in partials:  # every copy holds the prompt's 5 slots, all layers
            torch.testing.assert_close(layer.k[b, :5], before, rtol=0, atol=0)

    for _ in range(10):  # up to position 47: still within the partial block
        engine.step()
    assert pool.num_used == 6
    engine.step()  # position 48: one fresh block per child, no copy
    assert pool.num_used == 6 + 4
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    assert pool.num_used == 0
    # 37 + 39 tokens of KV per child (the last sampled token is never computed): blocks 0-4, of which 0-1 shared.
    assert pool.peak_used == 2 + 4 * 3


def test_a_prompt_of_full_blocks_forks_without_copying(engine):
    engine.add_request(FULL, greedy(n=3))
    engine.step()
    assert engine.pool.num_used == 2
    engine.step()  # position 32 opens a new block per child; the shared ones are never written
    assert engine.pool.num_used == 2 + 3
    assert all(t[:2] == blocks_of(engine)[0][:2] for t in blocks_of(engine))


def test_full_blocks_are_published_once_and_serve_later_requests(engine):
    stored: list[bytes] = []
    engine.kv_event_sinks[:] = [lambda events: stored.extend(e.block_hash for e in events if type(e) is BlockStored)]
    outputs = run(engine, PARTIAL, greedy(max_tokens=40, n=4))
    # Greedy children compute identical blocks: each hash is announced once, whichever copies hold it.
    assert len(stored) == len(set(stored)) == (len(PARTIAL) + 40 - 1) // BLOCK
    assert set(stored) == set(engine.pool.cached_hashes())
    rid = engine.add_request(PARTIAL + outputs[0], greedy(max_tokens=1))
    out = engine.step()[0]
    assert out.request_id == rid and out.num_cached_tokens == 4 * BLOCK  # 77 tokens: 4 full blocks cached
    engine.check_integrity()


def test_no_leak_when_forks_finish_or_are_aborted_midway(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=24, max_num_seqs=12)
    keep = engine.add_request(PARTIAL, greedy(max_tokens=12, n=3))
    in_prefill = engine.add_request(list(range(300, 360)), greedy(n=4))
    forked = engine.add_request(FULL, greedy(max_tokens=30, n=4))
    aborted_forked = False
    for step in range(40):
        engine.step()
        engine.check_integrity()
        if step == 1:
            assert engine.requests[in_prefill][0].fork_pending  # still prefilling its 60 tokens in chunks
            assert engine.abort_request(in_prefill)
        if step == 8:
            assert len(engine.requests[forked]) == 4 and engine.requests[forked][3].output_token_ids
            assert engine.abort_request(forked)  # all four children at once
            assert not engine.abort_request(forked)
            aborted_forked = True
        if not engine.has_unfinished:
            break
    assert aborted_forked and keep not in engine.requests and not engine.has_unfinished
    assert engine.pool.num_used == 0 and engine.pool.num_free == engine.num_blocks


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_preemption_of_forked_children_keeps_the_greedy_output(tiny_llama_dir, caching):
    """A pool of 9 blocks cannot hold four 77-token children (2 shared + 4 x 3 private blocks): children
    are preempted and recomputed alone, and every one still equals the single run."""
    (single,) = run(make_engine(tiny_llama_dir), PARTIAL, greedy(max_tokens=40))
    engine = make_engine(tiny_llama_dir, num_blocks=9, caching=caching)
    assert run(engine, PARTIAL, greedy(max_tokens=40, n=4)) == [single] * 4
    assert engine.stats().num_preemptions > 0


def test_a_fork_reserves_its_seats_at_admission(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_num_seqs=4)
    first = engine.add_request(FULL, greedy(max_tokens=30))
    fork = engine.add_request(PARTIAL, greedy(max_tokens=4, n=4))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == [first]  # 1 + 4 seats > 4: the fork waits
    while first in engine.requests:
        engine.step()
        assert len(engine.scheduler.running) <= 4
    engine.step()
    assert len(engine.requests[fork]) == 4
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request(PARTIAL, greedy(n=5))
    while engine.has_unfinished:
        engine.step()


def test_batch_api_returns_n_outputs_per_prompt_in_index_order(tiny_llama_dir):
    from kvmesh.replica import LLM

    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64)
    outs = llm.generate([PARTIAL, FULL], [greedy(max_tokens=5, n=3), greedy(max_tokens=5)])
    assert [(o.index, len(o.token_ids)) for o in outs] == [(0, 5), (1, 5), (2, 5), (0, 5)]
    assert len({o.request_id for o in outs[:3]}) == 1 and outs[3].request_id != outs[0].request_id


def test_async_stream_interleaves_children_and_aborts_them_all(engine):

    async def main():
        allm = AsyncLLM(engine)
        outs = [o async for o in allm.generate(PARTIAL, greedy(max_tokens=6, n=3))]
        assert sorted(o.index for o in outs if o.finished) == [0, 1, 2] and outs[-1].finished
        texts = ["".join(o.delta_text for o in outs if o.index == i) for i in range(3)]
        assert texts == [o.text for o in sorted((o for o in outs if o.finished), key=lambda o: o.index)]

        await hang_up_after_three_tokens(allm, engine, PARTIAL, greedy(max_tokens=500, n=3))  # all children end
        await allm.shutdown()

    asyncio.run(main())
