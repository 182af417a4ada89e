"""Block hashing shared by the router and every replica.

This is the single definition of a KV block's identity (``docs/architecture.md``, "Block hashing"): the router hashes a
prompt once and looks the chain up in the global index; the replica's prefix cache keys its blocks by the
very same values, so an index hit means a real cache hit. It must stay free of torch so the router and the
ingress can import it cheaply.

    h[i] = xxh3_128(h[i-1] || tokens[i*B:(i+1)*B] as little-endian uint32 || extra_i)

``h[-1]`` is a 16-byte seed derived from the model identity; ``extra_0`` carries the cache salt (tenant)
and adapter id, later blocks carry nothing extra because the chain already binds them to block 0.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

BlockHash = bytes
"""A 16-byte xxh3_128 digest naming one block and, through the chain, its whole prefix."""

_TOKEN_BYTES = 4


def model_seed(model_id: str) -> BlockHash:
    """The chain's root ``h[-1]``: two models never share a block hash, even for identical token ids."""
    return xxhash.xxh3_128_digest(b"kvmesh-model\x00" + model_id.encode())


def first_block_extra(cache_salt: str | None = None, adapter_id: str | None = None) -> bytes:
    """Bytes mixed into block 0 so another tenant (salt) or LoRA adapter never collides with this one."""
    if not cache_salt and not adapter_id:
        return b""
    return b"\x00salt=" + (cache_salt or "").encode() + b"\x00adapter=" + (adapter_id or "").encode()


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash; ``extra`` is only non-empty for block 0."""
    return xxhash.xxh3_128_digest(parent + struct.pack(f"<{len(tokens)}I", *tokens) + extra)


def hash_blocks(
    tokens: Sequence[int],
    block_size: int,
    seed: BlockHash,
    extra: bytes = b"",
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block of ``tokens`` (a partial tail block is never hashed).

    To extend an existing chain, pass the last known hash as ``parent`` and the index of the first block
    still to hash as ``start_block``; ``extra`` then applies only if ``start_block`` is 0.
    """
    num_full = len(tokens) // block_size
    if start_block >= num_full:
        return []
    # Pack once and slice bytes: far cheaper than one struct.pack per block on long prompts.
    span = tokens[start_block * block_size : num_full * block_size]
    packed = struct.pack(f"<{len(span)}I", *span)
    stride = block_size * _TOKEN_BYTES
    prev = seed if parent is None else parent
    out: list[BlockHash] = []
    digest = xxhash.xxh3_128_digest
    for i in range(num_full - start_block):
        chunk = packed[i * stride : (i + 1) * stride]
        prev = digest(prev + chunk + extra) if start_block + i == 0 else digest(prev + chunk)
        out.append(prev)
    return out
