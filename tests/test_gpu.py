"""The CUDA path: Triton kernels compiled for the GPU, and the engine serving on it.

Skipped without a CUDA device (CI has none); run on a GPU machine with ``python -m pytest tests/test_gpu.py``.
The CPU suite runs the same kernels under Triton's interpreter; only a GPU compiles them, so shapes the
interpreter accepts but the compiler rejects, and out-of-bounds accesses the interpreter forgives, show up
here. Shapes are larger than the interpreter's (contexts up to 2k tokens, batches up to 16).
"""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from transformers import AutoTokenizer

from kvmesh.bench.harness.kv_quality import teacher_forced_logprobs
from kvmesh.kernels.reference import paged_attention_reference, store_kv_reference
from kvmesh.kernels.triton_attention import paged_attention_triton, store_kv_triton
from kvmesh.replica import LLM, SamplingParams
from tests.conftest import real_smollm_weights
from tests.kernel_cases import (
    check_against_reference,
    check_quantized,
    random_batch,
    relative_error,
    to_device,
)
from tests.test_engine_vs_hf import PROMPTS, hf_greedy
from tests.test_host_tier import BLOCK, make, run

BIG = {"max_len": 2000, "max_batch": 16}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_kernels_match_reference(case, dtype):
    seed = 5000 + case * 7 + int(dtype.itemsize)
    check_against_reference(
        store_kv_triton, paged_attention_triton, seed, case, dtype, TOLERANCE[dtype], device="cuda", **BIG
    )


@pytest.mark.parametrize("case", range(4))
def test_compiled_sliding_window_matches_reference(case):
    window = [1, 9, 40, 500][case]
    check_against_reference(
        store_kv_triton,
        paged_attention_triton,
        6000 + case,
        case,
        torch.bfloat16,
        TOLERANCE[torch.bfloat16],
        window,
        device="cuda",
        **BIG,
    )


@pytest.mark.parametrize("case", range(2))
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_quantized_cache_matches_dequantized_reference(case, kv_dtype, dtype):
    seed = 7000 + case * 17 + len(kv_dtype)
    check_quantized(
        store_kv_triton, paged_attention_triton, seed, case, kv_dtype, dtype, TOLERANCE[dtype], device="cuda", **BIG
    )


def test_compiled_block_size_eight_and_odd_head_dim():
    meta, q, k, v, kc, vc = random_batch(random.Random(5), 8, 2, 3, 80, max_len=700, max_batch=6)
    store_kv_reference(k, v, kc, vc, meta.slot_mapping)
    expected = paged_attention_reference(q, kc, vc, meta, 80**-0.5)
    dev = [t.float().cuda() for t in (q, kc, vc)]
    assert relative_error(paged_attention_triton(*dev, to_device(meta, "cuda"), 80**-0.5), expected) <= 1e-5


@pytest.mark.parametrize("splits", [2, 4, 16, 64])
@pytest.mark.parametrize("case", range(4))
def test_compiled_split_kv_decode_matches_reference(case, splits):
    """Flash-decoding on the GPU: contexts up to 2k split into parts, partial softmaxes combined."""
    check_against_reference(
        store_kv_triton,
        paged_attention_triton,
        8000 + 13 * case + splits,
        case,
        torch.bfloat16,
        TOLERANCE[torch.bfloat16],
        [None, 300][case % 2],
        device="cuda",
        splits=splits,
        **BIG,
    )


def test_cuda_graph_replay_equals_eager_across_changing_batches(tiny_llama_dir):
    """Decode steps replayed from CUDA graphs (batches padded to their bucket, sizes changing as requests
    finish, are preempted and fork) give the eager engine's greedy tokens. (Greedy: padding changes the
    GEMMs' row count, and a sampled draw near a boundary can feel the last bits, as with any batch change.)"""
    prompts = [list(range(100, 120 + 9 * i)) for i in range(7)]
    params = [
        SamplingParams(max_tokens=8 + 6 * i, temperature=0, ignore_eos=True, n=3 if i == 3 else 1) for i in range(7)
    ]
    runs = {}
    for eager in (True, False):
        llm = LLM(
            str(tiny_llama_dir), device="cuda", dtype="float32", num_kv_blocks=24, max_num_seqs=12, enforce_eager=eager
        )
        assert (llm.engine.runner.graphs is None) == eager
        runs[eager] = [(o.request_id, o.index, o.token_ids) for o in llm.generate(prompts, params)]
        assert llm.engine.stats().num_preemptions > 0
        if not eager:
            assert llm.engine.runner.graphs.steps > 20 and llm.engine.runner.graphs.padded_steps > 0
    assert runs[False] == runs[True]


@pytest.fixture(scope="module")
def smol_ids(smollm_dir):
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    return [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"max_num_batched_tokens": 24}, {"num_kv_blocks": 10}],
    ids=["batched", "chunked-prefill", "preemption"],
)
def test_engine_on_cuda_fp32_matches_hf_on_cuda(smollm_dir, smol_ids, kwargs):
    """fp32 on the GPU: the engine (Triton kernels) gives HF's greedy tokens, under chunking and preemption."""
    expected = hf_greedy(smollm_dir, smol_ids, 32, "cuda")
    llm = LLM(str(smollm_dir), device="cuda", dtype="float32", **kwargs)
    outs = llm.generate(smol_ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used == 0


def fp8_cache_quality(device: str, smollm_dir, prompt_ids: list[list[int]]) -> tuple[float, float]:
    """Teacher-forced on HF's fp32 greedy continuations: top-1 agreement and mean |log p| difference of an
    fp8 (e4m3) KV cache against the full-precision cache, both fp32 models on ``device``.

    Free-running greedy tokens are the wrong check: fp8 flips near-ties early (on the CPU a quarter of the
    tokens come before the first difference, ``benchmarks/results/kv_quant.json``), and every later token
    then differs.
    """
    continuations = hf_greedy(smollm_dir, prompt_ids, 32, device)
    full = LLM(str(smollm_dir), device=device, dtype="float32")
    fp8 = LLM(str(smollm_dir), device=device, dtype="float32", kv_cache_dtype="fp8_e4m3")
    top1, diff = [], []
    for ids, cont in zip(prompt_ids, continuations, strict=True):
        a, b = (teacher_forced_logprobs(llm, ids + cont, len(ids)).cpu() for llm in (full, fp8))
        picked = torch.tensor(cont)[:, None]
        top1.append(float((a.argmax(-1) == b.argmax(-1)).float().mean()))
        diff.append(float((a.gather(1, picked) - b.gather(1, picked)).abs().mean()))
    return sum(top1) / len(top1), sum(diff) / len(diff)


def test_engine_on_cuda_fp8_cache_keeps_the_distribution(smollm_dir, smol_ids):
    """The CPU measured top-1 0.956 and |dlog p| 0.053 for fp8 e4m3 (kv_quant.json); the GPU's Triton path
    (its own quantize kernel) must be as good, within margins."""
    if not real_smollm_weights(smollm_dir):
        pytest.skip("margins calibrated on SmolLM2's real weights; this is the random-weight stand-in")
    top1, diff = fp8_cache_quality("cuda", smollm_dir, smol_ids)
    assert top1 >= 0.9 and diff <= 0.1, (top1, diff)


def test_engine_on_cuda_bf16_prefix_hits_and_the_serving_default(smollm_dir, smol_ids):
    """bf16 (the GPU default): prefix-cache hits reproduce the cold run's tokens, and the output agrees with
    HF bf16 on the GPU at the start of every sequence (bf16 rounding differs between the two afterwards)."""
    llm = LLM(str(smollm_dir), dtype="bfloat16")
    assert llm.engine.runner.device.type == "cuda" and llm.engine.runner.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    cold = [o.token_ids for o in llm.generate(smol_ids, params)]
    warm = llm.generate(smol_ids, params)
    assert all(o.num_cached_tokens > 0 for o, p in zip(warm, smol_ids, strict=True) if len(p) > 16)
    if real_smollm_weights(smollm_dir):  # random weights' near-ties flip with bf16 rounding at any token
        hf = hf_greedy(smollm_dir, smol_ids, 16, "cuda", torch.bfloat16)
        assert all(c[:4] == h[:4] for c, h in zip(cold, hf, strict=True))
    agree = sum(w.token_ids == c for w, c in zip(warm, cold, strict=True))
    assert agree >= len(cold) - 1, f"only {agree}/{len(cold)} prompts gave the same tokens from the prefix cache"


def test_host_tier_on_cuda_loads_pinned_copies_that_give_the_computed_tokens(tiny_llama_dir):
    """The host prefix tier on a GPU: its blocks live in pinned host memory, evicted device blocks are copied
    out to it, and a prefix loaded back from it gives the tokens that computing it gives."""

    model = str(tiny_llama_dir)  # fp32: the loaded and the computed prefix must agree exactly
    blind, tiered = make(model, 0, dtype="float32"), make(model, 64, dtype="float32")
    assert tiered.runner.device.type == "cuda" and tiered.swap._host[0][0].is_pinned()
    history = [100 + i for i in range(10 * BLOCK)]
    follow_up = [*history, 7, 8, 9]
    reference, _ = run(blind, follow_up)
    run(tiered, history)
    for k in range(3):  # other conversations evict the whole history from the 24-block device pool
        run(tiered, [5000 + 300 * k + i for i in range(15 * BLOCK)])
    before = tiered.stats()
    tokens, cached = run(tiered, follow_up)
    assert tokens == reference and cached == 10 * BLOCK
    assert tiered.stats().cached_prompt_tokens_host - before.cached_prompt_tokens_host == 10 * BLOCK


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_lora_update_matches_the_torch_definition(dtype):
    """The Triton LoRA kernels compiled: 32 adapters of ranks 8 to 64 over SmolLM2's fused q/k/v widths, 1 to
    40 tokens each, one adapter without the projection."""
    from kvmesh.kernels.lora import lora_update_torch
    from kvmesh.kernels.triton_lora import lora_tiles, lora_update_triton, stack_pairs

    torch.manual_seed(0)
    bounds, width_in = [0, 576, 768, 960], 576
    ranks = [None, *[(8, 16, 32, 64)[i % 4] for i in range(31)]]
    counts = [1 + (7 * i) % 40 for i in range(len(ranks))]
    pairs = [(torch.randn(3 * r, width_in) * 0.1, torch.randn(r, 960) * 0.1) if r else None for r in ranks]
    tokens = sum(counts) + 9
    x, y = torch.randn(tokens, width_in), torch.randn(tokens, 960)
    rows = torch.randperm(tokens)[: sum(counts)]
    seg = [0, *torch.tensor(counts).cumsum(0).tolist()]
    a, b = stack_pairs([p and (p[0].to(dtype).cuda(), p[1].to(dtype).cuda()) for p in pairs], 3)
    got = y.to(dtype).cuda()
    lora_update_triton(got, x.to(dtype).cuda(), a, b, rows.cuda(), lora_tiles(seg, torch.device("cuda")), bounds)
    want = y.to(dtype).double()
    none = torch.empty(0, dtype=torch.float64)
    a_list = [p[0].to(dtype).double() if p else none for p in pairs]
    b_list = [p[1].to(dtype).double() if p else none for p in pairs]
    lora_update_torch(want, x.to(dtype).double(), a_list, b_list, rows, seg, bounds)
    before = y.to(dtype).double()
    assert relative_error(got.cpu().double() - before, want - before) <= TOLERANCE[dtype]
