"""The forward pass's batch context: set once per step by the model runner, read by every attention layer.

Carrying it here instead of through every ``forward`` signature keeps the model code identical to a plain
transformer (the nano-vllm pattern).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvmesh.kernels import AttentionMetadata, Kernels
from kvmesh.kernels.int4_store import TailPlan
from kvmesh.replica.lora import LoRAStep


@dataclass
class LayerCache:
    """One layer's paged KV cache: K and V, each [num_blocks, block_size, kv_heads, head_dim], and, for a
    quantized cache, their scales (``kernels/quant.py``: per KV head for fp8, per slot and KV head for
    int8 and int4's values, per block, KV head and channel for int4's keys). An int4 cache packs two values
    per byte (its last dim is ``head_dim / 2``), holds V rotated by ``rotation`` ([head_dim, head_dim],
    orthogonal; attention undoes it on its output), and keeps the exact keys of blocks being filled in
    ``k_tail`` ([tail slots, block_size, kv_heads, head_dim], ``kernels/int4_store.py``)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    rotation: torch.Tensor | None = None
    k_tail: torch.Tensor | None = None

    def per_block(self) -> list[torch.Tensor]:
        """The tensors indexed by block id (K, V, int8/int4's per-slot scales, int4's key ranges): what a block
        copy moves."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None and t.dim() > 1]


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_caches: list[LayerCache]
    """One per layer."""
    kernels: Kernels
    """The kernels of the runner's device, picked once when the runner was built."""
    tails: TailPlan | None = None
    """int4: where the step's keys go and which tails hold their blocks' earlier keys (every layer alike)."""
    lora: LoRAStep | None = None
    """The step's LoRA adapters and the tokens each covers (``replica/lora.py``); None: base model only."""


_current: ForwardContext | None = None


def get_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention called outside a model-runner step")
    return _current


@contextmanager
def forward_context(ctx: ForwardContext):
    global _current
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None
