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
  nibble, ``2i + 1`` in the high one, each stored as ``value + 8``), with int8's per-slot float16 scale at
  ``absmax / 7``. Four bits cannot follow the outlier channels of keys per token (KIVI); so K, V and Q are
  first rotated by a fixed orthogonal matrix (``int4_rotation``: a randomized Hadamard transform, as QuaRot
  does), which spreads each outlier over every channel. Attention is unchanged by it (``q.k = (qR).(kR)``,
  and the output is rotated back), and it is the same on every replica. Keys are also stored less their
  mean per layer and KV head, calibrated at start-up (one vector subtracted from every key shifts every
  score of a query alike, which softmax ignores), so their shared offset spends none of the four bits.

Kernels receive ``k_scale``/``v_scale`` as None (the cache holds the compute dtype), a 1-D per-head tensor
(fp8) or a 3-D per-slot tensor (int8, int4), and dequantize on load; a ``uint8`` cache is int4. This module
is the one definition of the formats; the engine's sizing and ``kvmesh plan`` count bytes with
``kvmesh/shared/kv_dtype.py``, which mirrors it.
"""

from __future__ import annotations

import functools

import torch

KV_CACHE_STORAGE: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's dtype
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "int4": torch.uint8,  # packed, two per byte
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_MAX = 127.0
INT4_MAX = 7.0
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

    Returns ``(stored, token_scales)``; ``token_scales`` ([tokens, kv_heads] float16) only for int8/int4.
    """
    if cache_dtype in FP8_DTYPES:
        top = torch.finfo(cache_dtype).max
        return (x.float() / head_scale[:, None]).clamp(-top, top).to(cache_dtype), None
    if cache_dtype == torch.int8:
        scales = (x.float().abs().amax(-1) / INT8_MAX).clamp_min(torch.finfo(torch.float16).tiny).half()
        stored = (x.float() / scales.float()[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return stored, scales
    if cache_dtype == INT4_DTYPE:
        scales = (x.float().abs().amax(-1) / INT4_MAX).clamp_min(torch.finfo(torch.float16).tiny).half()
        levels = (x.float() / scales.float()[..., None]).round().clamp(-INT4_MAX, INT4_MAX).to(torch.uint8) + 8
        return levels[..., 0::2] | (levels[..., 1::2] << 4), scales
    return x.to(cache_dtype), None


def unpack_int4(stored: torch.Tensor) -> torch.Tensor:
    """The signed levels (-7..7, int8) of a packed int4 tensor: the last dim doubles."""
    pair = torch.stack(((stored & 15), (stored >> 4)), dim=-1).to(torch.int8) - 8
    return pair.flatten(-2)


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
    """The fixed orthogonal ``[head_dim, head_dim]`` matrix an int4 cache stores K and V rotated by (a
    Hadamard matrix with seeded random signs on its rows for powers of two, a seeded random orthogonal one
    otherwise); ``x @ R`` rotates, ``y @ R.T`` rotates back."""
    return _rotation(head_dim).to(dtype=dtype, device=device)


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Values of ``stored`` ([..., kv_heads, head_dim]) in ``dtype``.

    ``scale`` is None, per head ([kv_heads]) or per token-head (``stored.shape[:-1]``); a ``uint8`` ``stored``
    is packed int4 (its values' last dim is twice its own).
    """
    if stored.dtype == INT4_DTYPE:
        stored = unpack_int4(stored)
    if scale is None:
        return stored.to(dtype)
    return (stored.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)
