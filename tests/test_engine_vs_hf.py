"""Greedy output of our engine must equal Hugging Face transformers' ``generate`` token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvmesh.replica import LLM, SamplingParams

CHAT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time in a land far away, there lived a dragon who",
    "1, 2, 3, 4,",
    CHAT + "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    CHAT + "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Explain quantum computing in simple terms. " * 6,
    "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
]
NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def hf_greedy(
    model_dir, prompt_ids: list[list[int]], new_tokens: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = []
    for ids in prompt_ids:  # one at a time: no padding in the reference
        gen = hf.generate(
            torch.tensor([ids], device=device),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module")
def smol(smollm_dir):
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, hf_greedy(smollm_dir, ids, NEW_TOKENS)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("batched", {}),
        ("no-prefix-cache", {"enable_prefix_caching": False}),
        ("chunked-prefill", {"max_num_batched_tokens": 24}),
        ("preemption", {"num_kv_blocks": 10}),
    ],
)
def test_smollm2_greedy_matches_hf(smol, name, kwargs):
    ids, expected = smol
    llm = LLM(**kwargs)
    outs = llm.generate(ids, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    stats = llm.stats()
    if name == "preemption":
        assert stats.num_preemptions > 0
    llm.engine.check_integrity()
    assert stats.num_running == stats.num_waiting == 0 and llm.engine.pool.num_used == 0


def test_smollm2_prefix_hits_give_the_same_tokens(smol):
    ids, expected = smol
    llm = LLM()
    llm.generate(ids, GREEDY)
    again = llm.generate(ids, GREEDY)  # every prompt's full blocks are now cached
    assert [o.token_ids for o in again] == expected
    for o, p in zip(again, ids, strict=True):
        assert o.num_cached_tokens == ((len(p) - 1) // 16) * 16
    # Chat prompts share the system prompt: a cold engine already hits it for the second one.
    fresh = LLM()
    first, second = fresh.generate([ids[4]], GREEDY)[0], fresh.generate([ids[5]], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 16
    assert second.token_ids == expected[5]


def test_tiny_gqa_llama_matches_hf(tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    expected = hf_greedy(tiny_llama_dir, ids, 24)
    for kwargs in ({}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 8}):
        llm = LLM(str(tiny_llama_dir), **kwargs)
        outs = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outs] == expected, kwargs
        llm.engine.check_integrity()
