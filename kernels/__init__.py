"""Attention kernels over the paged KV cache, with device dispatch.

``store_kv`` and ``paged_attention`` pick their backend once per device: the Triton kernels on CUDA, the
vectorized torch path elsewhere. ``KVMESH_ATTENTION_BACKEND=torch|triton`` overrides the choice (tests run
the Triton kernels on CPU through ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from kernels.metadata import AttentionMetadata
from kernels.torch_attention import paged_attention_torch, store_kv_torch

__all__ = ["AttentionMetadata", "attention_backend", "paged_attention", "store_kv"]

BACKENDS = ("torch", "triton")


def attention_backend(device: torch.device) -> str:
    forced = os.environ.get("KVMESH_ATTENTION_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"KVMESH_ATTENTION_BACKEND must be one of {BACKENDS}, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" else "torch"


def _impls(device: torch.device) -> tuple[Callable, Callable]:
    if attention_backend(device) == "triton":
        from kernels.triton_attention import paged_attention_triton, store_kv_triton

        return store_kv_triton, paged_attention_triton
    return store_kv_torch, paged_attention_torch


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    _impls(key.device)[0](key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return _impls(q.device)[1](q, k_cache, v_cache, meta, scale)
