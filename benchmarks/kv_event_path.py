"""What vLLM-style KV events cost: encoding on the engine side, decoding into kvmesh hashes on the router side,
and the lag from an engine step to the index answering for its blocks.

    kvmesh bench kv_event_path [--steps 2000] [--lag-steps 200]

Throughput is single-threaded, of the code alone: ``WireEncoder`` + ``encode_batch`` over engine events (one
request's step storing 8 16-token blocks and evicting 8), then ``decode_batch`` + ``WorkerBlocks.apply`` over
the same payloads and over vLLM CPU-shaped ones (128-token blocks, each eight kvmesh blocks). Lag is end to
end on real parts: a kvmesh engine (SmolLM2) publishing on ZMQ, the subscriber and ``WorkerBlocks`` of a
worker proxy, its index publisher, a real Redis; after each engine step that cached a new block, the time
until a lookup of that block's chain answers it (polled every 0.2 ms). Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis
from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.kv_event_wire import (
    EventBatch,
    KVEventsConfig,
    RemovedBlocks,
    StoredBlocks,
    decode_batch,
    encode_batch,
)
from kvmesh.replica.kv_event_publisher import WireEncoder, ZmqKVEventPublisher
from kvmesh.replica.kv_events import BlockRemoved, BlockStored
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.kv_event_subscriber import KVEventSubscriber
from kvmesh.router.prefix_index import PrefixIndex
from kvmesh.router.worker_blocks import WorkerBlocks


def engine_steps(n: int, blocks: int = 8, size: int = 16) -> list[list]:
    """``n`` steps, each one request caching ``blocks`` chained blocks and the oldest request's blocks leaving."""
    seed, steps, chains = model_seed("bench"), [], []
    for i in range(n):
        tokens = list(range(i * 1000, i * 1000 + blocks * size))
        chain = hash_blocks(tokens, size, seed)
        events = [
            BlockStored(h, chain[j - 1] if j else None, token_ids=tokens[j * size : (j + 1) * size])
            for j, h in enumerate(chain)
        ]
        chains.append(chain)
        if len(chains) > 64:
            events += [BlockRemoved(h) for h in reversed(chains.pop(0))]
        steps.append(events)
    return steps


def vllm_payloads(n: int) -> list[bytes]:
    """vLLM CPU-shaped batches: one 2-block (128 tokens each) store per step, a 2-block removal once warm."""
    out, stored = [], []
    for i in range(n):
        hashes = [2 * i + 1, 2 * i + 2]
        events = [StoredBlocks(block_hashes=hashes, parent_block_hash=None, token_ids=list(range(256)), block_size=128)]
        stored.append(hashes)
        if len(stored) > 64:
            events.append(RemovedBlocks(block_hashes=stored.pop(0)))
        out.append(encode_batch(EventBatch(time.time(), events)))
    return out


def throughput(steps: int) -> dict:
    work = engine_steps(steps)
    blocks = sum(1 for step in work for e in step if e.kind == "stored")
    encoder = WireEncoder(16)
    t0 = time.perf_counter()
    payloads = [encode_batch(EventBatch(0.0, encoder.encode(step))) for step in work]
    encode_s = time.perf_counter() - t0
    consumer = WorkerBlocks(model_seed("bench"), 16)
    t0 = time.perf_counter()
    for p in payloads:
        consumer.apply(decode_batch(p))
    ingest_s = time.perf_counter() - t0
    vllm = vllm_payloads(steps)
    consumer = WorkerBlocks(model_seed("bench"), 16)
    t0 = time.perf_counter()
    for p in vllm:
        consumer.apply(decode_batch(p))
    vllm_s = time.perf_counter() - t0
    return {
        "encode_blocks_per_s": blocks / encode_s,
        "ingest_blocks_per_s": blocks / ingest_s,
        "ingest_vllm_blocks_per_s": 2 * steps / vllm_s,
        "payload_bytes_per_block": sum(map(len, payloads)) / blocks,
    }


def lag(steps: int, tmp: Path) -> dict:
    from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="smollm2-135m", num_kv_blocks=512, torch_threads=1))
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp}/p", replay_endpoint=f"ipc://{tmp}/r")
    pub = ZmqKVEventPublisher(config, engine.block_size)
    engine.kv_event_sinks.append(pub.publish)
    with EmbeddedRedis() as redis:
        blocks = WorkerBlocks(model_seed("smollm2-135m"), 16)
        index_pub = KVIndexPublisher(redis.url, "lag", "smollm2-135m", "w", blocks.snapshot).start()

        def on_batch(batch: EventBatch) -> None:
            index_pub.publish(blocks.apply(batch))

        sub = KVEventSubscriber(config.endpoint, config.replay_endpoint, on_batch, blocks.clear).start()
        assert index_pub.wait_synced(10)
        lags = asyncio.run(_measure(engine, redis.url, index_pub.replica_id, steps, SamplingParams))
        sub.close()
        index_pub.close()
    pub.close()
    lags.sort()
    return {"lag_p50_ms": 1000 * lags[len(lags) // 2], "lag_p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))]}


async def _measure(engine, url: str, replica: str, steps: int, sampling) -> list[float]:
    index = PrefixIndex(url, "lag", "smollm2-135m", timeout_s=1.0)
    lags = []
    try:
        for i in range(steps):
            tokens = [1000 + 7 * i + k for k in range(16)]
            engine.add_request(tokens, sampling(max_tokens=1, temperature=0))
            while engine.has_unfinished:
                engine.step()
            done = time.perf_counter()
            chain = hash_blocks(tokens, 16, model_seed("smollm2-135m"))
            while (await index.lookup(chain, [replica])).get(replica, 0) < 1:
                await asyncio.sleep(0.0002)
            lags.append(time.perf_counter() - done)
    finally:
        await index.close()
    return lags


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench kv_event_path", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lag-steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    runs = [throughput(args.steps) for _ in range(args.repeats)]
    result = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    with tempfile.TemporaryDirectory(prefix="kv-lag-") as tmp:
        result |= lag(args.lag_steps, Path(tmp))
    print_table(
        ["encode blocks/s", "ingest blocks/s", "ingest vLLM blocks/s", "bytes/block", "lag p50 ms", "lag p99 ms"],
        [
            [
                result["encode_blocks_per_s"],
                result["ingest_blocks_per_s"],
                result["ingest_vllm_blocks_per_s"],
                result["payload_bytes_per_block"],
                result["lag_p50_ms"],
                result["lag_p99_ms"],
            ]
        ],
    )
    write_json("kv_event_path", {"args": {k: str(v) for k, v in vars(args).items()}, **result}, args.json)


if __name__ == "__main__":
    main()
