"""Scaling that keeps the fleet's KV against scaling that drops it, on a real Ray Serve fleet.

    kvmesh bench kv_scaling [--pairs 3] [--prefixes 8] [--prefix-tokens 512] [--requests 50] [--json OUT.json]

A local Ray session, a real Redis index, SmolLM2 engine replicas (one torch thread each) behind the KV-aware
router on the engine handle, as ``kvmesh serve`` deploys them. Per pair, each setting in turn (the order
alternates from pair to pair): ``keep_kv`` on (a starting replica pulls its peers' hottest blocks before it
serves; a removed one hands its own to the survivors) and off (``--no-keep-kv``). For each: 2 replicas serve
each of ``--prefixes`` shared prefixes (system prompts, documents) twice; the fleet is scaled to 3 ("up") and
``--requests`` requests follow, each a random prefix with a fresh question, ``--concurrency`` at a time; then
back to 2 ("down") and as many again. After each change: the hit rate (cached prompt tokens over prompt tokens)
of those requests, of the ones served by replicas that started with the change, and TTFT p50. Per pair the
on/off ratio of each. Serve may replace every replica on a redeploy (it does so when the deployment's code
version changes): the JSON records how many replicas were new after each change. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import time
from pathlib import Path

from kvmesh.bench.harness.report import print_table, spread, spread_text, write_json
from kvmesh.bench.harness.serve_fleet import MODEL, app_name, run_pairs, stream
from kvmesh.cluster.engines.engine_deployment import engine_deployment
from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.core.engine_config import EngineConfig

QUESTION_TOKENS = 32
SETTINGS = ("keep", "drop")
"""``keep_kv`` on and off."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvmesh bench kv_scaling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--requests", type=int, default=50, help="requests measured after each change")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=1024, help="each replica's pool")
    ap.add_argument("--json", type=Path, default=None)
    return ap


async def burst(handle, prompts: list[list[int]], concurrency: int) -> list[dict]:
    """``prompts`` in order, ``concurrency`` in flight at a time (closed loop)."""
    queue, out = list(enumerate(prompts)), [None] * len(prompts)

    async def worker():
        while queue:
            i, tokens = queue.pop(0)
            row = await stream(handle, tokens, 4)
            out[i] = {k: row[k] for k in ("ttft_s", "prompt", "cached", "replica")}

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def measure(rows: list[dict], before: set[str]) -> dict:
    """Hit rates (all requests, and those served by replicas new since ``before``) and TTFT p50."""
    new = [r for r in rows if r["replica"] not in before]
    rate = lambda rs: sum(r["cached"] for r in rs) / max(sum(r["prompt"] for r in rs), 1)  # noqa: E731
    return {
        "hit_rate": rate(rows),
        "new_replica_requests": len(new),
        "new_replica_hit_rate": rate(new) if new else None,
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in rows),
        "replicas": sorted({r["replica"] for r in rows}),
    }


def run_setting(serve, redis_url: str, setting: str, seed: int, args: argparse.Namespace) -> dict:
    """One setting's deploy, warm-up traffic, scale-up and scale-down, measured after each change."""
    rng, name = random.Random(seed), app_name("kv-scaling", setting, seed)
    prefixes = [[rng.randrange(100, 40_000) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]

    def requests() -> list[list[int]]:
        return [
            rng.choice(prefixes) + [rng.randrange(100, 40_000) for _ in range(QUESTION_TOKENS)]
            for _ in range(args.requests)
        ]

    engine = EngineConfig(model=MODEL, num_kv_blocks=args.kv_blocks, torch_threads=1, max_num_seqs=4)
    routing = RoutingSettings(redis_url=redis_url, deployment=f"kvs-{setting}-{seed}", stats_period_s=0.5)

    def deploy(n: int):
        app = engine_deployment(engine, routing, num_replicas=n, replicas_per_node=3, keep_kv=setting == "keep")
        handle = serve.run(app, name=name, route_prefix=None).options(method_name="generate", stream=True)
        time.sleep(1.5)  # load reports (KV addresses, rates) and the replaced replicas' exits reach the router
        return handle

    out = {}
    try:
        handle = deploy(2)
        warm = asyncio.run(burst(handle, [p + [rng.randrange(100, 40_000)] * 8 for p in prefixes * 2], 2))
        seen = {r["replica"] for r in warm}
        for step, n in (("up", 3), ("down", 2)):
            began = time.perf_counter()
            handle = deploy(n)
            deploy_s = time.perf_counter() - began
            rows = asyncio.run(burst(handle, requests(), args.concurrency))
            out[step] = {**measure(rows, seen), "deploy_s": deploy_s}
            seen |= {r["replica"] for r in rows}
    finally:
        serve.delete(name)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    def describe(m: dict) -> str:
        return "hit rate " + ", ".join(f"{step} {m[step]['hit_rate']:.1%}" for step in ("up", "down"))

    return run_pairs(SETTINGS, args.pairs, 1000, functools.partial(run_setting, args=args), describe)


def report(args: argparse.Namespace, pairs: list[dict]) -> None:
    table, summary = [], {}
    for step in ("up", "down"):
        for key in ("hit_rate", "new_replica_hit_rate", "ttft_p50_s"):
            values = {s: [p[s][step][key] for p in pairs] for s in SETTINGS}
            ratios = [k / d for k, d in zip(values["keep"], values["drop"], strict=True) if k is not None and d]
            summary[f"{step}.{key}"] = {
                **{s: values[s] for s in SETTINGS},
                "keep_over_drop": spread(ratios) if ratios else None,
            }
            fmt = (lambda v: f"{v:.1%}") if "rate" in key else (lambda v: f"{v * 1000:.0f} ms")
            cells = [" ".join(fmt(v) if v is not None else "-" for v in values[s]) for s in SETTINGS]
            table.append([step, key, *cells, spread_text(ratios)])
    print_table(["change", "measure", "keep_kv (per pair)", "--no-keep-kv (per pair)", "keep/drop median"], table)
    write_json("kv_scaling", {"args": vars(args) | {"json": None}, "pairs": pairs, "summary": summary}, args.json)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    report(args, run(args))


if __name__ == "__main__":
    main()
