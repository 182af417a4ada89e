"""Attention kernels over the paged KV cache, with device dispatch.

``store_kv`` and ``paged_attention`` pick their backend per call from the tensor's device: the Triton
kernels on CUDA (``kernels/triton_attention.py``), the vectorized torch path elsewhere
(``kernels/torch_attention.py``). ``KVMESH_ATTENTION_BACKEND=torch|triton`` overrides the choice; tests use
it to run the Triton kernels on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from kernels.metadata import AttentionMetadata
from kernels.torch_attention import paged_attention_torch, store_kv_torch

__all__ = ["AttentionMetadata", "attention_backend", "check_block_size", "paged_attention", "store_kv"]

BACKENDS = ("torch", "triton")
log = logging.getLogger(__name__)


def attention_backend(device: torch.device) -> str:
    forced = os.environ.get("KVMESH_ATTENTION_BACKEND", "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"KVMESH_ATTENTION_BACKEND must be one of {BACKENDS}, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" else "torch"


def check_block_size(block_size: int, device: torch.device) -> None:
    """Refuse at start-up a block size the device's kernels cannot run: the Triton kernels (CUDA) need
    ``MIN_BLOCK_SIZE`` slots or more; found at the first step instead, every request would fail."""
    if attention_backend(device) != "triton":
        return
    from kernels.triton_attention import MIN_BLOCK_SIZE

    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(
            f"block_size {block_size} is too small for the Triton attention kernels on {device}: "
            f"use {MIN_BLOCK_SIZE} or more (16 is the default)"
        )


@functools.cache
def _impls(backend: str) -> tuple[Callable, Callable]:
    if backend == "triton":
        try:
            from kernels.triton_attention import paged_attention_triton, store_kv_triton
        except ImportError as exc:  # a CUDA torch without triton: still serve, slower
            log.warning("triton unavailable (%s); using the torch attention path", exc)
        else:
            return store_kv_triton, paged_attention_triton
    return store_kv_torch, paged_attention_torch


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Write new K/V ([tokens, kv_heads, head_dim]) into the paged caches at ``slot_mapping`` (-1 skips).

    ``k_scale``/``v_scale``: a quantized cache's scales (``kernels/quant.py``), None for a plain cache.
    """
    _impls(attention_backend(key.device))[0](key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale=None, v_scale=None, window=None
) -> torch.Tensor:
    """Causal attention of the batch's new queries over their cached prefixes and themselves.

    ``window``: sliding-window attention (each query sees its last ``window`` positions), None for full.
    """
    impl = _impls(attention_backend(q.device))[1]
    return impl(q, k_cache, v_cache, meta, scale, k_scale=k_scale, v_scale=v_scale, window=window)
