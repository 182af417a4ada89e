"""KV blocks moved between replicas: the checks on what arrives (pure), and real engines fetching a prefix over
TCP from another engine, in this process and from a ``kvmesh engine`` process, including transfers that are
corrupted, cut, foreign or lost with their holder, which must end in a recompute with the right tokens."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
import pytest
import torch
import xxhash

from kvmesh.bench.harness.peer_fleet import Child
from kvmesh.cluster.launch.embedded_redis import free_port
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.hashing import hash_blocks
from kvmesh.core.messages import KVFetch
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.replica.async_llm import AsyncLLM
from kvmesh.replica.engine import LLMEngine
from kvmesh.replica.kv_peer import KVPeer
from kvmesh.replica.kv_transfer import CHUNK, ENTRY, TransferRejected, check_chunk, encode_chunk, parse_header

FP = bytes(range(32))


def _chain(n: int) -> list[bytes]:
    return hash_blocks(list(range(n * 4)), 4, bytes(16))


def _chunk(hashes, parent=None, rows=None):
    rows = rows if rows is not None else torch.randint(0, 255, (len(hashes), 64), dtype=torch.uint8)
    parents = [parent, *hashes[:-1]]
    head, payload = encode_chunk(FP, hashes, parents, rows)
    return head, torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(len(hashes), 64)


def test_a_chunk_passes_only_as_the_chain_asked_for():
    hashes = _chain(4)
    head, payload = _chunk(hashes)
    status, count, entries = parse_header(head, FP, 64)
    assert (status, count) == (0, 4)
    check_chunk(entries, payload, hashes, None)  # the blocks asked for, in order

    with pytest.raises(TransferRejected) as wrong:  # another prompt's blocks
        check_chunk(entries, payload, _chain(5)[1:], None)
    assert (wrong.value.reason, wrong.value.passed) == ("wrong_chain", 0)
    with pytest.raises(TransferRejected) as orphan:  # right hashes, claimed under another parent
        check_chunk(entries, payload, hashes, hashes[0])
    assert orphan.value.reason == "wrong_chain"

    payload[2, 7] ^= 1  # a flipped bit in block 2: blocks 0 and 1 still pass
    with pytest.raises(TransferRejected) as corrupt:
        check_chunk(entries, payload, hashes, None)
    assert (corrupt.value.reason, corrupt.value.passed) == ("corrupt", 2)


def test_headers_of_another_cache_or_shape_are_refused():
    head, _ = _chunk(_chain(2))
    with pytest.raises(TransferRejected, match="foreign"):
        parse_header(head, bytes(32), 64)
    with pytest.raises(TransferRejected, match="malformed"):
        parse_header(head, FP, 128)  # another block size or layout
    with pytest.raises(TransferRejected, match="malformed"):
        parse_header(head[:10], FP, 64)
    entries = head[CHUNK.size :]
    assert len(entries) == 2 * ENTRY.size
    _, payload = _chunk(_chain(2))
    with pytest.raises(TransferRejected, match="malformed"):  # fewer rows than entries: truncated
        check_chunk(entries, payload[:1], _chain(2), None)


def test_checksums_are_xxh3_of_each_row():
    hashes = _chain(1)
    rows = torch.arange(64, dtype=torch.uint8).view(1, 64)
    head, _ = _chunk(hashes, rows=rows)
    _, _, checksum = ENTRY.unpack_from(head, CHUNK.size)
    assert checksum == xxhash.xxh3_64_intdigest(rows.numpy().tobytes())


# ---------------------------------------------------------------------------------------------- real engines

PROMPT = [(7 * i) % 4000 + 100 for i in range(300)]
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _config(smollm_dir, kv: str = "auto", blocks: int = 96, dtype: str | None = "float32") -> EngineConfig:
    return EngineConfig(model=str(smollm_dir), num_kv_blocks=blocks, dtype=dtype, kv_cache_dtype=kv)


async def _generate(llm: AsyncLLM, ids=PROMPT):
    tokens, out = [], None
    async for out in llm.generate(ids, GREEDY):
        tokens += out.delta_token_ids
    return tokens, out.num_cached_tokens


def _plan(llm: AsyncLLM, address: str, ids=PROMPT) -> tuple[KVFetch, list[bytes]]:
    size = llm.engine.block_size
    return KVFetch(holder="h", address=address, num_blocks=(len(ids) - 1) // size), hash_blocks(
        ids, size, llm.engine.hash_seed
    )


def _block_bytes(llm: AsyncLLM, hashes: list[bytes]) -> torch.Tensor:
    ex = llm.engine.exchange
    return ex.blocks.gather([llm.engine.pool.lookup(h).block_id for h in hashes])


@pytest.fixture(scope="module")
def engines(smollm_dir):
    """A holder and a receiver per KV dtype, each engine made on first use (one model load each) and wrapped
    in a fresh ``AsyncLLM`` per call (each test runs its own event loop)."""
    made: dict[str, tuple[LLMEngine, LLMEngine]] = {}

    def get(kv: str) -> tuple[AsyncLLM, AsyncLLM]:
        if kv not in made:
            made[kv] = (LLMEngine(_config(smollm_dir, kv)), LLMEngine(_config(smollm_dir, kv)))
        return AsyncLLM(made[kv][0]), AsyncLLM(made[kv][1])

    yield get
    for pair in made.values():
        for engine in pair:
            engine.close()


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "int8", "int4"])
def test_a_fetched_prefix_is_the_holders_bytes_and_gives_its_tokens(engines, kv):
    """The receiver adopts exactly the holder's bytes (every per-block tensor: int4's key ranges and scales
    too), publishes them as its own cached prefix, and its greedy tokens equal the holder's from that prefix."""
    holder, receiver = engines(kv)

    async def run():
        await holder.reset_prefix_cache()
        await receiver.reset_prefix_cache()
        hp, rp = KVPeer(holder), KVPeer(receiver)
        await hp.start()
        await _generate(holder)  # computes and caches the prefix
        again, cached = await _generate(holder)  # the holder's tokens from its cached prefix
        plan, hashes = _plan(receiver, hp.address)
        events = []
        receiver.engine.kv_event_sinks.append(events.extend)
        held = await rp.fetch(plan, hashes, token_ids=PROMPT)
        assert held == plan.num_blocks == cached // receiver.engine.block_size
        assert torch.equal(_block_bytes(receiver, hashes[:held]), _block_bytes(holder, hashes[:held]))
        tokens, fetched_cached = await _generate(receiver)
        receiver.engine.kv_event_sinks.remove(events.extend)
        hp.stop()
        return again, tokens, fetched_cached, events, rp.stats, hp.stats

    again, tokens, cached, events, got, served = asyncio.run(run())
    assert tokens == again
    assert cached == (len(PROMPT) - 1) // 16 * 16
    stored = [e.block_hash for e in events if e.kind == "stored" and e.medium == "device"]
    assert stored[:18] == _plan(receiver, "")[1][:18]  # announced as its own, in chain order
    assert got.fetched_blocks == served.served_blocks == 18 and not got.fallbacks


def test_fetched_prefix_gives_the_tokens_of_a_local_prefill(engines):
    """fp32 on the CPU: a request on a fetched prefix yields the greedy tokens of the same prompt computed cold."""
    holder, receiver = engines("auto")

    async def run():
        await holder.reset_prefix_cache()
        await receiver.reset_prefix_cache()
        cold, _ = await _generate(receiver)
        await receiver.reset_prefix_cache()
        hp, rp = KVPeer(holder), KVPeer(receiver)
        await hp.start()
        await _generate(holder)
        await rp.fetch(*_plan(receiver, hp.address), token_ids=PROMPT)
        warm, cached = await _generate(receiver)
        hp.stop()
        return cold, warm, cached

    cold, warm, cached = asyncio.run(run())
    assert cached > 200 and warm == cold


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_blocks_land_whole_whatever_the_path_chunking_or_holes(engines, direct):
    """Hot blocks taken in reverse chain order, the receiver already holding the last five (holes: their bytes
    land in a scratch row and its own stay), from a holder whose chunks are four times the receiver's: every
    other block arrives byte for byte, received straight into the cache (``direct``: a host cache) or staged in
    a buffer (a GPU's). The five it computed itself are compared with its own bytes, not the holder's: a
    prefill of another length may round differently (it does on AVX2-only CPUs)."""
    holder, receiver = engines("auto")
    blocks = receiver.engine.exchange.blocks

    async def run():
        await holder.reset_prefix_cache()
        await receiver.reset_prefix_cache()
        hp = KVPeer(holder, chunk_bytes=4 * blocks.block_bytes)
        rp = KVPeer(receiver, chunk_bytes=blocks.block_bytes)
        await hp.start()
        await _generate(holder)
        await _generate(receiver, PROMPT[:81])  # holds the first five blocks
        hashes = _plan(receiver, "")[1][:18][::-1]
        own = _block_bytes(receiver, hashes[-5:])
        took = await rp.take(hp.address, hashes)
        hp.stop()
        return hashes, own, took, rp.stats

    was, blocks.direct = blocks.direct, direct
    try:
        hashes, own, took, stats = asyncio.run(run())
    finally:
        blocks.direct = was
    assert took == 18 and not stats.fallbacks and stats.fetched_blocks == 18
    fetched = hashes[:-5]
    assert torch.equal(_block_bytes(receiver, fetched), _block_bytes(holder, fetched))
    assert torch.equal(_block_bytes(receiver, hashes[-5:]), own)


class Tamper:
    """A TCP relay between a receiver and a holder that damages what the holder sends: flips the byte at
    ``flip`` or ends the stream after ``cut`` bytes. A stand-in for a faulty network, not for a component."""

    def __init__(self, target: str, flip: int | None = None, cut: int | None = None) -> None:
        self.host, self.port = target.removeprefix("tcp://").split(":")
        self.flip, self.cut = flip, cut

    async def start(self) -> str:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.server = server
        return f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection(self.host, int(self.port))

        async def upstream():
            while data := await reader.read(1 << 16):
                up_writer.write(data)
                await up_writer.drain()

        task = asyncio.create_task(upstream())
        sent = 0
        while data := await up_reader.read(1 << 16):
            data = bytearray(data)
            if self.flip is not None and sent <= self.flip < sent + len(data):
                data[self.flip - sent] ^= 0xFF
            if self.cut is not None and sent + len(data) >= self.cut:
                writer.write(bytes(data[: self.cut - sent]))
                break
            writer.write(bytes(data))
            sent += len(data)
            await writer.drain()
        task.cancel()
        writer.close()
        up_writer.close()


# Offsets in the holder's stream: a length, the chunk header, 18 entries, then the blocks.
FIRST_ENTRY = 4 + CHUNK.size
FIRST_BLOCK = FIRST_ENTRY + 18 * ENTRY.size


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ({"flip": FIRST_BLOCK + 100}, "corrupt"),
        ({"flip": FIRST_ENTRY + 3}, "wrong_chain"),
        ({"cut": FIRST_BLOCK + 1000}, "holder_lost"),
    ],
)
def test_a_damaged_transfer_is_rejected_and_the_request_recomputes(engines, damage, reason):
    holder, receiver = engines("auto")

    async def run():
        await holder.reset_prefix_cache()
        await receiver.reset_prefix_cache()
        hp, rp = KVPeer(holder), KVPeer(receiver)
        await hp.start()
        expected, _ = await _generate(holder)
        relay = Tamper(hp.address, **damage)
        plan, hashes = _plan(receiver, await relay.start())
        held = await rp.fetch(plan, hashes, token_ids=PROMPT)
        tokens, cached = await _generate(receiver)
        hp.stop()
        relay.server.close()
        return expected, held, tokens, cached, rp.stats

    expected, held, tokens, cached, stats = asyncio.run(run())
    assert held == 0 and cached == 0  # nothing adopted from the damaged chunk: all recomputed
    assert tokens == expected
    assert stats.fallbacks == {reason: 1}


def test_a_foreign_model_is_refused(engines, tiny_llama_dir):
    _, receiver = engines("auto")
    other = AsyncLLM.from_config(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, dtype="float32"))

    async def run():
        await receiver.reset_prefix_cache()
        op, rp = KVPeer(other), KVPeer(receiver)
        await op.start()
        await _generate(other)
        held = await rp.fetch(*_plan(receiver, op.address), token_ids=PROMPT)
        op.stop()
        return held, rp.stats

    try:
        held, stats = asyncio.run(run())
    finally:
        other.engine.close()
    assert held == 0 and stats.fallbacks == {"foreign": 1}


def test_an_unreachable_holder_falls_back_at_once(engines):
    _, receiver = engines("auto")

    async def run():
        await receiver.reset_prefix_cache()
        rp = KVPeer(receiver)
        held = await rp.fetch(*_plan(receiver, f"tcp://127.0.0.1:{free_port()}"), token_ids=PROMPT, timeout_s=5)
        tokens, _ = await _generate(receiver)
        return held, rp.stats, tokens

    held, stats, tokens = asyncio.run(run())
    assert held == 0 and stats.fallbacks == {"unreachable": 1} and len(tokens) == GREEDY.max_tokens


LONG = [(11 * i) % 5000 + 50 for i in range(1200)]


@pytest.mark.timeout(600)
def test_holder_process_killed_mid_transfer(smollm_dir, tmp_path):
    """A ``kvmesh engine`` process holds a long prefix and serves it at the address its ``GET /load`` names;
    it is killed once the first chunk is adopted: the fetch keeps what was adopted, counts ``holder_lost``,
    and the request completes by recomputing the rest, with the tokens of a cold run."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", str(smollm_dir)]
    cmd += ["--port", str(port), "--threads", "1", "--num-kv-blocks", "160"]
    env = {k: v for k, v in os.environ.items() if k != "KVMESH_REDIS_URL"}
    holder = Child("kv-holder", cmd, f"http://127.0.0.1:{port}", "/health", env)
    receiver = AsyncLLM.from_config(_config(smollm_dir, blocks=160, dtype=None))  # the holder's default dtype
    try:
        holder.wait_ready()
        body = {"model": str(smollm_dir), "prompt": LONG, "max_tokens": 1, "temperature": 0}
        httpx.post(f"{holder.url}/v1/completions", json=body, timeout=300).raise_for_status()
        address = httpx.get(f"{holder.url}/load", timeout=10).json()["kv_address"]
        assert address.startswith("tcp://127.0.0.1:")

        async def run():
            cold, _ = await _generate(receiver, LONG)
            await receiver.reset_prefix_cache()
            peer = KVPeer(receiver)
            adopt = peer.receiver._adopt

            async def adopt_then_kill(*args):
                held = await adopt(*args)
                if holder.proc.poll() is None:
                    holder.proc.kill()
                    holder.proc.wait()
                return held

            peer.receiver._adopt = adopt_then_kill
            held = await peer.fetch(*_plan(receiver, address, LONG), token_ids=LONG, timeout_s=120)
            warm, cached = await _generate(receiver, LONG)
            return cold, held, warm, cached, peer.stats

        cold, held, warm, cached, stats = asyncio.run(run())
    finally:
        holder.stop()
        receiver.engine.close()
    blocks = (len(LONG) - 1) // 16
    assert 0 < held < blocks, "the first chunk adopted, not the whole prefix"
    assert stats.fallbacks == {"holder_lost": 1}
    assert cached == held * 16 and warm == cold
