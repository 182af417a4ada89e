"""The forward pass's batch context: set once per step by the model runner, read by every attention layer.

Carrying it here instead of through every ``forward`` signature keeps the model code identical to a plain
transformer (the nano-vllm pattern).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kernels import AttentionMetadata


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer (K, V), each [num_blocks, block_size, kv_heads, head_dim]."""


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
