"""Triton kernels for the paged KV cache: ``store_kv`` and paged attention over a mixed batch.

Two attention kernels, not one unified kernel, because decode and extend are bound by different things:

- **decode** (one query token per sequence) is memory-bound: every KV byte is read once per step. The
  kernel runs one program per (sequence, KV head) and packs that KV head's whole GQA group of query heads
  into the rows of one tile, so each KV tile is loaded once and used by all query heads that share it.
  When the batch has fewer (sequence, KV head) pairs than the GPU has multiprocessors, each context is
  also split into parts (flash-decoding), whose partial softmaxes a second kernel combines.
- **extend/prefill** (many new tokens attending causally to themselves and to the cached prefix) is
  compute-bound: one program per (sequence, tile of query tokens, KV head), flash-attention style with
  online softmax, stopping at the last key its tile can see; the tile's rows are its tokens x the GQA
  group's query heads, so each KV tile is loaded once per group, not once per query head.

Both kernels walk the context in tiles of BLOCK_N tokens and translate each token's position to its
physical slot through the block table (``table[pos // block_size] * block_size + pos % block_size``), so
the tile size is independent of the cache's block size (any power of two >= 8 works). Both launch over
the whole batch and exit early for sequences that belong to the other kernel, so no host-side split of
the batch is needed. Softmax and accumulation are fp32; fp32 inputs use IEEE-precision dots (no TF32).

Quantized caches (``kernels/quant.py``; ``QUANT`` 1 = fp8 with per-head scales, 2 = int8 with per-slot
scales, 3 = int4 packed two per byte: keys with per-block channel ranges, values with per-slot scales) are
quantized by the store kernel (int4: by ``store_kv_torch``, whole key blocks at a time) and dequantized tile
by tile as the attention kernels load them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvmesh.kernels.metadata import AttentionMetadata, decode_splits
from kvmesh.kernels.quant import FP8_DTYPES, INT4_DTYPE, INT8_MAX
from kvmesh.kernels.torch_attention import store_kv_torch

FULL = 1 << 30
"""The ``window`` of full attention: further back than any context."""
EXTEND_ROWS = 64
"""Rows of an extend tile: query tokens x the GQA group's heads (BLOCK_M = EXTEND_ROWS / group)."""
MIN_BLOCK_SIZE = 8
"""The smallest cache block the kernels take: a store or tile spans at least this many slots."""
PER_STEP_INTS = ["stride_bt"]
"""Integer arguments that change from step to step (the block table's width is the step's longest context in
blocks). Triton compiles a kernel per specialization of its integer arguments (divisible by 16 or not), so
the first step whose width was a multiple of 16 would wait for a compile; these are not specialized."""


def _quant_mode(cache: torch.Tensor) -> int:
    if cache.dtype == INT4_DTYPE:
        return 3
    return 1 if cache.dtype in FP8_DTYPES else 2 if cache.dtype == torch.int8 else 0


@triton.jit
def _quantize(
    x, scale_ptr, head, slot_head, QUANT: tl.constexpr, LIMIT: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr
):
    """``x`` ([1, BLOCK_D], one token's head vector) as the cache stores it; int8 also writes its scale.

    fp8 divides by the head's static scale, saturates, and rounds to the format's grid (``MANT`` mantissa
    bits, smallest normal exponent ``EMIN``) itself, so the final cast is exact: Triton's interpreter
    mis-rounds fp32 -> fp8 casts that carry into the exponent (-31.6 became -16), and a few ALU ops are
    free in this memory-bound kernel. int8 takes ``absmax / 127`` (as float16, the smallest normal at
    least) and rounds to nearest. Ties round away from zero here, to even in torch: both within rounding.
    """
    if QUANT == 1:
        x = tl.clamp(x.to(tl.float32) / tl.load(scale_ptr + head), -LIMIT, LIMIT)
        step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.abs(x) + 1e-30)), EMIN) - MANT)
        x = tl.floor(x / step + 0.5) * step
    elif QUANT == 2:
        s = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), 1) / LIMIT, 6.103515625e-05).to(tl.float16)
        tl.store(scale_ptr + slot_head + tl.arange(0, 1), s)
        x = tl.clamp(tl.floor(x.to(tl.float32) / s.to(tl.float32)[:, None] + 0.5), -LIMIT, LIMIT)
    return x


@triton.jit
def _store_kv_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slots,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    LIMIT: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
):
    """One program per (token, KV head): a head's vector is the unit an int8 scale covers (int4 caches are
    written by ``store_kv_torch``: their keys are quantized whole blocks at a time)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        slot_head = slot * tl.num_programs(1) + h  # int8 scales: [blocks, block_size, kv_heads]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = d < HEAD_DIM
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
        k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
        v = tl.load(value + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        k = _quantize(k, k_scale, h, slot_head, QUANT, LIMIT, MANT, EMIN)
        v = _quantize(v, v_scale, h, slot_head, QUANT, LIMIT, MANT, EMIN)
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _attend(
    qt,
    q_pos,
    k_cache,
    v_cache,
    k_scale,
    v_scale,
    table,
    seq_len,
    start,
    end,
    window,
    kv_head,
    num_kv_heads,
    scale,
    stride_cb,
    stride_cs,
    stride_ch,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Softmax attention of ``ROWS`` query rows (at positions ``q_pos``) over the tiles from ``start``'s to
    ``end`` of one sequence and one KV head, read through its block table ``table``; online softmax in fp32.
    Keys more than ``window - 1`` positions behind a query are masked (sliding window; huge for full).
    Returns the unnormalised output, the running maximum and the sum of exponentials per row (a split
    of the keys combines with the others through them)."""
    kv_off = kv_head * stride_ch
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for tile_start in range((start // BLOCK_N) * BLOCK_N, end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        nmask = n < seq_len
        blk = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        off = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_off
        kvmask = nmask[:, None] & dmask[None, :]
        if QUANT == 3:  # packed int4: value d is byte d // 2's low or high nibble
            byte = off[:, None] + d[None, :] // 2
            shift = (d[None, :] % 2) * 4
            k = ((tl.load(k_cache + byte, mask=kvmask, other=0).to(tl.int32) >> shift) & 15).to(tl.float32)
            v = (((tl.load(v_cache + byte, mask=kvmask, other=0).to(tl.int32) >> shift) & 15) - 8).to(tl.float32)
            # keys: lo + (hi - lo) / 15 * nibble, their block's range per channel ([blocks, kv_heads, 2, head_dim])
            rng = ((blk * num_kv_heads + kv_head) * 2 * HEAD_DIM)[:, None] + d[None, :]
            lo = tl.load(k_scale + rng, mask=kvmask, other=0.0).to(tl.float32)
            hi = tl.load(k_scale + rng + HEAD_DIM, mask=kvmask, other=0.0).to(tl.float32)
            k = (lo + (hi - lo) / 15.0 * k).to(qt.dtype)
            sidx = (blk * BLOCK_SIZE + n % BLOCK_SIZE) * num_kv_heads + kv_head
            v = (v * tl.load(v_scale + sidx, mask=nmask, other=0.0).to(tl.float32)[:, None]).to(qt.dtype)
        else:
            k = tl.load(k_cache + off[:, None] + d[None, :], mask=kvmask, other=0.0)
            v = tl.load(v_cache + off[:, None] + d[None, :], mask=kvmask, other=0.0)
        if QUANT == 1:
            k = (k.to(tl.float32) * tl.load(k_scale + kv_head)).to(qt.dtype)
            v = (v.to(tl.float32) * tl.load(v_scale + kv_head)).to(qt.dtype)
        elif QUANT == 2:
            sidx = (blk * BLOCK_SIZE + n % BLOCK_SIZE) * num_kv_heads + kv_head
            ks = tl.load(k_scale + sidx, mask=nmask, other=0.0).to(tl.float32)
            vs = tl.load(v_scale + sidx, mask=nmask, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * ks[:, None]).to(qt.dtype)
            v = (v.to(tl.float32) * vs[:, None]).to(qt.dtype)
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * scale
        visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window) & nmask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see nothing in a tile yet (a sliding window starts mid-tile): keep its exponents at
        # exp(-inf) = 0 instead of exp(-inf - -inf) = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=PER_STEP_INTS)
def _decode_kernel(
    q,
    k_cache,
    v_cache,
    out,
    block_tables,
    seq_lens,
    query_start_loc,
    k_scale,
    v_scale,
    num_kv_heads,
    window,
    scale,
    part_acc,
    part_ml,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One program per (sequence, KV head, split of its context). With one split it writes the output;
    with more (flash-decoding: a short batch over long contexts would leave most of the GPU idle) each
    writes its partial output, maximum and sum to ``part_acc`` / ``part_ml`` for ``_combine_kernel``."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    tok = tl.load(query_start_loc + seq)
    if tl.load(query_start_loc + seq + 1) - tok == 1:
        seq_len = tl.load(seq_lens + seq)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, BLOCK_D)
        qmask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
        heads = kvh * GROUP + g
        qt = tl.load(q + tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
        q_pos = tl.full([GROUP_P], 0, tl.int32) + seq_len - 1  # the one new token is the last position
        first = (tl.maximum(seq_len - window, 0) // BLOCK_N) * BLOCK_N
        # Each split takes a whole number of tiles, so splits never share a key.
        per_split = tl.cdiv(tl.cdiv(seq_len - first, SPLITS), BLOCK_N) * BLOCK_N
        start = first + split * per_split
        end = tl.minimum(seq_len, start + per_split)
        acc, m_i, l_i = _attend(
            qt,
            q_pos,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            block_tables + seq * stride_bt,
            seq_len,
            start,
            end,
            window,
            kvh,
            num_kv_heads,
            scale,
            stride_cb,
            stride_cs,
            stride_ch,
            GROUP_P,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            BLOCK_N,
            PRECISION,
            QUANT,
        )
        if SPLITS == 1:
            dst = out + tok * stride_ot + heads[:, None] * stride_oh + d[None, :]
            tl.store(dst, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=qmask)
        else:
            row = (seq * tl.num_programs(1) * GROUP + heads) * SPLITS + split  # [batch, heads, splits]
            tl.store(part_acc + row[:, None] * BLOCK_D + d[None, :], acc, mask=qmask)
            tl.store(part_ml + row * 2, m_i, mask=g < GROUP)
            tl.store(part_ml + row * 2 + 1, l_i, mask=g < GROUP)


@triton.jit
def _combine_kernel(
    out,
    query_start_loc,
    part_acc,
    part_ml,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    """One program per (decode sequence, query head): merge its splits' partial softmaxes."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(query_start_loc + seq)
    if tl.load(query_start_loc + seq + 1) - tok == 1:
        sp = tl.arange(0, SPLITS_P)
        d = tl.arange(0, BLOCK_D)
        row = (seq * tl.num_programs(1) + head) * SPLITS + sp
        smask = sp < SPLITS
        m = tl.load(part_ml + row * 2, mask=smask, other=float("-inf"))
        sums = tl.load(part_ml + row * 2 + 1, mask=smask, other=0.0)
        acc = tl.load(
            part_acc + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0
        )
        m_all = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # an empty split weighs nothing
        o = tl.sum(acc * w[:, None], 0) / tl.sum(sums * w, 0)
        tl.store(out + tok * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=PER_STEP_INTS)
def _extend_kernel(
    q,
    k_cache,
    v_cache,
    out,
    block_tables,
    seq_lens,
    query_start_loc,
    k_scale,
    v_scale,
    num_kv_heads,
    window,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One program per (sequence, tile of BLOCK_M query tokens, KV head): the rows of its tile are every
    (query token, query head of the GQA group) pair, so each KV tile is loaded once for the whole group."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if (q_len > 1) & (tile * BLOCK_M < q_len):
        seq_len = tl.load(seq_lens + seq)
        ctx = seq_len - q_len
        r = tl.arange(0, BLOCK_M * GROUP_P)
        m = tile * BLOCK_M + r // GROUP_P
        g = r % GROUP_P
        head = kvh * GROUP + g
        d = tl.arange(0, BLOCK_D)
        qmask = ((m < q_len) & (g < GROUP))[:, None] & (d[None, :] < HEAD_DIM)
        src = q + (q_start + m)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        qt = tl.load(src, mask=qmask, other=0.0)
        end = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)  # the tile's last query sees no further
        start = tl.maximum(ctx + tile * BLOCK_M - window + 1, 0)  # nor its first query further back
        acc, _, l_i = _attend(
            qt,
            ctx + m,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            block_tables + seq * stride_bt,
            seq_len,
            start,
            end,
            window,
            kvh,
            num_kv_heads,
            scale,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_M * GROUP_P,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SIZE,
            BLOCK_N,
            PRECISION,
            QUANT,
        )
        dst = out + (q_start + m)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, (acc / l_i[:, None]).to(out.dtype.element_ty), mask=qmask)


def _check_cache(cache: torch.Tensor) -> None:
    if cache.stride(-1) != 1:
        raise ValueError("KV cache must be contiguous in head_dim")
    bs = cache.shape[1]
    if bs < MIN_BLOCK_SIZE or bs & (bs - 1):
        raise ValueError(f"block size must be a power of two >= {MIN_BLOCK_SIZE}, got {bs}")


def _grid(cache: torch.Tensor) -> dict:
    """A quantized cache's largest magnitude, mantissa bits and smallest normal exponent (for ``_quantize``)."""
    if cache.dtype not in FP8_DTYPES:
        return {"LIMIT": INT8_MAX, "MANT": 0, "EMIN": 0}
    info = torch.finfo(cache.dtype)
    return {"LIMIT": info.max, "MANT": -round(math.log2(info.eps)), "EMIN": round(math.log2(info.smallest_normal))}


def store_kv_triton(
    key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, plan=None, tail=None
) -> None:
    _check_cache(k_cache)
    if k_cache.dtype == INT4_DTYPE:  # keys go whole blocks at a time, from the exact keys (int4_store.py)
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, plan, tail)
        return
    n, kvh, d = key.shape
    if n == 0:
        return
    _store_kv_kernel[(n, kvh)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache if k_scale is None else k_scale,
        v_cache if v_scale is None else v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=d,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_D=triton.next_power_of_2(d),
        QUANT=_quant_mode(k_cache),
        **_grid(k_cache),
    )


def _scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple:
    """The scale arguments of the attention kernels: the cache itself where there are none (never read),
    int4's e4m3 bytes as fp8 so that the kernels load them as numbers."""
    if cache.dtype == INT4_DTYPE:
        return k_scale.view(torch.float8_e4m3fn), v_scale.view(torch.float8_e4m3fn)
    return (cache if k_scale is None else k_scale), (cache if v_scale is None else v_scale)


def paged_attention_triton(
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
    _check_cache(k_cache)
    out = torch.empty_like(q) if out is None else out
    batch = len(meta.query_lens_cpu)
    if batch == 0:
        return out
    heads, d = q.shape[1], q.shape[2]
    kvh = k_cache.shape[2]
    if heads % kvh:
        raise ValueError(f"{heads} query heads do not divide into {kvh} KV heads")
    group = heads // kvh
    group_p = triton.next_power_of_2(group)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    block_d = triton.next_power_of_2(d)
    splits = meta.decode_splits or decode_splits(batch, kvh, meta.max_seq_len, q.device)
    part_acc = part_ml = out  # unused with one split
    if splits > 1:
        part_acc = torch.empty((batch, heads, splits, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch, heads, splits, 2), dtype=torch.float32, device=q.device)
    common = (
        q,
        k_cache,
        v_cache,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        *_scales(k_cache, k_scale, v_scale),
        kvh,
        window or FULL,
        scale,
    )
    strides = (
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
    )
    if 1 in meta.query_lens_cpu:
        _decode_kernel[(batch, kvh, splits)](
            *common,
            part_acc,
            part_ml,
            *strides,
            GROUP=group,
            GROUP_P=max(16, group_p),
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_N=32,
            PRECISION=precision,
            QUANT=_quant_mode(k_cache),
            SPLITS=splits,
        )
        if splits > 1:
            _combine_kernel[(batch, heads)](
                out,
                meta.query_start_loc,
                part_acc,
                part_ml,
                out.stride(0),
                out.stride(1),
                HEAD_DIM=d,
                BLOCK_D=block_d,
                SPLITS=splits,
                SPLITS_P=triton.next_power_of_2(splits),
            )
    if meta.max_query_len > 1:
        block_m = max(1, EXTEND_ROWS // group_p)
        _extend_kernel[(batch, triton.cdiv(meta.max_query_len, block_m), kvh)](
            *common,
            *strides,
            GROUP=group,
            GROUP_P=group_p,
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=block_m,
            BLOCK_N=32,
            PRECISION=precision,
            QUANT=_quant_mode(k_cache),
        )
    return out
