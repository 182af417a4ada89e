"""Sampling settings, stop conditions, streaming deltas and input validation on a real (tiny) engine."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from kvmesh.core.errors import InvalidRequest, RequestFailed
from kvmesh.replica import LLM, AsyncLLM, SamplingParams

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


def test_logit_bias_forces_and_bans_tokens_greedy_and_sampled(llm):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPT, greedy)[0].token_ids
    forced = 1234 if plain[0] != 1234 else 1235
    biased = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={forced: 100}),
        SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, seed=3, logit_bias={forced: 100}),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={plain[0]: -100}),
        greedy,
    ]
    outs = llm.generate([PROMPT] * 4, biased)  # one batch: each row gets only its own biases
    assert outs[0].token_ids == [forced] * 6 and outs[1].token_ids == [forced] * 6
    assert outs[2].token_ids[0] != plain[0] and plain[0] not in outs[2].token_ids
    assert outs[3].token_ids == plain


def test_min_tokens_bans_the_stop_tokens_until_reached(llm):
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    stop = plain[0]  # greedy would stop at once
    early = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop]))[0]
    assert len(early.token_ids) == 1 and early.finish_reason == "stop"
    held = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop], min_tokens=3, logit_bias={stop: 100})
    out = llm.generate(PROMPT, held)[0]
    assert stop not in out.token_ids[:3] and out.token_ids[3] == stop and out.finish_reason == "stop"


def test_logprobs_are_the_models_raw_log_probabilities(llm, tiny_llama_dir):
    """Each generated token's logprob and top-5 alternatives: greedy picks the most likely, probabilities
    sum to at most 1, the values equal a teacher-forced forward pass of the Hugging Face model, they do not
    depend on the batch, and ``logit_bias`` / temperature do not change them (raw logits, as vLLM)."""
    import torch
    from transformers import AutoModelForCausalLM

    want = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=5)
    alone = llm.generate(PROMPT, want)[0]
    batch = llm.generate(["another prompt", PROMPT], [SamplingParams(max_tokens=3), want])
    assert [(lp.token_id, round(lp.logprob, 4)) for lp in batch[1].logprobs] == [
        (lp.token_id, round(lp.logprob, 4)) for lp in alone.logprobs
    ]
    assert batch[0].logprobs is None
    assert [lp.token_id for lp in alone.logprobs] == alone.token_ids
    for lp in alone.logprobs:
        assert len(lp.top) == 5 and lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(lp.top[0][1])
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-5
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = llm.engine.tokenizer.encode(PROMPT) + alone.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    start = len(ids) - len(alone.token_ids) - 1
    for i, lp in enumerate(alone.logprobs):
        assert lp.logprob == pytest.approx(ref[start + i, lp.token_id].item(), abs=1e-3)
    forced = alone.token_ids[0] + 1
    biased = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.7, logprobs=0, logit_bias={forced: 100}))
    (lp,) = biased[0].logprobs
    assert lp.token_id == forced and lp.top == [] and lp.logprob == pytest.approx(ref[start, forced].item(), abs=1e-3)


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
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 1e308}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
        ({"stop": [5]}, "stop"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"json_schema": "[1, 2]"}, "response_format"),
        ({"json_schema": "{not json"}, "response_format"),
    ],
)
def test_invalid_sampling_params_are_rejected_naming_the_field(kwargs, param):
    with pytest.raises(InvalidRequest) as bad:
        SamplingParams(**kwargs)
    assert bad.value.param == param and param in str(bad.value)


def test_bounds_that_need_the_model_are_checked_when_a_request_is_added(llm):
    engine = llm.engine
    vocab = engine.loaded.config.vocab_size
    assert SamplingParams(top_k=vocab).top_k == vocab  # the whole vocabulary is allowed
    cases = [
        ({"params": SamplingParams(top_k=vocab + 1)}, "top_k"),
        ({"params": SamplingParams(stop_token_ids=[vocab])}, "stop_token_ids"),
        ({"params": SamplingParams(logit_bias={vocab: 1.0})}, "logit_bias"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
        ({"request_id": "r" * 257}, "request_id"),
    ]
    for kwargs, param in cases:
        with pytest.raises(InvalidRequest) as bad:
            engine.add_request(PROMPT, **kwargs)
        assert bad.value.param == param, kwargs
    assert not engine.has_unfinished


def _run_to_end(engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.check_integrity()
    return outputs


@pytest.mark.parametrize("stage", ["sampling", "forward"])
def test_a_request_that_fails_the_step_fails_alone(llm, stage):
    """A request whose data breaks a step (here a bad value planted past the validator, as a bug in it
    would let through) ends with an error naming the cause; the requests batched with it produce exactly
    the tokens they produce alone."""
    engine = llm.engine
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = sampled(seed=11)
    alone = [llm.generate(PROMPT, greedy)[0].token_ids, llm.generate("A second prompt", seeded)[0].token_ids]

    ok_ids = [engine.add_request(PROMPT, greedy), engine.add_request("A second prompt", seeded)]
    bad = engine.add_request("This one breaks the step", sampled(seed=3))
    victim = engine.requests[bad][0]
    if stage == "sampling":
        victim.params.top_k = 2**63  # overflows the sampler's int64 tensors
    else:
        victim.all_token_ids[-1] = 10**12  # an embedding lookup out of range
    outputs = _run_to_end(engine)

    assert [outputs[rid][-1].token_ids for rid in ok_ids] == alone
    assert [o.finish_reason for o in outputs[bad]] == ["error"]
    assert outputs[bad][0].error and "Error" in outputs[bad][0].error
    assert engine.pool.num_used == 0 and not engine.requests


def test_a_failing_request_does_not_end_other_streams(llm):
    """Through the asyncio API: the failing request's stream raises ``RequestFailed``, a stream running
    at the same time completes with the tokens it gets alone."""
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].token_ids

    async def main():
        allm = AsyncLLM(engine)

        async def good():
            return [o async for o in allm.generate(PROMPT, params)][-1].token_ids

        async def bad():
            stream = allm.generate("Break the step", sampled(seed=1), request_id="bad")
            first = await anext(stream)  # its prompt step ran; plant the fault for the next one
            assert first.token_ids
            engine.requests["bad"][0].params.top_k = 2**63
            async for _ in stream:
                pass

        task = asyncio.create_task(good())
        with pytest.raises(RequestFailed, match="Error"):
            await bad()
        tokens = await task
        await allm.shutdown()
        return tokens

    assert asyncio.run(main()) == alone
    assert not engine.has_unfinished and engine.pool.num_used == 0


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


def test_a_request_received_during_a_step_is_reported_waiting(llm, monkeypatch):
    """A request that arrives while a step runs waits for it to end before the engine sees it; the load a
    router reads must count it, or an engine mid-step looks idle for as long as its step lasts."""
    engine = llm.engine
    running, release = threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        running.set()
        release.wait(30)
        return step()

    monkeypatch.setattr(engine, "step", held_step)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def main():
        allm = AsyncLLM(engine)
        first = asyncio.create_task(drain(allm.generate(list(range(100, 140)), params)))
        try:
            assert await asyncio.to_thread(running.wait, 30)
            before = engine.stats()
            second = asyncio.create_task(drain(allm.generate(list(range(200, 264)), params)))
            await asyncio.sleep(0.05)  # received: queued behind the held step
            during = allm.stats()
            assert engine.stats().num_waiting == before.num_waiting  # the engine itself has not seen it
            assert during.num_waiting == before.num_waiting + 1
            assert during.pending_prefill_tokens == before.pending_prefill_tokens + 64
            assert during.waiting_blocks == before.waiting_blocks + -(-64 // engine.block_size)
        finally:
            release.set()
        await asyncio.gather(first, second)
        assert allm.stats().num_waiting == 0
        await allm.shutdown()

    asyncio.run(main())


async def drain(stream):
    return [out async for out in stream]
