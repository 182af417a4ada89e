"""Prompt log-probabilities (``prompt_logprobs``, what ``echo`` with ``logprobs`` reports) against Hugging Face."""

from __future__ import annotations

import pytest
import torch

from kvmesh.replica import LLM, SamplingParams

PROMPT = list(range(300, 300 + 70))  # 70 tokens: several blocks, and several chunks below


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    """log P(token t | tokens < t) for t = 1.., and the 3 most likely at each position, in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, :-1].double(), dim=-1)
    chosen = lp.gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    return chosen.tolist(), lp.topk(3, dim=-1).indices.tolist()


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_match_hf_whole_chunked_and_past_a_cached_prefix(tiny_llama_dir, expected, chunk):
    """Every prompt token after the first gets its log-probability and alternatives, once, whether the
    prompt is computed in one step or in chunks, and even when its prefix is in the cache (such a request
    computes its prompt in full)."""
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, **kw)
    llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))  # caches the prompt's blocks
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3, n=2)
    other, first, second = llm.generate([PROMPT[:40], PROMPT, PROMPT][:3], [plain, scored, scored])[:3]
    chosen, top = expected
    for out in (first, second):  # both choices of the n=2 request carry them
        got = out.prompt_logprobs
        assert [e.token_id for e in got] == PROMPT[1:]
        assert max(abs(a.logprob - b) for a, b in zip(got, chosen, strict=True)) < 1e-4
        assert [[i for i, _ in e.top] for e in got] == top
    assert other.prompt_logprobs is None
    assert first.token_ids == llm.generate(PROMPT, plain)[0].token_ids  # the completion is unchanged
