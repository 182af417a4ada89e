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

Kernels receive ``k_scale``/``v_scale`` as None (the cache holds the compute dtype), a 1-D per-head tensor
(fp8) or a 3-D per-slot tensor (int8), and dequantize on load. This module is the one definition of the
formats; the engine's sizing and ``kvmesh plan`` count bytes with ``kvmesh/shared/kv_dtype.py``, which mirrors it.
"""

from __future__ import annotations

import torch

KV_CACHE_STORAGE: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's dtype
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_MAX = 127.0
FP8_HEADROOM = 8.0
"""Calibrated fp8 scales map the calibration pass's largest |K|/|V| to 1/8 of the format's range: real text
reached 2.2x the calibration maximum in SmolLM2, and a float format loses no precision to headroom (only
values below ~3e-4 of the maximum fall to e4m3's subnormals)."""


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of ``kv_cache_dtype`` (validated by ``EngineConfig``) is stored in."""
    return KV_CACHE_STORAGE[kv_cache_dtype] or model_dtype


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (same bytes): torch's CPU copy/select kernels do not take fp8 dtypes."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def fp8_scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-head fp8 scales (float32) that put ``amax`` at 1/FP8_HEADROOM of ``dtype``'s range."""
    top = torch.finfo(dtype).max
    return (amax.float() * FP8_HEADROOM / top).clamp_min(torch.finfo(torch.float32).tiny)


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, head_scale: torch.Tensor | None):
    """``x`` ([tokens, kv_heads, head_dim]) as stored in a ``cache_dtype`` cache, and its per-token scales.

    Returns ``(stored, token_scales)``; ``token_scales`` ([tokens, kv_heads] float16) only for int8.
    """
    if cache_dtype in FP8_DTYPES:
        top = torch.finfo(cache_dtype).max
        return (x.float() / head_scale[:, None]).clamp(-top, top).to(cache_dtype), None
    if cache_dtype == torch.int8:
        scales = (x.float().abs().amax(-1) / INT8_MAX).clamp_min(torch.finfo(torch.float16).tiny).half()
        stored = (x.float() / scales.float()[..., None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return stored, scales
    return x.to(cache_dtype), None


def dequantize(stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Values of ``stored`` ([..., kv_heads, head_dim]) in ``dtype``.

    ``scale`` is None, per head ([kv_heads]) or per token-head (``stored.shape[:-1]``).
    """
    if scale is None:
        return stored.to(dtype)
    return (stored.to(torch.float32) * scale.to(torch.float32)[..., None]).to(dtype)
