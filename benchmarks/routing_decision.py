"""Routing decision latency of the KV-aware Ray Serve router, and block-hashing throughput.

Decision latency: ``KVAwareRequestRouter.choose_replicas`` and the ``on_request_routed`` hook Ray calls
after it (our code, not Ray's retry loop), for 8k-token prompts (512 blocks of 16), alternately one the
replicas hold and a new one, over ``--replicas`` candidate replicas (16), index lookup included (a real
loopback redis-server, one publisher per replica, each held prompt's chain held by one replica in full and
half by another),
hashing excluded (the ingress hashes once). Replicas are stand-ins carrying only what the router reads
(replica id, load report). Before timing, ``--fill-prompts`` new prompts fill the router's bounded memory
of recent decisions, as traffic does on a router that has run a while. Hashing:
``kvmesh.core.hashing.hash_blocks`` on 8k-token prompts, one process.

    kvmesh bench routing_decision [--decisions 2000] [--replicas 256]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis
from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.messages import GenerateCall
from kvmesh.router.index_publisher import KVIndexPublisher
from kvmesh.router.serve_router import KVAwareRequestRouter

MODEL, DEPLOYMENT, TOKENS = "bench-model", "bench", 8192


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


def publishers(url: str, chains: list[list[bytes]], count: int) -> list[KVIndexPublisher]:
    """``count`` replicas' publishers, synced: each chain held in full by one replica and half by the next."""
    caches = [[] for _ in range(count)]
    for c, chain in enumerate(chains):
        caches[c % count] += chain
        caches[(c + 1) % count] += chain[: len(chain) // 2]
    pubs = []
    for i in range(count):
        pub = KVIndexPublisher(url, DEPLOYMENT, MODEL, f"replica{i}", caches[i].copy, unique_name=True)
        pubs.append(pub.start())
    for p in pubs:
        assert p.wait_synced(30)
    return pubs


def stand_ins(pubs: list[KVIndexPublisher], dep: DeploymentID, rng: random.Random) -> list[StandInReplica]:
    """A stand-in per publisher, with a random load report."""
    now = time.time()
    return [
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


def time_lookups(router: KVAwareRequestRouter) -> list[float]:
    """The seconds of every index lookup the router makes from now on, appended as they end."""
    lookup: list[float] = []
    timed = router.index.query

    async def lookup_timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return await timed(*args, **kwargs)
        finally:
            lookup.append(time.perf_counter() - t)

    router.index.query = lookup_timed
    return lookup


async def decisions(url: str, n: int, fill_prompts: int, count: int) -> dict:
    """Time ``n`` decisions over ``count`` replicas after ``fill_prompts`` new prompts filled the memory."""
    rng = random.Random(0)
    seed = model_seed(MODEL)
    prompts = [[rng.randrange(50_000) for _ in range(TOKENS)] for _ in range(32)]
    chains = [hash_blocks(p, 16, seed) for p in prompts]
    pubs = publishers(url, chains, count)
    dep = DeploymentID(name="engine", app_name="bench")
    router = KVAwareRequestRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=url, deployment=DEPLOYMENT, model=MODEL, lookup_timeout_s=1.0)
    replicas = stand_ins(pubs, dep, rng)
    bodies = [
        GenerateCall(request_id=f"b{i}", prompt_token_ids=[0] * TOKENS, block_hashes=ch, block_size=16)
        for i, ch in enumerate(chains)
    ]
    lookup = time_lookups(router)
    for i in range(50):  # warm up the connection pool and script cache
        await router.choose_replicas(replicas, pending(bodies[i % len(bodies)], i))

    def fresh(i: int) -> GenerateCall:
        tokens = [rng.randrange(50_000) for _ in range(TOKENS)]
        hashes = hash_blocks(tokens, 16, seed)
        return GenerateCall(request_id=f"f{i}", prompt_token_ids=tokens, block_hashes=hashes, block_size=16)

    async def route(body: GenerateCall, i: int) -> None:
        """One decision and Ray's routed hook (the policy's bookkeeping runs there), then its completion."""
        call = pending(body, i)
        ranked = await router.choose_replicas(replicas, call)
        assert ranked and sum(len(group) for group in ranked) == count
        router.on_request_routed(call, ranked[0][0].replica_id, None)
        router.on_request_completed(ranked[0][0].replica_id, f"r{i}")

    for i in range(fill_prompts):  # a long-running router's memory of recent decisions is full: fill it
        await route(fresh(i), n + i)
    plan = [bodies[i % len(bodies)] if i % 2 == 0 else fresh(n + fill_prompts + i) for i in range(n)]
    lat = []
    lookup.clear()
    for i, body in enumerate(plan):  # half held prompts, half new ones (512 new blocks to remember)
        t0 = time.perf_counter()
        await route(body, i)
        lat.append(time.perf_counter() - t0)
    assert not router.decisions.get("router_error"), "the router failed: these timings would be its fallback's"
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench routing_decision", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument(
        "--fill-prompts",
        type=int,
        default=160,
        help="fresh 8k-token prompts routed before timing, so the router's bounded memory is full (0: empty)",
    )
    ap.add_argument("--replicas", type=int, default=16, help="candidate replicas priced per decision")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with EmbeddedRedis() as server:
        d = asyncio.run(decisions(server.url, args.decisions, args.fill_prompts, args.replicas))
    rate = hashing_rate()
    print_table(
        ["measure", "value", "goal"],
        [
            [f"decision p50 ms (512 blocks, {args.replicas} replicas)", d["p50_ms"], ""],
            ["decision p99 ms", d["p99_ms"], "<= 3 ms"],
            ["of which index lookup p50 ms", d["lookup_p50_ms"], ""],
            ["block hashing, M tokens/s", rate / 1e6, ">= 10"],
        ],
    )
    print("decisions by reason:", d["reasons"])
    payload = {**d, "hash_tokens_per_s": rate, "prompt_tokens": TOKENS, "replicas": args.replicas}
    write_json("routing_decision", {**payload, "fill_prompts": args.fill_prompts}, args.json)


if __name__ == "__main__":
    main()
