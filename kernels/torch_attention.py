"""The vectorized torch path of paged attention, used on CPU (and as a fallback anywhere).

Decode sequences (one query each) are handled together: their blocks are gathered into one padded
``[batch, kv_heads, context, head_dim]`` tensor and a single fused SDPA call with a length mask does the
rest. Prefill/extend sequences carry many queries and a causal mask offset by their cached prefix; they
are few per step (the token budget bounds them), so each gets one SDPA call over its gathered context.
There are no per-token Python loops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def store_kv_torch(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ([tokens, kv_heads, head_dim]) into the paged caches; slot -1 is skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[batch, kv_heads, length, head_dim] view of each row's first ``length`` cached tokens."""
    block_size, kvh, d = cache.shape[1:]
    nb = -(-length // block_size)
    x = cache[block_tables[:, :nb].long()].view(block_tables.shape[0], nb * block_size, kvh, d)
    return x[:, :length].transpose(1, 2)


def paged_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of ``q`` ([tokens, heads, head_dim]) over each sequence's paged context."""
    out = torch.empty_like(q)
    qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = meta.query_start_loc.tolist()
    decode = [i for i, n in enumerate(qlens) if n == 1]
    if decode:
        rows = torch.tensor(decode, device=q.device)
        tok = meta.query_start_loc[rows].long()
        length = max(slens[i] for i in decode)
        k = _gather(k_cache, meta.block_tables[rows], length)
        v = _gather(v_cache, meta.block_tables[rows], length)
        mask = torch.arange(length, device=q.device)[None, :] < meta.seq_lens[rows][:, None]
        o = F.scaled_dot_product_attention(
            q[tok].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[tok] = o.squeeze(2)
    for i, n in enumerate(qlens):
        if n <= 1:
            continue
        s, length = starts[i], slens[i]
        k = _gather(k_cache, meta.block_tables[i : i + 1], length)
        v = _gather(v_cache, meta.block_tables[i : i + 1], length)
        qq = q[s : s + n].transpose(0, 1).unsqueeze(0)
        if n == length:
            o = F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            pos = torch.arange(length - n, length, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s : s + n] = o[0].transpose(0, 1)
    return out
