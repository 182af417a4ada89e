"""Quantized KV cache storage: which dtypes, how values are scaled into them, and back.

A quantized cache stores K and V in one byte per element and carries scales beside them, so that
``value = stored * scale``:

- **fp8** (``fp8_e4m3``, ``fp8_e5m2``): a static float32 scale per KV head and layer, ``[kv_heads]``. The
  model runner calibrates it once at start-up from the K/V of a fixed calibration pass, with headroom;
  stores saturate at the format's largest finite value (a plain cast to e4m3 would turn overflow into NaN).
  Static scales add nothing per token, so fp8 halves a 16-bit cache exactly.
- **int8**: a float16 scale per token and KV head, ``[num_blocks, block_size, kv_heads]`` beside the
  cache, set on every write to ``absmax / 127`` of that token's head vector (symmetric, round to nearest).
  Per-token scales follow outliers without calibration, at 2 bytes per token-head.
- **int4**: two values per byte (``uint8`` storage, ``[..., head_dim / 2]``: element ``2i`` in the low
  nibble, ``2i + 1`` in the high one). Keys and values are scaled on different axes, because that is where
  their outliers lie (KIVI; ``benchmarks/kv_int4_variants.py`` measures the alternatives):

  - **keys per channel over each cache block**: a block's keys share, per KV head and channel, the range
    ``[lo, hi]`` of that channel over the block's tokens, kept as two fp8 e4m3 bytes (each end rounded down
    or up, whichever pair rounds the block's keys best: ``INT4_KEY_RANGE_ENDS``; ``k_scale`` is
    ``[num_blocks, kv_heads, 2, head_dim]`` uint8), and each key stores ``clamp(round((k - lo) / step), 0,
    15)`` (``step = (hi - lo) / 15``) as its nibble. Within a block each channel
    of a RoPE'd key moves little, so its own range is narrow, where a per-token scale spends its levels on
    the largest channels. The levels must be rounded once from the exact keys: a block being filled keeps
    its keys in full precision beside the cache (``kernels/int4_store.py``) and is re-derived from
    them on every write.
  - **values per token**: rotated by a fixed randomized Hadamard matrix (``int4_rotation``, QuaRot's
    trick: outlier channels spread over all of them; the output is rotated back, so attention is exact),
    then on 16 levels -8..7 with a signed scale near ``absmax / 8`` kept as one fp8 e4m3 byte (``v_scale``
    is ``[num_blocks, block_size, kv_heads]`` uint8; ``quantize_int4_values``), each value stored as
    ``level + 8``.

Kernels receive ``k_scale``/``v_scale`` as None (the cache holds the compute dtype), a 1-D per-head tensor
(fp8), a 3-D per-slot tensor (int8; int4's values, as e4m3 bytes) or int4's 4-D per-block key ranges, and
dequantize on load; a ``uint8`` cache is int4. e4m3 tops out at 448: int4 keys beyond it clip. This module is
the one definition of the formats; the engine's sizing and ``kvmesh plan`` count bytes with
``core/kv_dtype.py``, which mirrors it.
"""

from __future__ import annotations

import functools

import torch

from kvmesh.kernels.cpu_extension import cpu_op

KV_CACHE_STORAGE: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's dtype
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "int4": torch.uint8,  # packed, two per byte
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_MAX = 127.0
INT4_DTYPE = torch.uint8
FP8_HEADROOM = 8.0
"""Calibrated fp8 scales map the calibration pass's largest |K|/|V| to 1/8 of the format's range: real text
reached 2.2x the calibration maximum in SmolLM2, and a float format loses no precision to headroom (only
values below ~3e-4 of the maximum fall to e4m3's subnormals)."""


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of ``kv_cache_dtype`` (validated by ``EngineConfig``) is stored in."""
    return KV_CACHE_STORAGE[kv_cache_dtype] or model_dtype


def values_per_element(storage: torch.dtype) -> int:
    """Cache values one stored element holds: 2 for packed int4, else 1."""
    return 2 if storage == INT4_DTYPE else 1


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (same bytes): torch's CPU copy/select kernels do not take fp8 dtypes."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def fp8_scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-head fp8 scales (float32) that put ``amax`` at 1/FP8_HEADROOM of ``dtype``'s range."""
    top = torch.finfo(dtype).max
    return (amax.float() * FP8_HEADROOM / top).clamp_min(torch.finfo(torch.float32).tiny)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, head_scale: torch.Tensor | None):
    """``x`` ([tokens, kv_heads, head_dim]) as stored in a ``cache_dtype`` cache, and its per-token scales.

    Returns ``(stored, token_scales)``; ``token_scales`` ([tokens, kv_heads]) only for int8 (float16) and int4
    (e4m3 bytes): int4 here is the values' format; keys take ``quantize_int4_keys``.
    """
    if cache_dtype in FP8_DTYPES:
        top = torch.finfo(cache_dtype).max
        return (x.float() / head_scale[:, None]).clamp(-top, top).to(cache_dtype), None
    if cache_dtype == torch.int8:
        scales = (x.float().abs().amax(-1) / INT8_MAX).clamp_min(torch.finfo(torch.float16).tiny).half()
        stored = (x.float() / scales.float()[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return stored, scales
    if cache_dtype == INT4_DTYPE:  # values (keys go per block: quantize_int4_keys)
        return quantize_int4_values(x)
    return x.to(cache_dtype), None


@functools.cache
def _constant(values: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A tuple of this module's as a CPU tensor, made once: how the compiled passes receive their choices."""
    return torch.tensor(values, dtype=dtype)


INT4_VALUE_DIVISORS = (7.0, 8.0, 8.5, 9.0, 9.5, 10.0)
"""An int4 value scale is ``absmax / divisor`` for the divisor of least squared error: 8 puts the largest
magnitude on level -8, more clips it for finer steps, 7 is plain symmetric rounding (never beaten)."""


def quantize_int4_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 values ([..., head_dim], already rotated): packed nibbles and e4m3 scale bytes (``[...]``).

    All 16 levels are used: ``value = (nibble - 8) * scale``, levels -8..7, the scale signed so that the
    vector's largest magnitude lands on the negative side (the e4m3 sign bit is free, a scale being positive
    otherwise); of the scales ``INT4_VALUE_DIVISORS`` allow, each vector keeps the one of least squared error.
    On the CPU the compiled ``quantize_int4_values`` does the same in one pass (its ties may round apart).
    """
    op = cpu_op("quantize_int4_values") if x.device.type == "cpu" else None
    if op is None:
        return quantize_int4_values_torch(x)
    rows = x.float().contiguous().view(-1, x.shape[-1])
    packed = torch.empty((rows.shape[0], rows.shape[1] // 2), dtype=torch.uint8)
    scales = torch.empty(rows.shape[0], dtype=torch.uint8)
    op(rows, _constant(INT4_VALUE_DIVISORS, torch.float32), packed, scales)
    return packed.view(*x.shape[:-1], -1), scales.view(x.shape[:-1])


def quantize_int4_values_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int4_values`` in torch operations (any device)."""
    x = x.float()
    top = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    magnitudes = e4m3_bits(x.abs().amax(-1, keepdim=True) / x.new_tensor(INT4_VALUE_DIVISORS), up=True)
    bits = magnitudes | torch.where(top > 0, 128, 0).to(torch.uint8)  # [..., divisors]
    s = e4m3_values(bits).unsqueeze(-2)  # [..., 1, divisors]
    levels = (x.unsqueeze(-1) / torch.where(s != 0, s, 1.0)).round().clamp(-8, 7) * (s != 0)
    err = (levels.double() * s - x.unsqueeze(-1)).square().sum(-2)  # [..., divisors]
    best = err.argmin(-1, keepdim=True)  # ties: the first
    chosen = levels.gather(-1, best.unsqueeze(-2).expand(*levels.shape[:-1], 1)).squeeze(-1)
    return pack_int4((chosen + 8).to(torch.uint8)), bits.gather(-1, best).squeeze(-1)


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """Values 0..15 (uint8) two per byte, element ``2i`` in byte ``i``'s low nibble: the last dim halves."""
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(stored: torch.Tensor) -> torch.Tensor:
    """The nibbles (0..15, uint8) of a packed int4 tensor: the last dim doubles."""
    return torch.stack(((stored & 15), (stored >> 4)), dim=-1).flatten(-2)


E4M3_MAX = 448.0


def e4m3_bits(x: torch.Tensor, up: bool) -> torch.Tensor:
    """``x`` on fp8 e4m3's grid, rounded toward +inf (``up``) or -inf, as its bytes (uint8); saturates at
    +-448. Directed so that a range stored this way still contains the values it was taken from."""
    x = x.float().clamp(-E4M3_MAX, E4M3_MAX)
    near = x.to(torch.float8_e4m3fn)
    off = near.float() < x if up else near.float() > x
    bits = near.view(torch.uint8).to(torch.int16)
    magnitude, negative = bits & 127, bits >= 128
    magnitude = magnitude + torch.where(negative, -1, 1) * (1 if up else -1)  # one grid step the wanted way
    negative = torch.where(magnitude < 0, ~negative, negative)  # stepped across zero
    moved = (magnitude.abs() | (negative.to(torch.int16) << 7)).to(torch.uint8)
    return torch.where(off, moved, near.view(torch.uint8))


def e4m3_values(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of e4m3 bytes."""
    return bits.view(torch.float8_e4m3fn).float()


def int4_key_ranges(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, step)`` (float32, ``[..., kv_heads, head_dim]``) of int4 key ranges ``[..., kv_heads, 2,
    head_dim]``: a key is ``lo + step * nibble``."""
    lo, hi = e4m3_values(params[..., 0, :]), e4m3_values(params[..., 1, :])
    return lo, (hi - lo) / 15


INT4_KEY_RANGE_ENDS = ((False, True), (False, False), (True, True), (True, False))
"""The e4m3 neighbours a key range may take for its (lo, hi): each rounded down or up (``up``), the outward
pair first. A block's channel keeps the pair of least squared error over its keys: outward contains every key,
but at a channel far from zero e4m3's grid (3 mantissa bits) can widen it several times over; an end rounded
inward clips its extreme keys a little instead."""


def quantize_int4_keys(rows: torch.Tensor, fill: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks of keys ``rows`` ([blocks, block_size, kv_heads, head_dim]) as an int4 cache stores them,
    of which each block's first ``fill`` slots hold keys: ``(packed, ranges)``, the packed nibbles (the
    slots past ``fill`` get 0) and the per-channel ranges ``[blocks, kv_heads, 2, head_dim]`` (e4m3 bytes,
    ``INT4_KEY_RANGE_ENDS``).
    On the CPU the compiled ``quantize_int4_keys`` does the same in one pass (its ties may round apart)."""
    op = cpu_op("quantize_int4_keys") if rows.device.type == "cpu" else None
    if op is not None:
        x = rows.float().contiguous()
        packed = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8)
        params = torch.empty((x.shape[0], x.shape[2], 2, x.shape[3]), dtype=torch.uint8)
        op(x, fill.long(), _constant(INT4_KEY_RANGE_ENDS, torch.bool), packed, params)
        return packed, params
    return quantize_int4_keys_torch(rows, fill)


def quantize_int4_keys_torch(rows: torch.Tensor, fill: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int4_keys`` in torch operations (any device)."""
    x = rows.float()
    valid = (torch.arange(x.shape[1], device=x.device)[None, :] < fill[:, None])[:, :, None, None]
    lo = torch.where(valid, x, float("inf")).amin(1)
    hi = torch.where(valid, x, float("-inf")).amax(1)
    ends = [(e4m3_bits(lo, up=lo_up), e4m3_bits(hi, up=hi_up)) for lo_up, hi_up in INT4_KEY_RANGE_ENDS]
    params = torch.stack([torch.stack(pair, dim=-2) for pair in ends])  # [ends, blocks, kv_heads, 2, head_dim]
    lo, step = (t[:, :, None] for t in int4_key_ranges(params))
    levels = torch.where(step > 0, (x - lo) / step, 0.0).round().clamp(0, 15)
    err = torch.where(valid, (lo.double() + step.double() * levels - x).square(), 0.0).sum(2)
    best = torch.where(step[:, :, 0] >= 0, err, float("inf")).argmin(0)  # ties: the first, outward
    levels = levels.gather(0, best[None, :, None].expand(1, *levels.shape[1:]))[0]
    params = params.gather(0, best[None, :, :, None].expand(1, *params.shape[1:]))[0]
    return pack_int4(torch.where(valid, levels, 0.0).to(torch.uint8)), params


def dequantize_int4_keys(packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """float32 keys of whole int4 blocks ``packed`` ([blocks, block_size, kv_heads, head_dim / 2]) with
    their ranges ``params`` ([blocks, kv_heads, 2, head_dim])."""
    lo, step = int4_key_ranges(params)
    return lo[:, None] + step[:, None] * unpack_int4(packed).float()


@functools.cache
def _rotation(head_dim: int) -> torch.Tensor:
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(0)) * 2.0 - 1.0
    if head_dim & (head_dim - 1) == 0:  # Sylvester's Hadamard matrix
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        h = h / head_dim**0.5
    else:  # any orthogonal matrix spreads outliers; a seeded one is the same everywhere
        gen = torch.Generator().manual_seed(0)
        h = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64))[0]
    return signs.double()[:, None] * h


def int4_rotation(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The fixed orthogonal ``[head_dim, head_dim]`` matrix an int4 cache stores V rotated by (a
    Hadamard matrix with seeded random signs on its rows for powers of two, a seeded random orthogonal one
    otherwise); ``x @ R`` rotates, ``y @ R.T`` rotates back."""
    return _rotation(head_dim).to(dtype=dtype, device=device)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Values of ``stored`` ([..., kv_heads, head_dim]) in ``dtype``.

    ``scale`` is None, per head ([kv_heads]) or per token-head (``stored.shape[:-1]``); a ``uint8`` ``stored``
    is packed int4 values (its last dim is half theirs; int4 keys: ``dequantize_int4_keys``).
    """
    if stored.dtype == INT4_DTYPE:
        stored = unpack_int4(stored).to(torch.int8) - 8
        scale = e4m3_values(scale)
    if scale is None:
        return stored.to(dtype)
    return (stored.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)
