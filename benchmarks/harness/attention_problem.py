"""A paged decode / extend attention problem on shuffled blocks (metadata, queries, K and V caches), for the
attention timings of ``kvmesh bench attention_kernels`` and ``gpu_suite``."""

from __future__ import annotations

import random

import torch

from kvmesh.kernels import AttentionMetadata


def problem(batch, ctx, new, heads, kv_heads, head_dim, block_size, dtype, device):
    """A batch of ``batch`` sequences of ``ctx`` tokens (or of ``ctx[i]`` tokens each, a list), ``new`` of them
    queries, on shuffled blocks."""
    lens = [ctx] * batch if isinstance(ctx, int) else list(ctx)
    need = [-(-n // block_size) for n in lens]
    ids = list(range(sum(need)))
    random.Random(0).shuffle(ids)
    starts = [sum(need[:i]) for i in range(batch)]
    tables = [ids[at : at + n] for at, n in zip(starts, need, strict=True)]
    meta = AttentionMetadata.build([new] * batch, lens, tables, block_size, device)
    shape = (len(ids), block_size, kv_heads, head_dim)
    kc = torch.randn(shape, dtype=dtype, device=device)
    vc = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(batch * new, heads, head_dim, dtype=dtype, device=device)
    return meta, q, kc, vc
