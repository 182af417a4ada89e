"""The disk tier under the host tier: blocks the host tier evicts live in checksummed files, come back on a
hit with the tokens computing them gives, survive a restart, and a broken or foreign file is never served."""

from __future__ import annotations

import logging
import os

import pytest

from kvmesh.core.hashing import hash_blocks
from kvmesh.replica import EngineConfig, LLMEngine
from kvmesh.replica.disk_tier import DiskTier, DiskTierBusy
from kvmesh.router.index_publisher import KVIndexPublisher
from tests.index_helpers import query
from tests.test_host_tier import run

BLOCK = 16
HISTORY = [100 + i for i in range(10 * BLOCK)]  # a conversation's 10 full blocks
FOLLOW_UP = [*HISTORY, 7, 8, 9]


def make(model: str, disk_dir=None, host_blocks: int = 12, kv_cache_dtype: str = "auto") -> LLMEngine:
    """24 device blocks, ``host_blocks`` in the host tier, the disk tier in ``disk_dir``."""
    config = EngineConfig(
        model=model, block_size=BLOCK, num_kv_blocks=1, swap_space_bytes=0, kv_cache_dtype=kv_cache_dtype
    )
    per_block = LLMEngine(config).bytes_per_block
    engine = LLMEngine(
        EngineConfig(
            model=model,
            block_size=BLOCK,
            num_kv_blocks=24,
            swap_space_bytes=0,
            host_cache_bytes=host_blocks * per_block,
            disk_cache_dir=None if disk_dir is None else str(disk_dir),
            max_num_batched_tokens=512,
            kv_cache_dtype=kv_cache_dtype,
        )
    )
    if engine.swap is not None and engine.swap.disk is not None:
        # The tiny model recomputes a block faster than a cold disk may read one, and the engine would then
        # (rightly) recompute: these tests are about the disk path, so its measured read rate is pinned high.
        engine.swap.disk.read_bytes_s = 1e12
    return engine


def push_history_to_disk(engine: LLMEngine) -> None:
    """Run the history, then other conversations that evict it from the device pool and the host tier."""
    run(engine, HISTORY)
    for k in range(6):
        run(engine, [5000 + 300 * k + i for i in range(15 * BLOCK)])
    hashes = hash_blocks(HISTORY, BLOCK, engine.hash_seed)
    assert not any(engine.pool.lookup(h) for h in hashes), "the history was meant to leave the device"
    assert not set(hashes) & set(engine.swap.cached_hashes()), "and the host tier"
    engine.swap.disk.flush()
    assert all(h in engine.swap.disk for h in hashes)


def restarted_after_pushing_history(model_dir, cache_dir) -> LLMEngine:
    """A fresh engine on ``cache_dir`` after an earlier one pushed the history to disk there and closed."""
    first = make(str(model_dir), cache_dir)
    push_history_to_disk(first)
    first.close()
    return make(str(model_dir), cache_dir)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The follow-up's greedy tokens on an engine that computes everything, per cache dtype."""
    return {kv: run(make(str(tiny_llama_dir), kv_cache_dtype=kv), FOLLOW_UP)[0] for kv in ("auto", "int4")}


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_a_prefix_pushed_through_the_host_tier_to_disk_comes_back(tiny_llama_dir, tmp_path, reference, kv):
    engine = make(str(tiny_llama_dir), tmp_path, kv_cache_dtype=kv)
    push_history_to_disk(engine)
    tokens, cached = run(engine, FOLLOW_UP)
    assert tokens == reference[kv], "blocks read back from disk must give the tokens computing them gives"
    assert cached == 10 * BLOCK, "every block of the history counts as cached"
    stats = engine.stats()  # what /metrics and kvmesh status show
    assert stats.disk_blocks_read == 10 and 10 <= stats.disk_tier_used_blocks <= stats.disk_tier_blocks
    engine.close()


def test_a_restarted_replica_serves_its_first_repeat_from_disk(tiny_llama_dir, tmp_path, reference):
    restarted = restarted_after_pushing_history(tiny_llama_dir, tmp_path)
    assert restarted.swap.disk.adopted >= 10
    tokens, cached = run(restarted, FOLLOW_UP)
    assert (tokens, cached) == (reference["auto"], 10 * BLOCK)
    restarted.close()


def test_a_clean_shutdown_keeps_what_the_device_still_held(tiny_llama_dir, tmp_path, reference):
    """The history never left the device; closing the engine writes it out, and the next replica hits it."""
    first = make(str(tiny_llama_dir), tmp_path)
    run(first, HISTORY)
    first.close()
    restarted = make(str(tiny_llama_dir), tmp_path)
    assert (restarted.swap.disk.adopted, *run(restarted, FOLLOW_UP)) == (10, reference["auto"], 10 * BLOCK)
    restarted.close()


def test_the_index_shows_a_restarted_replicas_disk_blocks_before_any_request(tiny_llama_dir, tmp_path, redis_server):
    """The replica's first snapshot carries its adopted disk blocks: routers see them at once."""
    engine = restarted_after_pushing_history(tiny_llama_dir, tmp_path)
    pool, swap = engine.pool, engine.swap
    publisher = KVIndexPublisher(
        redis_server.url,
        "disk-restart",
        engine.model_id,
        "r",
        pool.cached_hashes,
        host_snapshot=swap.cached_hashes,
        disk_snapshot=swap.disk.hashes,
    ).start()
    engine.kv_event_sinks.append(publisher.publish)
    assert publisher.wait_synced(10)
    chain = hash_blocks(FOLLOW_UP, BLOCK, engine.hash_seed)
    got = query(redis_server.url, "disk-restart", engine.model_id, chain, [publisher.replica_id])
    assert got.disk_hits == {publisher.replica_id: 10} and not got.host_hits
    run(engine, FOLLOW_UP)  # read back into the host tier and loaded: the index follows the events
    assert publisher.wait_synced(10)
    got = query(redis_server.url, "disk-restart", engine.model_id, chain, [publisher.replica_id])
    assert got.device_hits == {publisher.replica_id: 10}
    publisher.close()
    engine.close()


def test_a_broken_file_is_rejected_and_recomputed(tiny_llama_dir, tmp_path, reference, caplog):
    first = make(str(tiny_llama_dir), tmp_path)
    push_history_to_disk(first)
    first.close()
    files = {p.stem: p for p in tmp_path.glob("*/*.kvb")}
    hashes = hash_blocks(HISTORY, BLOCK, first.hash_seed)
    flipped, truncated = files[hashes[3].hex()], files[hashes[6].hex()]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of the payload
    flipped.write_bytes(bytes(data))
    with truncated.open("r+b") as f:
        f.truncate(os.path.getsize(truncated) - 100)
    with caplog.at_level(logging.WARNING, logger="kvmesh.replica.disk_tier"):
        restarted = make(str(tiny_llama_dir), tmp_path)
        tokens, cached = run(restarted, FOLLOW_UP)
    assert tokens == reference["auto"]
    assert cached == 3 * BLOCK, "the blocks before the flipped one are served, the rest recomputed"
    assert "checksum mismatch" in caplog.text and "a block file has" in caplog.text
    assert not flipped.exists() and not truncated.exists()
    restarted.close()


def test_a_disk_slower_than_recomputing_is_not_read(tiny_llama_dir, tmp_path, reference):
    engine = make(str(tiny_llama_dir), tmp_path)
    push_history_to_disk(engine)
    engine.swap.disk.read_bytes_s = 1.0  # a byte per second: recomputing wins
    assert run(engine, FOLLOW_UP) == (reference["auto"], 0)
    engine.close()


def test_two_replicas_never_share_a_directory(tmp_path):
    fingerprint = bytes(32)
    a = DiskTier(tmp_path, 1 << 20, fingerprint, 1024)
    b = DiskTier(tmp_path, 1 << 20, fingerprint, 1024)
    assert a.root == tmp_path and b.root == tmp_path / "slot-1"
    a.close()
    c = DiskTier(tmp_path, 1 << 20, fingerprint, 1024)  # a restarted replica takes the free slot
    assert c.root == tmp_path
    with pytest.raises(DiskTierBusy, match="in use"):
        DiskTier._claim_slot(tmp_path, slots=2)
    b.close()
    c.close()


def test_the_tier_is_bounded_lru_and_foreign_fingerprints_stay_apart(tmp_path):
    tier = DiskTier(tmp_path, 3 * (1024 + 72), bytes(32), 1024)
    assert tier.num_blocks == 3
    blocks = {bytes([i]) * 16: bytes([i]) * 1024 for i in range(4)}
    for h, payload in list(blocks.items())[:3]:
        tier.put(h, payload)
    tier.read(bytes([0]) * 16)  # block 0 used again: block 1 is now the oldest
    tier.put(bytes([3]) * 16, blocks[bytes([3]) * 16])
    tier.flush()
    assert sorted(tier.hashes()) == sorted(bytes([i]) * 16 for i in (0, 2, 3))
    assert tier.read(bytes([2]) * 16) == blocks[bytes([2]) * 16]
    assert len(list(tier.dir.glob("*.kvb"))) == 3
    tier.close()
    other = DiskTier(tmp_path, 1 << 20, bytes([1]) * 32, 1024)  # another model or layout: sees nothing
    assert other.adopted == 0 and len(other) == 0
    other.close()
    again = DiskTier(tmp_path, 1 << 20, bytes(32), 1024)
    assert again.adopted == 3 and again.read(bytes([3]) * 16) == blocks[bytes([3]) * 16]
    again.close()


def test_a_write_the_disk_refuses_is_dropped_counted_and_not_claimed(tiny_llama_dir, tmp_path):
    """A full disk loses blocks, never requests: the engine counts them (``disk_blocks_dropped``, at /metrics)
    and the tier does not claim them, so no router is sent after a block that is not there."""
    engine = make(str(tiny_llama_dir), tmp_path)
    disk = engine.swap.disk

    def full(block_hash, payload):
        raise OSError(28, "No space left on device")

    disk._write = full
    run(engine, HISTORY)
    for k in range(6):
        run(engine, [5000 + 300 * k + i for i in range(15 * BLOCK)])
    disk.flush()
    assert engine.stats().disk_blocks_dropped >= 10  # the history's ten blocks, at least
    assert run(engine, FOLLOW_UP)[1] == 0, "nothing of the history is cached anywhere"
    assert not set(hash_blocks(HISTORY, BLOCK, engine.hash_seed)) & set(disk.hashes())  # nor claimed on disk
    engine.close()


def test_disk_tier_needs_a_host_tier():
    with pytest.raises(ValueError, match="needs a host tier"):
        EngineConfig(disk_cache_dir="/tmp/x", host_cache_bytes=0)
