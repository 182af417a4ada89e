"""The Triton kernels, run by Triton's interpreter on the CPU, against the float64 references.

``TRITON_INTERPRET=1`` must be set before triton is first imported (``conftest.py`` sets it where there is no
CUDA). Shapes stay small: the interpreter executes every program instance in numpy.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from kvmesh.kernels.lora import lora_update_torch  # noqa: E402
from kvmesh.kernels.reference import paged_attention_reference, store_kv_reference  # noqa: E402
from kvmesh.kernels.triton_attention import paged_attention_triton, store_kv_triton  # noqa: E402
from kvmesh.kernels.triton_lora import lora_tiles, lora_update_triton, stack_pairs  # noqa: E402
from kvmesh.replica import LLM, SamplingParams  # noqa: E402
from tests.kernel_cases import check_against_reference, check_quantized, random_batch, relative_error  # noqa: E402
from tests.lora_helpers import ALL_MODULES, make_adapter  # noqa: E402


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_triton_kernels_match_reference(case, dtype, tol):
    seed = 1000 + case * 31 + (dtype == torch.float16)
    check_against_reference(store_kv_triton, paged_attention_triton, seed, case, dtype, tol, max_len=160, max_batch=4)


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize("case", range(4))
def test_split_kv_decode_matches_reference(case, splits):
    """Flash-decoding: each decode context split into parts whose partial softmaxes are combined (some parts
    empty for short contexts), with and without a sliding window; extend rows in the same batch."""
    seed, shape = 4000 + 7 * case + splits, {"max_len": 200, "max_batch": 3}
    window = [None, 50][case % 2]
    check_against_reference(
        store_kv_triton, paged_attention_triton, seed, case, torch.float32, 1e-5, window, splits=splits, **shape
    )


@pytest.mark.parametrize("case", range(4))
def test_triton_sliding_window_matches_reference(case):
    window = [1, 9, 40, 500][case]
    seed, shape = 3000 + case, {"max_len": 120, "max_batch": 3}
    check_against_reference(store_kv_triton, paged_attention_triton, seed, case, torch.float32, 1e-5, window, **shape)


@pytest.mark.parametrize("case", range(2))
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8", "int4"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_triton_quantized_cache_matches_dequantized_reference(case, kv_dtype, dtype, tol):
    seed = 2000 + case * 17 + len(kv_dtype) + (dtype == torch.float16)
    check_quantized(store_kv_triton, paged_attention_triton, seed, case, kv_dtype, dtype, tol, max_len=96, max_batch=3)


@pytest.mark.parametrize("window", [5, 40])
def test_triton_int4_cache_with_sliding_windows(window):
    kernels, seed = (store_kv_triton, paged_attention_triton), 2100 + window
    check_quantized(*kernels, seed, 1, "int4", torch.float32, 1e-5, window=window, max_len=96)


def test_store_kv_skips_negative_slots_and_touches_nothing_else():
    kc = torch.full((2, 8, 2, 64), float("nan"))
    vc = kc.clone()
    k = torch.randn(3, 2, 64)
    slots = torch.tensor([9, -1, 0])
    store_kv_triton(k, -k, kc, vc, slots)
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(kc[0, 0], k[2]) and torch.equal(vc[0, 0], -k[2])
    assert int(torch.isnan(kc).flatten(2).all(-1).sum()) == 16 - 2


def test_block_size_eight_and_odd_head_dim():
    rng = random.Random(5)
    meta, q, k, v, kc, vc = random_batch(rng, 8, 2, 3, 80, max_len=70, max_batch=3)
    store_kv_reference(k, v, kc, vc, meta.slot_mapping)
    expected = paged_attention_reference(q, kc, vc, meta, 80**-0.5)
    out = paged_attention_triton(q.float(), kc.float(), vc.float(), meta, 80**-0.5)
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_engine_greedy_tokens_equal_with_triton_and_torch_paths(tiny_llama_dir, monkeypatch, kv_cache_dtype):
    prompts = [list(range(200, 200 + n)) for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "torch")
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    assert [len(t) for t in expected] == [6, 6, 6]
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "triton")  # read when an engine picks its kernels
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, max_num_batched_tokens=32, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.kernels.backend == "triton"
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_triton_lora_update_matches_the_torch_definition(dtype, tol):
    """Adapters of ranks 4, 8 and 16 stacked and zero-padded, one without the projection, segments of 1 to 20
    tokens (more than one tile), parts of widths off the column blocks; rows without an adapter untouched."""
    torch.manual_seed(0)
    width_in, bounds, counts = 69, [0, 64, 83, 99], [3, 20, 5, 1]
    ranks = [4, 8, None, 16]
    pairs = [(torch.randn(3 * r, width_in), torch.randn(r, 99)) if r else None for r in ranks]
    tokens = sum(counts) + 5
    x, y = torch.randn(tokens, width_in).to(dtype), torch.randn(tokens, 99).to(dtype)
    rows = torch.randperm(tokens)[: sum(counts)]
    seg = [0, *torch.tensor(counts).cumsum(0).tolist()]
    got = y.clone()
    a, b = stack_pairs([p and (p[0].to(dtype), p[1].to(dtype)) for p in pairs], 3)
    lora_update_triton(got, x, a, b, rows, lora_tiles(seg, x.device), bounds)
    want = y.double()
    none = torch.empty(0, dtype=torch.float64)
    a_list = [p[0].to(dtype).double() if p else none for p in pairs]
    lora_update_torch(
        want, x.double(), a_list, [p[1].to(dtype).double() if p else none for p in pairs], rows, seg, bounds
    )
    assert relative_error(got, want) <= tol
    untouched = torch.ones(tokens, dtype=torch.bool)
    untouched[rows[: seg[2]]] = untouched[rows[seg[3] :]] = False
    assert torch.equal(got[untouched], y[untouched])


def test_engine_with_adapters_gives_the_same_tokens_on_the_triton_and_torch_paths(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """A batch mixing the base model and two adapters: the stacked Triton LoRA kernels give the tokens the
    torch path gives."""
    for seed, name in enumerate(("a", "b")):
        make_adapter(tiny_llama_dir, tmp_path / name, 8 * (seed + 1), ALL_MODULES, seed, scale=0.5)
    modules = {name: str(tmp_path / name) for name in ("a", "b")}
    prompts = [list(range(300 + 7 * i, 300 + 7 * i + n)) for i, n in enumerate((5, 23, 17, 9))]
    loras = [None, "a", "b", "a"]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", backend)
        with LLM(str(tiny_llama_dir), num_kv_blocks=32, enable_lora=True, lora_modules=modules) as llm:
            assert (llm.engine.runner.lora_stacks is not None) == (backend == "triton")
            outs[backend] = [o.token_ids for o in llm.generate(prompts, params, lora=loras)]
    assert outs["triton"] == outs["torch"]
    assert outs["torch"][1] != outs["torch"][2]  # the adapters matter


def test_decode_splits_fill_four_programs_per_multiprocessor_in_powers_of_two(monkeypatch):
    """The split the H200 sweep found best: batch x parts x KV heads near 4 programs per SM (132 SMs, 8 KV
    heads: 64 / 32 / 16 / 8 parts at batch 1 / 2 / 4 / 8), never parts under 128 tokens, none past 64."""
    from kvmesh.kernels import metadata

    monkeypatch.setattr(metadata, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert [metadata.decode_splits(b, 8, 32768, cuda) for b in (1, 2, 4, 8, 16, 64, 256)] == [64, 32, 16, 8, 4, 1, 1]
    assert metadata.decode_splits(1, 8, 1024, cuda) == 8  # 128 tokens a part at least
    assert metadata.decode_splits(1, 1, 1 << 20, cuda) == 64
    assert metadata.decode_splits(1, 8, 100, cuda) == 1


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4"])
def test_decode_attention_runs_at_every_split_count_before_serving(tiny_llama_dir, monkeypatch, kv_cache_dtype):
    """``compile_decode_splits`` (a CUDA engine's start) launches the real decode kernel at each split count a
    step may choose, 1 to 64, on the engine's own cache and kernels, so Triton compiles each before a request
    waits on it; it writes nothing to the cache."""
    import kvmesh.kernels.triton_attention as triton_attention

    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "triton")
    runner = LLM(str(tiny_llama_dir), num_kv_blocks=16, kv_cache_dtype=kv_cache_dtype).engine.runner
    launched, kernel = [], triton_attention._decode_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launched.append(meta["SPLITS"])
                return kernel[grid](*args, **meta)

            return launch

    monkeypatch.setattr(triton_attention, "_decode_kernel", Recording())
    before = [t.clone() for t in (runner.kv_caches[0].k, runner.kv_caches[0].v)]
    assert runner.compile_decode_splits() == 7
    assert launched == [1, 2, 4, 8, 16, 32, 64]
    assert all(torch.equal(a, b) for a, b in zip(before, (runner.kv_caches[0].k, runner.kv_caches[0].v), strict=True))


def test_compiled_kernels_take_any_block_table_width_without_a_new_compile():
    """On a GPU Triton compiles a kernel per specialization of its integer arguments (multiples of 16 apart):
    the block table's width changes every step (the step's longest context), so a width first met while
    serving would hold that step for a compile (0.5-0.8 s stalls on an H200). The attention kernels, as
    compiled (not interpreted), must not specialize on it."""
    code = (
        "from kvmesh.kernels import triton_attention as t\n"
        "for k in (t._decode_kernel, t._extend_kernel):\n"
        "    print(k.fn.__name__, [p.do_not_specialize for p in k.params if p.name == 'stride_bt'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["_decode_kernel [True]", "_extend_kernel [True]"]
