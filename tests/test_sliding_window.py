"""Sliding-window models: greedy output equal to Hugging Face's, a bounded cache on long generations,
and prefix caching that stays correct."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, Qwen3Config

from kvmesh.replica import LLM, SamplingParams
from kvmesh.replica.llama import layer_windows

WINDOW = 24
COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _save(config, path, smollm_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # sharpen the random head so greedy argmax is not decided by float noise
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    shutil.copy(smollm_dir / "tokenizer.json", path / "tokenizer.json")
    shutil.copy(smollm_dir / "tokenizer_config.json", path / "tokenizer_config.json")
    return path


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory, smollm_dir):
    """Mistral style: every layer attends within the last WINDOW tokens."""
    config = MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW, head_dim=16)
    return _save(config, tmp_path_factory.mktemp("tiny-mistral"), smollm_dir)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, smollm_dir):
    """Hybrid (Gemma-2 style alternation, in a Qwen3 config): local and global layers interleaved."""
    config = Qwen3Config(
        **COMMON,
        num_hidden_layers=4,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    return _save(config, tmp_path_factory.mktemp("tiny-hybrid"), smollm_dir)


def _hf_greedy(model_dir, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        gen = hf.generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        out.append(gen[0, len(ids) :].tolist())
    return out


PROMPTS = [list(range(300, 300 + n)) for n in (5, 20, 30, 61)]  # shorter than, across and beyond the window


@pytest.mark.parametrize("model", ["mistral", "hybrid"])
def test_windowed_models_match_hf_greedy(model, mistral_dir, hybrid_dir):
    path = mistral_dir if model == "mistral" else hybrid_dir
    windows = layer_windows(AutoConfig.from_pretrained(path))
    assert windows == ([WINDOW] * 2 if model == "mistral" else [WINDOW, None, WINDOW, None])
    expected = _hf_greedy(path, PROMPTS, 40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for kwargs in ({}, {"max_num_batched_tokens": 16}, {"block_size": 8, "num_kv_blocks": 24}):  # +chunks, +pressure
        llm = LLM(str(path), **kwargs)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected, kwargs
        llm.engine.check_integrity()


def test_cache_stays_bounded_far_past_the_window(mistral_dir, hybrid_dir):
    """Mistral: a 600-token generation holds ~window/block_size blocks. Hybrid: global layers need it all."""
    params = SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)
    for path, bounded in ((mistral_dir, True), (hybrid_dir, False)):
        llm = LLM(str(path), num_kv_blocks=64)
        engine = llm.engine
        engine.add_request(list(range(300, 320)), params)
        peak = 0
        while engine.has_unfinished:
            engine.step()
            peak = max(peak, engine.pool.num_used)
            engine.check_integrity()
        if bounded:
            assert peak <= -(-WINDOW // 16) + 2  # the window's blocks, the block being written, one spare
        else:
            assert peak == -(-620 // 16)


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_prefix_hits_on_a_windowed_model_replay_exactly(mistral_dir, kv):
    """A long prompt's blocks are released behind the window but stay cached: a second request with the
    same prefix hits them and generates exactly what a cold engine generates (on either cache)."""
    prompt = list(range(400, 520))
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    cold = LLM(str(mistral_dir), enable_prefix_caching=False, kv_cache_dtype=kv)
    cold = cold.generate([[*prompt, 7, 8, 9]], params)[0].token_ids
    llm = LLM(str(mistral_dir), kv_cache_dtype=kv)
    llm.generate([[*prompt, 1, 2, 3]], params)
    warm = llm.generate([[*prompt, 7, 8, 9]], params)[0]
    assert warm.num_cached_tokens >= 112
    assert warm.token_ids == cold
    llm.engine.check_integrity()


def test_forks_on_a_windowed_model(mistral_dir):
    """n=3 greedy sequences past the window (blocks released while shared) all equal the n=1 answer."""
    prompt = list(range(300, 341))
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    llm = LLM(str(mistral_dir), num_kv_blocks=48)
    single = llm.generate([prompt], params)[0].token_ids
    llm.engine.reset_prefix_cache()
    outs = llm.generate([prompt], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, n=3))
    assert [o.token_ids for o in outs] == [single] * 3
    llm.engine.check_integrity()


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_swap_on_a_windowed_model(mistral_dir, kv):
    """Swapped-out windowed sequences save only the blocks still in window and resume exactly."""
    prompts = [list(range(300 + 60 * i, 330 + 60 * i)) for i in range(4)]  # 2 blocks each, growing to 3
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = LLM(str(mistral_dir), num_kv_blocks=64, kv_cache_dtype=kv).generate(prompts, params)
    expected = [o.token_ids for o in expected]
    swap = {"preemption_mode": "swap", "swap_space_bytes": 1 << 20}
    llm = LLM(str(mistral_dir), num_kv_blocks=9, kv_cache_dtype=kv, **swap)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.num_swapped_out > 0 and stats.num_recomputed_tokens == 0
    llm.engine.check_integrity()
