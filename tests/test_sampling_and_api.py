"""Sampling settings, stop conditions, streaming deltas and input validation on a real (tiny) engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from replica import LLM, AsyncLLM, SamplingParams
from replica.sampler import _filter_top_k_top_p

PROMPT = "The history of the printing press begins"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), num_kv_blocks=64)


def sampled(**kw):
    return SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True, **kw)


def test_seed_reproducible_regardless_of_batch(llm):
    alone = llm.generate(PROMPT, sampled(seed=7))[0]
    batched = llm.generate(["other prompt one", PROMPT, "and a third"], [sampled(), sampled(seed=7), sampled(seed=3)])
    assert batched[1].token_ids == alone.token_ids
    assert llm.generate(PROMPT, sampled(seed=8))[0].token_ids != alone.token_ids


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    topk1 = llm.generate(PROMPT, sampled(top_k=1, seed=1))[0]
    assert topk1.token_ids == greedy.token_ids


def test_top_k_top_p_filter_keeps_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = _filter_top_k_top_p(logits, torch.tensor([0, 2]), torch.tensor([0.8, 1.0]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False]]


def test_stop_string_truncates_and_reports_stop(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip(), "tiny model produced whitespace; pick another prompt"
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    kept = llm.generate(
        PROMPT, SamplingParams(max_tokens=30, temperature=0, stop=[stop], include_stop_str_in_output=True)
    )
    assert kept[0].text.endswith(stop)


def test_stop_token_ids_and_max_tokens(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    target = full.token_ids[5]
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(target) + 1]


def test_streaming_deltas_add_up(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=25, temperature=0, ignore_eos=True))
    text, tokens, final = "", [], None
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == rid
            text += out.delta_text
            tokens += out.delta_token_ids
            final = out
    assert final.finished and text == final.text and tokens == final.token_ids


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"stop": [""]}],
)
def test_invalid_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_with_clear_errors(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="at most"):
        engine.add_request([5] * engine.max_request_tokens)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([10**9])
    assert not engine.has_unfinished


def test_max_tokens_none_stops_at_the_context(tiny_llama_dir):
    small = LLM(str(tiny_llama_dir), num_kv_blocks=64, max_model_len=48)
    out = small.generate([7] * 40, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_async_stream_and_abort_frees_blocks(llm):
    engine = llm.engine

    async def main():
        allm = AsyncLLM(engine)
        outs = [o async for o in allm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
        assert outs[-1].finished and len(outs[-1].token_ids) == 10
        assert "".join(o.delta_text for o in outs) == outs[-1].text

        long_greedy = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        await hang_up_after_three_tokens(allm, engine, PROMPT, long_greedy)

        with pytest.raises(ValueError, match="empty"):
            async for _ in allm.generate([], SamplingParams()):
                pass
        await allm.shutdown()

    asyncio.run(main())


def test_stats_report_hits_and_usage(llm):
    llm.engine.reset_prefix_cache()
    before = llm.stats()
    shared = list(range(500, 564))
    first = llm.generate([*shared, 1], SamplingParams(max_tokens=2, temperature=0))[0]
    second = llm.generate([*shared, 2], SamplingParams(max_tokens=2, temperature=0))[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 64)
    after = llm.stats()
    assert after.num_cached_blocks >= 4 and after.kv_usage == 0.0
    assert after.prefix_hit_rate > before.prefix_hit_rate


async def hang_up_after_three_tokens(allm, engine, prompt, params: SamplingParams) -> None:
    """A client that reads three tokens and hangs up: the request (every sequence of it) is aborted at
    once and its blocks freed."""
    stream = allm.generate(prompt, params)
    async for out in stream:
        if len(out.token_ids) >= 3:
            break
    await stream.aclose()
    for _ in range(100):
        if not engine.has_unfinished:
            break
        await asyncio.sleep(0.01)
    assert not engine.has_unfinished and engine.pool.num_used == 0
    engine.check_integrity()
