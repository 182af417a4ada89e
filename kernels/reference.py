"""Plain, obviously-correct references for the attention kernels, for tests only.

Computed per sequence with an explicit softmax in whatever dtype the inputs have (use float64), and with
the context read token by token through the block table, so no paging shortcut is shared with the
implementations under test.
"""

from __future__ import annotations

import torch

from kvmesh.kernels.metadata import AttentionMetadata


def store_kv_reference(key, value, k_cache, v_cache, slot_mapping) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[t]
            v_cache[slot // block_size, slot % block_size] = value[t]


def paged_attention_reference(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None
) -> torch.Tensor:
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = torch.zeros_like(q)
    starts = meta.query_start_loc.tolist()
    for i, (n, length) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        table = meta.block_tables[i].tolist()
        pos = torch.arange(length)
        blocks = torch.tensor([table[p // block_size] for p in range(length)], dtype=torch.long)
        k = k_cache[blocks, pos % block_size].repeat_interleave(group, dim=1)  # [length, heads, d]
        v = v_cache[blocks, pos % block_size].repeat_interleave(group, dim=1)
        for j in range(n):
            end = length - n + j + 1  # keys [first, end): causal, and the last `window` of them
            first = max(0, end - window) if window else 0
            scores = torch.einsum("hd,lhd->hl", q[starts[i] + j], k[first:end]) * scale
            out[starts[i] + j] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[first:end])
    return out
