"""Routing decision latency of the KV-aware Ray Serve router, and block-hashing throughput.

Decision latency: ``KVAwareRequestRouter.choose_replicas`` itself (our code, not Ray's retry loop) for
8k-token prompts (512 blocks of 16) over 16 candidate replicas, index lookup included (a real loopback
redis-server, 16 publishers, each prompt's chain held by one replica in full and half by another),
hashing excluded (the ingress hashes once). Replicas are stand-ins carrying only what the router reads
(replica id, load report). Hashing: ``kvmesh.shared.hashing.hash_blocks`` on 8k-token prompts, one process.

    python -m benchmarks.routing_decision [--decisions 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from kvmesh.bench.report import print_table, write_json
from kvmesh.cluster.embedded_redis import EmbeddedRedis
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.serve_router import KVAwareRequestRouter
from kvmesh.shared.hashing import hash_blocks, model_seed
from kvmesh.shared.messages import GenerateCall

MODEL, DEPLOYMENT, REPLICAS, TOKENS = "bench-model", "bench", 16, 8192


@dataclass
class StandInReplica:
    replica_id: ReplicaID
    routing_stats: dict


def pending(body: GenerateCall, i: int) -> SimpleNamespace:
    return SimpleNamespace(
        args=[body],
        kwargs={},
        metadata=SimpleNamespace(internal_request_id=f"r{i}", session_id=None),
        routing_context=SimpleNamespace(should_backoff=False),
    )


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def decisions(url: str, n: int) -> dict:
    rng = random.Random(0)
    seed = model_seed(MODEL)
    prompts = [[rng.randrange(50_000) for _ in range(TOKENS)] for _ in range(32)]
    chains = [hash_blocks(p, 16, seed) for p in prompts]
    caches = [[] for _ in range(REPLICAS)]
    for c, chain in enumerate(chains):
        caches[c % REPLICAS] += chain
        caches[(c + 1) % REPLICAS] += chain[: len(chain) // 2]
    pubs = []
    for i in range(REPLICAS):
        pub = KVIndexPublisher(url, DEPLOYMENT, MODEL, f"replica{i}", caches[i].copy, unique_name=True)
        pubs.append(pub.start())
    for p in pubs:
        assert p.wait_synced(30)
    dep = DeploymentID(name="engine", app_name="bench")
    router = KVAwareRequestRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=url, deployment=DEPLOYMENT, model=MODEL, lookup_timeout_s=1.0)
    now = time.time()
    replicas = [
        StandInReplica(
            ReplicaID(p.replica_id, dep),
            {
                "index_id": p.replica_id,
                "num_running": rng.randrange(8),
                "pending_prefill_tokens": rng.randrange(4000),
                "prefill_tok_s": 5000.0,
                "decode_s_per_seq": 0.002,
                "reported_at": now,
            },
        )
        for p in pubs
    ]
    bodies = [
        GenerateCall(request_id=f"b{i}", prompt_token_ids=[0] * TOKENS, block_hashes=ch, block_size=16)
        for i, ch in enumerate(chains)
    ]
    lookup: list[float] = []
    timed = router.index.query

    async def lookup_timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return await timed(*args, **kwargs)
        finally:
            lookup.append(time.perf_counter() - t)

    router.index.query = lookup_timed
    for i in range(50):  # warm up the connection pool and script cache
        await router.choose_replicas(replicas, pending(bodies[i % len(bodies)], i))
    lat = []
    lookup.clear()
    for i in range(n):
        t0 = time.perf_counter()
        ranked = await router.choose_replicas(replicas, pending(bodies[i % len(bodies)], i))
        lat.append(time.perf_counter() - t0)
        assert len(ranked) == REPLICAS
        router.on_request_completed(ranked[0][0].replica_id, f"r{i}")
    await router.index.close()
    for p in pubs:
        p.close(remove_entries=False)
    return {
        "decisions": n,
        "p50_ms": 1e3 * percentile(lat, 0.5),
        "p99_ms": 1e3 * percentile(lat, 0.99),
        "lookup_p50_ms": 1e3 * percentile(lookup, 0.5),
        "reasons": dict(router.decisions),
    }


def hashing_rate(repeats: int = 200) -> float:
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(TOKENS)]
    seed = model_seed(MODEL)
    t0 = time.perf_counter()
    for _ in range(repeats):
        hash_blocks(tokens, 16, seed)
    return repeats * TOKENS / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decisions", type=int, default=2000)
    args = ap.parse_args()
    with EmbeddedRedis() as server:
        d = asyncio.run(decisions(server.url, args.decisions))
    rate = hashing_rate()
    print_table(
        ["measure", "value", "goal"],
        [
            ["decision p50 ms (512 blocks, 16 replicas)", d["p50_ms"], ""],
            ["decision p99 ms", d["p99_ms"], "<= 3 ms"],
            ["of which index lookup p50 ms", d["lookup_p50_ms"], ""],
            ["block hashing, M tokens/s", rate / 1e6, ">= 10"],
        ],
    )
    print("decisions by reason:", d["reasons"])
    write_json("routing_decision", {**d, "hash_tokens_per_s": rate, "prompt_tokens": TOKENS, "replicas": REPLICAS})


if __name__ == "__main__":
    main()
