"""The engine on quantized KV caches (fp8, int8, int4): pool sizing, end-to-end generation, calibrated scales."""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvmesh.cluster.launch.plan import model_shape
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.kv_dtype import MODEL_DTYPE_BYTES, kv_bytes_per_token
from kvmesh.replica import LLM, SamplingParams

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8", "int4"]
BUDGET = 1 << 20


def _prompts(n: int = 8) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 200))] for _ in range(n)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pool_holds_what_the_dtype_saves(tiny_llama_dir, dtype):
    """Same byte budget: the pool has budget // bytes-per-block blocks, allocates exactly those bytes, and
    ``kvmesh plan`` reading the model's config.json counts the same bytes per token."""
    shape = model_shape(json.loads((tiny_llama_dir / "config.json").read_text()), dtype)
    blocks = {}
    for kv in ["auto", *QUANTIZED]:
        engine = LLM(str(tiny_llama_dir), kv_cache_bytes=BUDGET, dtype=dtype, kv_cache_dtype=kv).engine
        per_block = 16 * kv_bytes_per_token(2, 2, 16, kv, torch.finfo(getattr(torch, dtype)).bits // 8)
        elem = MODEL_DTYPE_BYTES[shape.dtype]
        planned = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, kv, elem)
        assert planned * 16 == per_block
        assert engine.num_blocks == BUDGET // per_block
        allocated = sum(
            t.numel() * t.element_size()
            for layer in engine.runner.kv_caches
            for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)
            if t is not None and t.dim() > 1  # per-slot tensors; fp8 per-head scales are a few floats
        )
        assert allocated == engine.num_blocks * per_block
        blocks[kv] = engine.num_blocks
    assert blocks["fp8_e4m3"] == blocks["fp8_e5m2"] == (4 if dtype == "float32" else 2) * blocks["auto"]
    assert blocks["auto"] < blocks["int8"] < blocks["fp8_e4m3"] < blocks["int4"]


@pytest.mark.parametrize("kv", QUANTIZED)
def test_engine_generates_on_a_quantized_cache(tiny_llama_dir, kv):
    """Chunked prefill, decode across block boundaries and prefix hits all run on the quantized cache; a
    prefix-cache hit replays the same greedy tokens; first tokens agree with the full-precision cache."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = _prompts()
    full = LLM(str(tiny_llama_dir), num_kv_blocks=256).generate(prompts, params)
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=256, max_num_batched_tokens=64, kv_cache_dtype=kv)
    first = llm.generate(prompts, params)
    llm.engine.check_integrity()
    assert all(len(o.token_ids) == 16 for o in first)
    again = llm.generate(prompts, params)  # served from the cached (quantized) prefix blocks
    assert all(o.num_cached_tokens > 0 for o, p in zip(again, prompts, strict=True) if len(p) > 16)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert [o.token_ids[0] for o in first] == [o.token_ids[0] for o in full]
    llm.engine.check_integrity()


def test_fp8_scales_are_calibrated_per_head_and_reproducible(tiny_llama_dir):
    runners = [LLM(str(tiny_llama_dir), num_kv_blocks=32, kv_cache_dtype="fp8_e4m3").engine.runner for _ in range(2)]
    for a, b in zip(runners[0].kv_caches, runners[1].kv_caches, strict=True):
        assert a.k_scale.shape == (2,) and a.v_scale.shape == (2,)
        assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)
        assert bool((a.k_scale > 0).all()) and not torch.equal(a.k_scale.cpu(), torch.ones(2))


def test_unknown_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, fp8_e5m2, int8"):
        EngineConfig(kv_cache_dtype="fp4")


def test_kernels_and_sizing_know_the_same_dtypes():
    """``kernels/quant.py`` (storage) and ``core/kv_dtype.py`` (bytes) describe one set of formats."""
    from kvmesh.core.kv_dtype import KV_CACHE_DTYPES, KV_LAYOUTS
    from kvmesh.kernels.quant import KV_CACHE_STORAGE, values_per_element

    assert tuple(KV_CACHE_STORAGE) == KV_CACHE_DTYPES
    for name, storage in KV_CACHE_STORAGE.items():
        if storage is not None:
            assert KV_LAYOUTS[name].element_bits == 8 * storage.itemsize // values_per_element(storage)


@pytest.mark.parametrize("kv", QUANTIZED)
def test_forks_copy_quantized_blocks_with_their_scales(tiny_llama_dir, kv):
    """n=4 greedy on a quantized cache: the copied partial block carries its int8 scales, so every sequence
    equals the n=1 answer (a 37-token prompt leaves a partly filled block to copy)."""
    prompt = list(range(500, 537))
    single = (
        LLM(str(tiny_llama_dir), num_kv_blocks=64, kv_cache_dtype=kv)
        .generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        .token_ids
    )
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, kv_cache_dtype=kv)
    outs = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=4))
    assert [o.token_ids for o in outs] == [single] * 4
    llm.engine.check_integrity()
