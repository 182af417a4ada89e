"""The Redis prefix index on a loopback embedded redis-server: ingest, lookup latency, throughput, memory.

For 16 and 64 replicas, 1,000,000 (block, replica) entries are ingested through the publisher's own
script, in batches of 1,000 events (a busy engine step's worth), from one process: that rate is the event
ingest figure. Lookups then walk chains of 128 and 512 blocks over all replicas as candidates, each chain
held in full by one replica and by half by another (the script walks the whole chain: the worst case).
Latency is one lookup at a time through the async client; throughput keeps 32 lookups in flight.
Memory is Redis' ``used_memory`` growth divided by the entries ingested.

    kvmesh bench index_redis [--entries 1000000] [--lookups 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import redis

from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.index_schema import index_prefix, script_source
from kvmesh.router.prefix_index import PrefixIndex

MODEL = "bench-model"
BATCH = 1000


def random_hashes(n: int) -> list[bytes]:
    data = os.urandom(16 * n)
    return [data[i : i + 16] for i in range(0, 16 * n, 16)]


def populate(url: str, deployment: str, replicas: int, entries: int, chains: list[list[bytes]]) -> dict:
    """Register ``replicas`` publishers and ingest ``entries`` entries; returns the ingest rate."""
    client = redis.Redis.from_url(url)
    publish = client.register_script(script_source("publish"))
    pubs = [
        KVIndexPublisher(url, deployment, MODEL, f"r{i}", list, heartbeat_ttl_s=600).start() for i in range(replicas)
    ]
    for p in pubs:
        assert p.wait_synced(10)
    prefix = index_prefix(deployment, MODEL)
    # The lookup chains: chain c is held fully by replica c % R and half by replica (c + 1) % R.
    per_replica: list[list[bytes]] = [[] for _ in range(replicas)]
    for c, chain in enumerate(chains):
        per_replica[c % replicas] += chain
        per_replica[(c + 1) % replicas] += chain[: len(chain) // 2]
    used = sum(map(len, per_replica))
    filler = random_hashes(max(0, entries - used))
    for i, h in enumerate(filler):
        per_replica[i % replicas].append(h)
    mem_before = client.info("memory")["used_memory"]
    t0 = time.perf_counter()
    total = 0
    for p, hashes in zip(pubs, per_replica, strict=True):
        for s in range(0, len(hashes), BATCH):
            ops = b"".join(b"+" + h[:8] for h in hashes[s : s + BATCH])
            assert publish(args=[prefix, p.replica_id, p.slot, ops]) == 1
            total += len(ops) // 9
    dt = time.perf_counter() - t0
    mem = client.info("memory")["used_memory"] - mem_before
    client.close()
    return {"publishers": pubs, "entries": total, "ingest_events_per_s": total / dt, "bytes_per_entry": mem / total}


async def measure_lookups(url, deployment, ids, chains, n: int, concurrency: int) -> dict:
    index = PrefixIndex(url, deployment, MODEL, timeout_s=1.0)
    for chain in chains[:20]:  # warm up connection and script cache
        await index.lookup(chain, ids)
    lat = []
    for i in range(n):
        chain = chains[i % len(chains)]
        t0 = time.perf_counter()
        got = await index.lookup(chain, ids)
        lat.append(time.perf_counter() - t0)
        assert got is not None and max(got.values()) == len(chain)
    lat.sort()

    async def worker(k: int) -> None:
        for i in range(k, n, concurrency):
            await index.lookup(chains[i % len(chains)], ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    rate = n / (time.perf_counter() - t0)
    await index.close()
    return {"p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(0.99 * len(lat))], "lookups_per_s": rate}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench index_redis", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--lookups", type=int, default=2000)
    args = ap.parse_args(argv)
    rows, results = [], []
    with EmbeddedRedis() as server:
        for replicas in (16, 64):
            deployment = f"bench-{replicas}"
            chains = {n: [random_hashes(n) for _ in range(64)] for n in (128, 512)}
            pop = populate(server.url, deployment, replicas, args.entries, chains[128] + chains[512])
            ids = [p.replica_id for p in pop["publishers"]]
            for length in (128, 512):
                m = asyncio.run(measure_lookups(server.url, deployment, ids, chains[length], args.lookups, 32))
                row = {"replicas": replicas, "chain_blocks": length, **m}
                row.update({k: pop[k] for k in ("entries", "ingest_events_per_s", "bytes_per_entry")})
                results.append(row)
                rows.append(
                    [
                        replicas,
                        length,
                        m["p50_ms"],
                        m["p99_ms"],
                        m["lookups_per_s"],
                        pop["ingest_events_per_s"],
                        pop["bytes_per_entry"],
                    ]
                )
            for p in pop["publishers"]:
                p.close(remove_entries=False)
            redis.Redis.from_url(server.url).flushall()
    print_table(
        ["replicas", "chain", "p50 ms", "p99 ms", "lookups/s (32 in flight)", "ingest events/s", "bytes/entry"], rows
    )
    print("goals: p99 <= 2 ms at 512 blocks; >= 5,000 lookups/s; >= 200,000 events/s; <= 120 bytes/entry")
    write_json("index_redis", {"entries": args.entries, "results": results})


if __name__ == "__main__":
    main()
