"""The vectorized torch path of paged attention, used on CPU (and as a fallback anywhere).

On the CPU, decode sequences (one query each) and prefill / extend sequences go to the compiled kernels of
``cpu_extension.py``, which read the paged cache in place. Elsewhere, or where they cannot be built, decode
sequences are sorted by context length and split into a few length buckets; each bucket's blocks are
gathered into one padded ``[batch, kv_heads, context, head_dim]`` view and a single fused SDPA call with a
length mask does the rest. Bucketing keeps padding (wasted gather and attention work) low when short and
long conversations decode together. Prefill/extend sequences carry many queries and a causal mask offset by
their cached prefix; they are few per step (the token budget bounds them), so each gets one SDPA call over
its gathered context. There are no per-token Python loops.

Gathers write into a per-thread workspace that only grows: allocating a fresh tensor per layer per step
costs more in page faults than the copy itself.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F

from kvmesh.kernels.cpu_extension import DTYPES, cpu_op
from kvmesh.kernels.int4_store import TailPlan, plan_writes, store_int4_keys
from kvmesh.kernels.metadata import AttentionMetadata
from kvmesh.kernels.quant import INT4_DTYPE, as_bytes, dequantize, dequantize_int4_keys, quantize

_workspace = threading.local()
PREFILL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    plan: TailPlan | None = None,
    tail: torch.Tensor | None = None,
) -> None:
    """Write ``key``/``value`` ([tokens, kv_heads, head_dim]) into the paged caches; slot -1 is skipped.

    Quantized caches (``kernels/quant.py``) store scaled values; int8 and int4 also write each token's
    scales. An int4 cache's keys are written whole blocks at a time (``kernels/int4_store.py``), as
    ``plan`` says, from the exact keys kept in ``tail`` (without a plan: from the stored ones).
    """
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    kvh, d = k_cache.shape[-2:]
    pairs = ((key, k_cache, k_scale), (value, v_cache, v_scale))
    if k_cache.dtype == INT4_DTYPE:
        plan = plan_writes(slot_mapping, k_cache.shape[1]) if plan is None else plan
        store_int4_keys(key, k_cache, k_scale, plan, tail)
        pairs = pairs[1:]
    for x, cache, scale in pairs:
        stored, token_scales = quantize(x, cache.dtype, scale)
        as_bytes(cache).view(-1, kvh, d).index_copy_(0, slot_mapping, as_bytes(stored))
        if token_scales is not None:
            scale.view(-1, kvh).index_copy_(0, slot_mapping, token_scales)


def _scratch(name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    bufs = getattr(_workspace, "bufs", None)
    if bufs is None:
        bufs = _workspace.bufs = {}
    key = (name, like.dtype, like.device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        grown = max(numel, int(1.25 * buf.numel()) if buf is not None else 0)
        with torch.inference_mode(False):  # a normal tensor works inside and outside inference mode
            buf = bufs[key] = torch.empty(grown, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _gather(
    name: str,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    length: int,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[batch, kv_heads, length, head_dim] view of each row's first ``length`` cached tokens, in ``dtype``."""
    block_size, kvh, d = cache.shape[1:]
    nb = -(-length // block_size)
    batch = block_tables.shape[0]
    ids = block_tables[:, :nb].reshape(-1).long()
    out = _scratch(name, ids.numel() * block_size * kvh * d, cache).view(-1, block_size, kvh, d)
    torch.index_select(as_bytes(cache), 0, ids, out=as_bytes(out))
    if scale is not None and scale.dim() == 4:  # int4 keys: ranges per block and channel
        out = dequantize_int4_keys(out, scale.index_select(0, ids)).to(dtype)
        return out.view(batch, nb * block_size, kvh, -1)[:, :length].transpose(1, 2)
    out = out.view(batch, nb * block_size, kvh, d)[:, :length]
    if cache.dtype != dtype:  # a quantized cache: dequantize what was gathered
        if scale is not None and scale.dim() == 3:  # per-token scales travel with their slots
            scale = scale.index_select(0, ids).view(batch, nb * block_size, kvh)[:, :length]
        out = dequantize(out, scale, dtype)
    return out.transpose(1, 2)


def _length_buckets(rows: list[int], lens: list[int]) -> list[list[int]]:
    """Split decode rows, longest first, whenever a row is under half its bucket's longest context."""
    order = sorted(rows, key=lambda i: -lens[i])
    buckets = [[order[0]]]
    for i in order[1:]:
        if 2 * lens[i] <= lens[buckets[-1][0]] and len(buckets[-1]) >= 4:
            buckets.append([i])
        else:
            buckets[-1].append(i)
    return buckets


def _prefill_kernel_takes(q: torch.Tensor) -> bool:
    """Whether the compiled prefill kernel serves ``q``: on the CPU, a float type it computes in, a head_dim
    it is built for."""
    return q.device.type == "cpu" and q.dtype in PREFILL_DTYPES and q.shape[-1] in (64, 128)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ([tokens, heads, head_dim]) over each sequence's paged context, into ``out``.

    ``k_scale``/``v_scale`` are a quantized cache's scales (``kernels/quant.py``); they are dequantized on load.
    ``window``: sliding-window attention, each query sees its last ``window`` positions (itself included).
    """
    out = torch.empty_like(q) if out is None else out
    qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
    decode = np.flatnonzero(qlens == 1)
    kernel = cpu_op("paged_decode") if len(decode) and q.device.type == "cpu" and q.dtype in DTYPES else None
    extend = np.flatnonzero(qlens > 1)
    prefill = cpu_op("paged_prefill") if len(extend) and _prefill_kernel_takes(q) else None
    # The compiled kernels read the paged cache in place; token rows may be strided (views of a fused QKV).
    args = (k_cache, v_cache, k_scale, v_scale, meta.block_tables, meta.seq_lens, meta.query_start_loc)
    q_rows = q if (q.stride(2) == 1 and q.stride(1) == q.size(2)) or not (kernel or prefill) else q.contiguous()
    if kernel is not None:
        kernel(out, q_rows, *args, torch.from_numpy(decode), scale, window or 0)
        decode = decode[:0]
    if prefill is not None:
        prefill(out, q_rows, *args, torch.from_numpy(extend), scale, window or 0)
        extend = extend[:0]
    decode, slens = decode.tolist(), slens.tolist()
    for bucket in _length_buckets(decode, slens) if decode else []:
        rows = torch.tensor(bucket, device=q.device)
        tok = meta.query_start_loc[rows].long()
        length = slens[bucket[0]]
        k = _gather("k", k_cache, meta.block_tables[rows], length, k_scale, q.dtype)
        v = _gather("v", v_cache, meta.block_tables[rows], length, v_scale, q.dtype)
        keys, lens = torch.arange(length, device=q.device)[None, :], meta.seq_lens[rows][:, None]
        mask = (keys < lens) & (keys >= lens - window) if window else keys < lens
        o = F.scaled_dot_product_attention(
            q[tok].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[tok] = o.squeeze(2)
    starts = np.cumsum(qlens) - qlens
    for i in extend.tolist():  # prefill / extend: few per step (the token budget)
        s, n, length = int(starts[i]), int(qlens[i]), slens[i]
        k = _gather("k", k_cache, meta.block_tables[i : i + 1], length, k_scale, q.dtype)
        v = _gather("v", v_cache, meta.block_tables[i : i + 1], length, v_scale, q.dtype)
        qq = q[s : s + n].transpose(0, 1).unsqueeze(0)
        if n == length and not window:
            o = F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            pos = torch.arange(length - n, length, device=q.device)[:, None]
            keys = torch.arange(length, device=q.device)[None, :]
            mask = (keys <= pos) & (keys > pos - window) if window else keys <= pos
            o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s : s + n] = o[0].transpose(0, 1)
    return out
