"""The CPU torch path of the attention kernels against the float64 reference, on random paged batches."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.reference import paged_attention_reference, store_kv_reference
from kernels.torch_attention import paged_attention_torch, store_kv_torch
from tests.kernel_cases import random_batch, relative_error


@pytest.mark.parametrize("case", range(12))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_torch_path_matches_reference(case, dtype, tol):
    rng = random.Random(case * 7919 + (dtype == torch.float16))
    block_size = rng.choice([16, 32])
    group = [1, 3, 4, 8][case % 4]
    kv_heads = rng.choice([1, 2])
    head_dim = rng.choice([64, 128])
    meta, q, k, v, kc, vc = random_batch(rng, block_size, kv_heads, group, head_dim)
    scale = head_dim**-0.5

    ref_kc, ref_vc = kc.clone(), vc.clone()
    store_kv_reference(k, v, ref_kc, ref_vc, meta.slot_mapping)
    expected = paged_attention_reference(q, ref_kc, ref_vc, meta, scale)

    kc_t, vc_t = kc.to(dtype), vc.to(dtype)
    store_kv_torch(k.to(dtype), v.to(dtype), kc_t, vc_t, meta.slot_mapping)
    assert torch.equal(kc_t, ref_kc.to(dtype)) and torch.equal(vc_t, ref_vc.to(dtype))
    out = paged_attention_torch(q.to(dtype), kc_t, vc_t, meta, scale, out=torch.full_like(q, float("nan"), dtype=dtype))
    err = relative_error(out, expected)
    assert err <= tol, f"relative error {err:.2e}"


def test_store_kv_skips_negative_slots():
    kc = torch.zeros(2, 4, 1, 8)
    vc = torch.zeros(2, 4, 1, 8)
    k = torch.ones(3, 1, 8)
    store_kv_torch(k, 2 * k, kc, vc, torch.tensor([5, -1, 0]))
    assert kc.view(-1, 8).sum(-1).nonzero().flatten().tolist() == [0, 5]
    assert vc.view(-1, 8)[5].eq(2).all()


def test_backend_dispatch(monkeypatch):
    from kernels import attention_backend

    monkeypatch.delenv("KVMESH_ATTENTION_BACKEND", raising=False)
    assert attention_backend(torch.device("cpu")) == "torch"
    assert attention_backend(torch.device("cuda")) == "triton"
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "triton")
    assert attention_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError):
        attention_backend(torch.device("cpu"))
