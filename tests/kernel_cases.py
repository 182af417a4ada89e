"""Random paged-attention problems shared by the kernel tests."""

from __future__ import annotations

import random

import torch

from kernels import AttentionMetadata


def random_batch(
    rng: random.Random,
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    max_len: int = 300,
    max_batch: int = 8,
):
    """A mixed decode/extend batch whose block tables are shuffled, non-contiguous blocks of one pool.

    Returns float64 tensors: metadata, q, new k/v for the new tokens, and the caches (random contents,
    so stale data in unused slots is finite but wrong if read).
    """
    batch = rng.randint(1, max_batch)
    seq_lens = [rng.randint(1, max_len) for _ in range(batch)]
    query_lens = [1 if rng.random() < 0.5 else rng.randint(1, s) for s in seq_lens]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 5
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    g = torch.Generator().manual_seed(rng.randint(0, 2**31))
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, dtype=torch.float64)
    v_cache = torch.randn(shape, generator=g, dtype=torch.float64)
    tokens = sum(query_lens)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g, dtype=torch.float64)
    return meta, q, k, v, k_cache, v_cache


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected).norm() / expected.norm())
