"""Presence and frequency penalties against their definition, batched, forked and under async scheduling."""

from __future__ import annotations

import pytest
import torch

from kvmesh.core.errors import InvalidRequest
from kvmesh.replica import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8] * 3, [100, 200, 300], [42] * 9]
SETTINGS = [(0.0, 1.5), (2.0, 0.0), (0.5, -0.7)]  # (presence, frequency) per prompt


def reference(model, prompt: list[int], presence: float, frequency: float, n: int) -> list[int]:
    """Greedy decoding with OpenAI's penalties written out: logit -= frequency x count + presence x [count > 0],
    counting the generated tokens only."""
    tokens, out = list(prompt), []
    counts = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        logits -= frequency * counts + presence * (counts > 0).double()
        token = int(logits.argmax())
        counts[token] += 1
        tokens.append(token)
        out.append(token)
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_with_penalties_matches_the_definition(tiny_llama_dir, hf_model, async_scheduling):
    """Penalised rows share batches with a plain one; each row's counts are its own, and a step launched
    before the previous step's tokens reached the host (async scheduling) still counts them."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, async_scheduling=async_scheduling)
    params = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=p, frequency_penalty=f)
        for p, f in SETTINGS
    ]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate([*PROMPTS, PROMPTS[0]], [*params, plain])
    for prompt, (p, f), out in zip(PROMPTS, SETTINGS, outs, strict=False):
        assert out.token_ids == reference(hf_model, prompt, p, f, 24)
    assert outs[3].token_ids == reference(hf_model, PROMPTS[0], 0.0, 0.0, 24)
    assert outs[0].token_ids != outs[3].token_ids  # the penalty changed what the plain row repeats
    # The rows were freed and reused: the same requests again give the same tokens.
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:3]]


def test_forked_sequences_count_their_own_tokens(tiny_llama_dir):
    """Choice i of a seeded n-request samples as the n=1 request with seed + i: with a penalty that holds
    only if each sequence's counts are its own."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)

    def params(seed: int, n: int = 1) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=1.0, seed=seed, n=n, frequency_penalty=2.0, ignore_eos=True)

    forked = llm.generate(PROMPTS[1], params(11, n=3))
    alone = [llm.generate(PROMPTS[1], params(11 + i))[0] for i in range(3)]
    assert [o.token_ids for o in forked] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in forked}) > 1


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.5, -3, float("nan")])
def test_penalties_out_of_range_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
