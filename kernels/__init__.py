"""The model's kernels, with device dispatch: attention over the paged KV cache and the elementwise layers.

``model_kernels(device)`` picks them once, for a model runner's device. Attention: the Triton kernels on
CUDA (``triton_attention.py``), the vectorized torch path elsewhere (``torch_attention.py``);
``KVMESH_ATTENTION_BACKEND=torch|triton`` overrides the choice (read when the kernels are picked), which
tests use to run the Triton kernels on the CPU under ``TRITON_INTERPRET=1``. Elementwise layers: compiled
on the CPU, torch elsewhere (``kernels/layers.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.kernels.layers import CPU_LAYERS, TORCH_LAYERS, cpu_layers_available
from kvmesh.kernels.metadata import AttentionMetadata
from kvmesh.kernels.torch_attention import paged_attention_torch, store_kv_torch

__all__ = ["AttentionMetadata", "Kernels", "attention_backend", "check_block_size", "model_kernels"]

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
    from kvmesh.kernels.triton_attention import MIN_BLOCK_SIZE

    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(
            f"block_size {block_size} is too small for the Triton attention kernels on {device}: "
            f"use {MIN_BLOCK_SIZE} or more (16 is the default)"
        )


@dataclass(frozen=True)
class Kernels:
    """Every kernel the model's forward pass calls, picked once for a model runner's device.

    ``store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None)`` writes new K/V
    ([tokens, kv_heads, head_dim]) into the paged caches at ``slot_mapping`` (-1 skips); ``k_scale`` and
    ``v_scale`` are a quantized cache's scales (``kernels/quant.py``), None for a plain cache.

    ``paged_attention(q, k_cache, v_cache, meta, scale, *, k_scale=None, v_scale=None, window=None, out=None)``
    is causal attention of the batch's new queries over their cached prefixes and themselves; ``window``:
    sliding-window attention (each query sees its last ``window`` positions), None for full.

    ``rms_norm``, ``add_rms_norm``, ``silu_and_mul`` and ``rotary``: the elementwise layers
    (``kernels/layers.py``, which says what each may overwrite).
    """

    backend: str
    """The attention backend: ``torch`` or ``triton``."""
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]


def model_kernels(device: torch.device) -> Kernels:
    """The kernels a model on ``device`` runs with (see the module docstring)."""
    return _kernels(attention_backend(device), cpu_layers_available(device))


@functools.cache
def _kernels(backend: str, cpu_layers: bool) -> Kernels:
    layers = CPU_LAYERS if cpu_layers else TORCH_LAYERS
    if backend == "triton":
        try:
            from kvmesh.kernels.triton_attention import paged_attention_triton, store_kv_triton
        except ImportError as exc:  # a CUDA torch without triton: still serve, slower
            log.warning("triton unavailable (%s); using the torch attention path", exc)
        else:
            return Kernels("triton", store_kv_triton, paged_attention_triton, *layers)
    return Kernels("torch", store_kv_torch, paged_attention_torch, *layers)
