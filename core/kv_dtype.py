"""The KV cache dtypes kvmesh supports and what each costs per token: the one definition of that arithmetic.

The engine sizes its KV pool with ``kv_bytes_per_token`` and ``kvmesh plan`` sizes GPU pools with it, so
a pool planned on paper and the pool a replica allocates agree to the byte. Layouts, per token, per layer,
per KV head, for K and for V alike:

- ``auto``: ``head_dim`` elements in the model dtype (2 bytes for fp16/bf16, 4 for fp32).
- ``fp8_e4m3``, ``fp8_e5m2``: ``head_dim`` bytes. Their scales are static, a few floats per layer and KV
  head, so they cost nothing per token.
- ``int8``: ``head_dim`` bytes plus one float16 scale (symmetric, absmax / 127) per token and KV head.
- ``int4``: ``head_dim / 2`` bytes (two 4-bit values per byte) for each of K and V; values add one e4m3
  scale byte per token and KV head, keys share two e4m3 bytes per channel (their range) per block and KV
  head: ``2 * head_dim / block_size`` bytes per token (``kernels/quant.py``).

Torch-free, so the planner and the ingress side of the project can use it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """How one token's K and V vectors for one KV head are stored."""

    element_bits: int | None
    """Bits per element; ``None`` means the model dtype's."""
    scale_bytes: tuple[int, int]
    """Bytes of quantization scale stored with each token's K and V vector (0 where scales are per layer)."""
    key_range_bytes: int = 0
    """Bytes per key channel shared by a block's tokens (int4's per-block ranges)."""


KV_LAYOUTS: dict[str, KVLayout] = {
    "auto": KVLayout(element_bits=None, scale_bytes=(0, 0)),
    "fp8_e4m3": KVLayout(element_bits=8, scale_bytes=(0, 0)),
    "fp8_e5m2": KVLayout(element_bits=8, scale_bytes=(0, 0)),
    "int8": KVLayout(element_bits=8, scale_bytes=(2, 2)),  # one float16 scale per token per KV head
    "int4": KVLayout(element_bits=4, scale_bytes=(0, 1), key_range_bytes=2),  # keys: lo/hi per block and channel
}
KV_CACHE_DTYPES: tuple[str, ...] = tuple(KV_LAYOUTS)
"""``("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4")``"""

MODEL_DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
"""Element size of the model dtypes the engine runs in: what ``auto`` stores K and V in."""
_MODEL_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


def model_dtype_name(name: str) -> str:
    """The canonical name of a model dtype as configs and users spell it (``bf16``, ``torch.float16``, ...)."""
    key = str(name).lower().removeprefix("torch.")
    key = _MODEL_DTYPE_ALIASES.get(key, key)
    if key not in MODEL_DTYPE_BYTES:
        raise ValueError(f"unknown model dtype {name!r}; valid: {', '.join(MODEL_DTYPE_BYTES)}")
    return key


def kv_bytes_per_token(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
    model_dtype_bytes: int,
    block_size: int = 16,
) -> int:
    """Bytes of KV cache one token occupies across all layers: K and V, every KV head, scales included (int4's
    per-block key ranges spread over the block's ``block_size`` tokens).

    ``model_dtype_bytes`` (the model's element size) only matters for ``auto``."""
    layout = KV_LAYOUTS.get(kv_cache_dtype)
    if layout is None:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; valid: {', '.join(KV_CACHE_DTYPES)}")
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    bits = layout.element_bits
    if bits is None:
        if model_dtype_bytes < 1:
            raise ValueError(f"model_dtype_bytes must be positive, got {model_dtype_bytes}")
        bits = 8 * model_dtype_bytes
    if head_dim * bits % 8:
        raise ValueError(f"{kv_cache_dtype} packs two values per byte: head_dim must be even, got {head_dim}")
    ranges = head_dim * layout.key_range_bytes
    if ranges % block_size:
        raise ValueError(
            f"{kv_cache_dtype}: {block_size}-token blocks cannot share {ranges} bytes of key ranges evenly"
        )
    per_head = 2 * (head_dim * bits // 8) + sum(layout.scale_bytes) + ranges // block_size
    return num_layers * num_kv_heads * per_head
