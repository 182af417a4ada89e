import struct

import xxhash

from kvmesh.core.hashing import first_block_extra, hash_block, hash_blocks, model_seed

SEED = model_seed("m")


def test_matches_the_documented_definition():
    tokens = list(range(40))
    h = hash_blocks(tokens, 16, SEED)
    assert len(h) == 2  # the partial third block is never hashed
    h0 = xxhash.xxh3_128_digest(SEED + struct.pack("<16I", *range(16)))
    assert h[0] == h0
    assert h[1] == xxhash.xxh3_128_digest(h0 + struct.pack("<16I", *range(16, 32)))
    assert h[1] == hash_block(h[0], tokens[16:32])


def test_changing_one_token_changes_that_block_and_all_later():
    tokens = list(range(100, 164))
    other = list(tokens)
    other[20] += 1  # block 1
    a, b = hash_blocks(tokens, 16, SEED), hash_blocks(other, 16, SEED)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_model_salt_and_adapter_isolate():
    tokens = list(range(32))
    base = hash_blocks(tokens, 16, SEED)
    assert hash_blocks(tokens, 16, model_seed("other")) != base
    salted = hash_blocks(tokens, 16, SEED, first_block_extra(cache_salt="tenant-a"))
    assert salted[0] != base[0] and salted[1] != base[1]
    assert salted != hash_blocks(tokens, 16, SEED, first_block_extra(cache_salt="tenant-b"))
    assert salted != hash_blocks(tokens, 16, SEED, first_block_extra(adapter_id="tenant-a"))
    assert first_block_extra() == b""


def test_extending_a_chain_equals_hashing_everything():
    tokens = list(range(7, 7 + 80))
    full = hash_blocks(tokens, 16, SEED, b"x")
    head = hash_blocks(tokens[:40], 16, SEED, b"x")
    tail = hash_blocks(tokens, 16, SEED, b"x", parent=head[-1], start_block=len(head))
    assert head + tail == full
