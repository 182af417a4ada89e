"""The CPU torch path of the attention kernels against the float64 reference, on random paged batches."""

from __future__ import annotations

import pytest
import torch

import kvmesh.kernels.torch_attention
from kvmesh.kernels.cpu_extension import cpu_op
from kvmesh.kernels.torch_attention import paged_attention_torch, store_kv_torch
from tests.kernel_cases import check_against_reference, check_quantized


def test_cpu_kernels_build():
    """CI has a compiler: the kernels must build, so a broken build can't hide behind the torch fallbacks."""
    assert all(cpu_op(name) is not None for name in ("paged_decode", "paged_prefill", "sample_rows", "rms_norm"))


@pytest.mark.parametrize("case", range(12))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("route", ["kernel", "gather"])
def test_torch_path_matches_reference(case, dtype, tol, route, monkeypatch):
    """Both CPU routes (the compiled decode and prefill kernels, and the gather + SDPA fallback) against
    float64, on batches mixing decode rows with prefill and extend rows of every length."""
    if route == "gather":
        monkeypatch.setattr(kvmesh.kernels.torch_attention, "cpu_op", lambda name: None)
    seed = case * 7919 + (dtype == torch.float16)
    check_against_reference(store_kv_torch, paged_attention_torch, seed, case, dtype, tol)


@pytest.mark.parametrize("group, head_dim", [(12, 64), (2, 96), (4, 32)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_other_head_shapes_match_reference(group, head_dim, dtype, tol):
    """Models beyond the drawn shapes (head_dim 64/128, groups of 1-8): wider GQA groups, head_dim 32 and 96,
    which the compiled decode kernel takes through its runtime-sized loops (prefill: the gather path)."""
    check_against_reference(
        store_kv_torch, paged_attention_torch, 900 + group, 0, dtype, tol, group=group, head_dim=head_dim
    )


@pytest.mark.parametrize("case", range(4))
def test_long_prompts_match_reference(case):
    """Prompts and extends of up to 1,200 tokens: many query tiles per sequence, shared between threads by
    their work (a causal tile late in a prompt has more keys)."""
    check_against_reference(
        store_kv_torch, paged_attention_torch, 500 + case, case, torch.float32, 1e-5, max_len=1200, max_batch=3
    )


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("route", ["kernel", "gather"])
def test_sliding_window_matches_reference(case, route, monkeypatch):
    """Windows shorter and longer than a block, and longer than some contexts, on mixed batches."""
    if route == "gather":
        monkeypatch.setattr(kvmesh.kernels.torch_attention, "cpu_op", lambda name: None)
    window = [1, 7, 16, 37, 100, 1000][case]
    check_against_reference(store_kv_torch, paged_attention_torch, 77 + case, case, torch.float32, 1e-5, window)


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "int8", "int4"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("route", ["kernel", "gather"])
def test_quantized_cache_matches_dequantized_reference(case, kv_dtype, dtype, tol, route, monkeypatch):
    if route == "gather":
        monkeypatch.setattr(kvmesh.kernels.torch_attention, "cpu_op", lambda name: None)
    seed = 31 * case + len(kv_dtype) + (dtype == torch.float16)
    check_quantized(store_kv_torch, paged_attention_torch, seed, case, kv_dtype, dtype, tol)


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("route", ["kernel", "gather"])
def test_int4_cache_with_windows_and_long_prompts(case, route, monkeypatch):
    """int4 over contexts up to 900 tokens (prefill chunks and decodes mixed), with sliding windows."""
    if route == "gather":
        monkeypatch.setattr(kvmesh.kernels.torch_attention, "cpu_op", lambda name: None)
    window = [None, 7, 37, 300][case]
    check_quantized(
        store_kv_torch, paged_attention_torch, 500 + case, case, "int4", torch.float32, 1e-5, window=window, max_len=900
    )


def test_store_kv_skips_negative_slots():
    kc = torch.zeros(2, 4, 1, 8)
    vc = torch.zeros(2, 4, 1, 8)
    k = torch.ones(3, 1, 8)
    store_kv_torch(k, 2 * k, kc, vc, torch.tensor([5, -1, 0]))
    assert kc.view(-1, 8).sum(-1).nonzero().flatten().tolist() == [0, 5]
    assert vc.view(-1, 8)[5].eq(2).all()


def test_backend_dispatch(monkeypatch):
    from kvmesh.kernels import attention_backend, model_kernels
    from kvmesh.kernels.torch_attention import paged_attention_torch

    monkeypatch.delenv("KVMESH_ATTENTION_BACKEND", raising=False)
    assert attention_backend(torch.device("cpu")) == "torch"
    assert model_kernels(torch.device("cpu")).paged_attention is paged_attention_torch
    assert attention_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "triton")
    assert attention_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError):
        attention_backend(torch.device("cpu"))


def test_block_size_the_device_kernels_cannot_run_is_refused_at_start(monkeypatch):
    """The Triton kernels (CUDA) need 8-slot blocks: an engine configured smaller must fail at start-up
    with the reason, not at its first step with every request."""
    from kvmesh.kernels import check_block_size

    check_block_size(4, torch.device("cpu"))  # the torch path takes any power of two
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "triton")
    check_block_size(8, torch.device("cpu"))
    with pytest.raises(ValueError, match="block_size 4 is too small for the Triton attention kernels"):
        check_block_size(4, torch.device("cpu"))
