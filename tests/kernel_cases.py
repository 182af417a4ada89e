"""Random paged-attention problems shared by the kernel tests."""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from kvmesh.kernels import AttentionMetadata


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
    return float((out.cpu().double() - expected).norm() / expected.norm())


def to_device(meta: AttentionMetadata, device) -> AttentionMetadata:
    """The same batch description with its tensors on ``device`` (the CPU lists stay)."""
    tensors = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
    return replace(meta, **{name: getattr(meta, name).to(device) for name in tensors})


def check_against_reference(
    store_kv,
    paged_attention,
    seed: int,
    case: int,
    dtype,
    tol: float,
    window: int | None = None,
    device: str = "cpu",
    splits: int | None = None,
    group: int | None = None,
    head_dim: int | None = None,
    **shape,
) -> None:
    """Store a random batch's new K/V and attend with the implementation under test, against float64.

    Shapes are fresh per case: block 16/32, GQA ratio 1/3/4/8 by case, 1-2 KV heads, head_dim 64/128. The
    output starts as NaN, so any element the implementation forgets to write fails the comparison.
    ``window``: sliding-window attention over the same batch. ``device``: where the implementation under
    test runs (the float64 reference always runs on the CPU). ``splits``: the parts each decode context is
    split into (the Triton kernels' flash-decoding; None lets them choose). ``group``, ``head_dim``: fixed
    instead of drawn.
    """
    from kvmesh.kernels.reference import paged_attention_reference, store_kv_reference

    rng = random.Random(seed)
    block_size = rng.choice([16, 32])
    group = [1, 3, 4, 8][case % 4] if group is None else group
    head_dim = rng.choice([64, 128]) if head_dim is None else head_dim
    meta, q, k, v, kc, vc = random_batch(rng, block_size, rng.choice([1, 2]), group, head_dim, **shape)
    scale = head_dim**-0.5
    ref_kc, ref_vc = kc.clone(), vc.clone()
    store_kv_reference(k, v, ref_kc, ref_vc, meta.slot_mapping)
    expected = paged_attention_reference(q, ref_kc, ref_vc, meta, scale, window)
    kc_t, vc_t, dmeta = (
        kc.to(device, dtype),
        vc.to(device, dtype),
        replace(to_device(meta, device), decode_splits=splits),
    )
    store_kv(k.to(device, dtype), v.to(device, dtype), kc_t, vc_t, dmeta.slot_mapping)
    assert torch.equal(kc_t.cpu(), ref_kc.to(dtype)) and torch.equal(vc_t.cpu(), ref_vc.to(dtype))
    out = torch.full_like(q, float("nan"), dtype=dtype, device=device)
    paged_attention(q.to(device, dtype), kc_t, vc_t, dmeta, scale, out=out, **({"window": window} if window else {}))
    err = relative_error(out, expected)
    assert err <= tol, f"relative error {err:.2e} (block {block_size}, group {group}, head_dim {head_dim})"


def _dequantized(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 values of a quantized cache, written out independently of ``kvmesh.kernels.quant``: a uint8
    cache is int4, two values per byte (low nibble first); its keys are ``lo + (hi - lo) / 15 * nibble`` with
    ``lo``/``hi`` per block and channel (``scale`` [blocks, kv_heads, 2, head_dim] e4m3 bytes), its values
    ``(nibble - 8) * scale`` with an e4m3 byte per slot."""
    if stored.dtype == torch.uint8:
        nibbles = torch.stack((stored.long() % 16, stored.long() // 16), dim=-1).flatten(-2).double()
        if scale.dim() == 4:
            lo, hi = _key_ranges(scale)
            return lo[:, None] + (hi - lo)[:, None] / 15 * nibbles
        return (nibbles - 8) * scale.view(torch.float8_e4m3fn).double()[..., None]
    return stored.double() * scale.double()[..., None]


def _key_ranges(ranges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(lo, hi)`` of int4 key ranges ([blocks, kv_heads, 2, head_dim] e4m3 bytes)."""
    return tuple(ranges[..., i, :].view(torch.float8_e4m3fn).double() for i in (0, 1))


def _beyond(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """How far ``x`` lies outside ``[lo, hi]``: what clipping to a quantizer's levels adds to its rounding."""
    return (lo - x.double()).clamp_min(0) + (x.double() - hi).clamp_min(0)


def _rounding_bound(x: torch.Tensor, scale: torch.Tensor, storage, slots, kvh: int, block_size: int) -> torch.Tensor:
    """How far a stored value may be from its input ``x`` ([slots, kv_heads, head_dim]): half a step for int8
    and int4 (int4 keys: their block's step in that channel), plus for int4 how far beyond its levels ``x``
    lies (both choose ranges that may clip); half an ulp of fp8 (relative, above its subnormals)."""
    if scale.dim() == 4:  # int4 keys: their block's range per channel
        lo, hi = (t[slots // block_size] for t in _key_ranges(scale))
        return 0.5001 * (hi - lo) / 15 + _beyond(x, lo, hi)
    if scale.dtype == torch.uint8:  # int4 values: levels -8..7 times a signed scale
        s = scale.view(torch.float8_e4m3fn).double().view(-1, kvh)[slots][..., None]
        return 0.5001 * s.abs() + _beyond(x, torch.minimum(-8 * s, 7 * s), torch.maximum(-8 * s, 7 * s))
    s = scale.view(-1, kvh)[slots].double() if scale.dim() == 3 else scale.double().expand(len(slots), kvh)
    if storage == torch.int8:
        return 0.5001 * s[..., None]
    info = torch.finfo(storage)
    return torch.maximum(x.double().abs() * info.eps / 2, s[..., None] * info.smallest_normal * info.eps)


def check_quantized(
    store_kv,
    paged_attention,
    seed: int,
    case: int,
    kv_dtype: str,
    dtype,
    tol: float,
    device: str = "cpu",
    window: int | None = None,
    **shape,
):
    """Store into a quantized cache and attend over it with the implementation under test.

    Each stored value must be within rounding of its input (half a step for int8 and int4, half an ulp of
    the fp8 format, relative, above its subnormals), and attention must match the float64 reference over the
    dequantized cache: quantization error is the format's, never the kernel's. ``window``: sliding-window
    attention over the same batch.
    """
    from kvmesh.kernels.quant import FP8_DTYPES, KV_CACHE_STORAGE, fp8_scale_from_amax, quantize, quantize_int4_keys
    from kvmesh.kernels.reference import paged_attention_reference

    rng = random.Random(seed)
    block_size = rng.choice([16, 32])
    group = [1, 3, 4, 8][case % 4]
    head_dim = rng.choice([64, 128])
    kvh = rng.choice([1, 2])
    meta, q, k, v, kc64, vc64 = random_batch(rng, block_size, kvh, group, head_dim, **shape)
    storage = KV_CACHE_STORAGE[kv_dtype]
    caches = []
    for c in (kc64, vc64):  # stale contents are valid quantized data too
        if storage == torch.uint8 and c is kc64:  # int4 keys: whole blocks
            caches += list(quantize_int4_keys(c, torch.full((c.shape[0],), block_size)))
            continue
        head_scale = fp8_scale_from_amax(c.abs().amax((0, 1, 3)), storage) if storage in FP8_DTYPES else None
        stored, token_scales = quantize(c.view(-1, kvh, head_dim), storage, head_scale)
        scale = head_scale if token_scales is None else token_scales.view(c.shape[:-1]).clone()
        caches += [stored.view(*c.shape[:-1], -1).clone(), scale]  # int4: half the last dim
    on = [c.to(device) for c in caches]  # k cache, k scales, v cache, v scales where the kernels run
    k_in, v_in, dmeta = k.to(device, dtype), v.to(device, dtype), to_device(meta, device)
    store_kv(k_in, v_in, on[0], on[2], dmeta.slot_mapping, on[1], on[3])
    kc, ks, vc, vs, k_in, v_in = (c.cpu() for c in (*on, k_in, v_in))
    slots = meta.slot_mapping
    for x, cache, scale in ((k_in, kc, ks), (v_in, vc, vs)):
        err = (_dequantized(cache, scale).view(-1, kvh, head_dim)[slots] - x.double()).abs()
        bound = _rounding_bound(x, scale, storage, slots, kvh, block_size)
        assert bool((err <= bound * 1.001 + 1e-12).all()), f"{kv_dtype}: stored value off by more than rounding"
    scale = head_dim**-0.5
    expected = paged_attention_reference(q, _dequantized(kc, ks), _dequantized(vc, vs), meta, scale, window)
    out = torch.full_like(q, float("nan"), dtype=dtype, device=device)
    extra = {"window": window} if window else {}
    paged_attention(q.to(device, dtype), on[0], on[2], dmeta, scale, out=out, k_scale=on[1], v_scale=on[3], **extra)
    err = relative_error(out, expected)
    assert err <= tol, f"{kv_dtype}: relative error {err:.2e} (block {block_size}, group {group}, head_dim {head_dim})"
