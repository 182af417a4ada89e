"""A conversation whose home replica is busy: its next turn's TTFT when the router may have another replica
fetch the history (peer fetch) against when it may not (queue at the home or recompute elsewhere), on a real
Ray Serve fleet.

    kvmesh bench busy_home [--pairs 3] [--history-tokens 4000] [--json OUT.json]

A local Ray session, a real Redis index, two SmolLM2 engine replicas (one torch thread each, 4 sequences a
batch) behind the KV-aware router on the engine handle. Per pair, each setting in turn (the order alternates
from pair to pair), on a fresh deployment: a conversation's history (``--history-tokens`` fresh token ids) is
computed on one replica (its home); four long generations continuing it fill the home's batch; then the
next turn (the history and 32 new tokens, 8 out) arrives. Settings: ``fetch`` (the router's default) and
``no_fetch`` (``peer_fetch=False``). Measured: the turn's TTFT, where it ran, its cached tokens. Per pair,
fetch over no_fetch. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import random
import time
from pathlib import Path

from kvmesh.bench.harness.report import print_table, spread, spread_text, write_json
from kvmesh.bench.harness.serve_fleet import MODEL, app_name, run_pairs, stream
from kvmesh.cluster.engines.engine_deployment import engine_deployment
from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.core.engine_config import EngineConfig

SETTINGS = ("fetch", "no_fetch")
BUSY_STREAMS = 4
BUSY_TOKENS = 4000
"""Output tokens of each generation that keeps the home busy (cancelled once the turn is answered)."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvmesh bench busy_home", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--history-tokens", type=int, default=4000)
    ap.add_argument("--json", type=Path, default=None)
    return ap


async def turn_on_busy_home(handle, history: list[int], rng: random.Random) -> dict:
    """The history computed, the home filled with long generations on it, then the next turn."""
    fresh = lambda n: [rng.randrange(100, 40_000) for _ in range(n)]  # noqa: E731
    first = await stream(handle, history, 1)
    await asyncio.sleep(1.0)  # the history's KV events reach the index
    busy, where = [], []  # generations on the history, and where each runs (known at its first token)
    for _ in range(BUSY_STREAMS):  # one at a time, each routed once the one before decodes
        busy.append(asyncio.ensure_future(stream(handle, history + fresh(8), BUSY_TOKENS, on_first=where.append)))
        while len(where) < len(busy) and not busy[-1].done():
            await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    try:
        turn = await stream(handle, history + fresh(32), 8)
    finally:
        for task in busy:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*busy, return_exceptions=True)
    return {
        "ttft_s": turn["ttft_s"],
        "cached": turn["cached"],
        "moved": turn["replica"] != first["replica"],
        "home": first["replica"],
        "replica": turn["replica"],
        "busy_at_home": sum(r == first["replica"] for r in where),
    }


def run_setting(serve, redis_url: str, setting: str, seed: int, args: argparse.Namespace) -> dict:
    engine = EngineConfig(model=MODEL, num_kv_blocks=2048, torch_threads=1, max_num_seqs=BUSY_STREAMS)
    kwargs = {} if setting == "fetch" else {"peer_fetch": False}
    name = app_name("busy-home", setting, seed)
    routing = RoutingSettings(
        redis_url=redis_url, deployment=f"bh-{setting}-{seed}", stats_period_s=0.5, policy_kwargs=kwargs
    )
    app = engine_deployment(engine, routing, num_replicas=2, replicas_per_node=2)
    handle = serve.run(app, name=name, route_prefix=None).options(method_name="generate", stream=True)
    try:
        time.sleep(2.0)  # load reports (KV addresses, rates) reach the router
        rng = random.Random(seed)
        history = [rng.randrange(100, 40_000) for _ in range(args.history_tokens)]
        return asyncio.run(turn_on_busy_home(handle, history, rng))
    finally:
        serve.delete(name)


def run(args: argparse.Namespace) -> list[dict]:
    def describe(m: dict) -> str:
        where = "moved" if m["moved"] else "at home"
        ttft = f"{m['ttft_s'] * 1000:.0f} ms"
        return f"TTFT {ttft}, {where}, {m['cached']} cached; {m['busy_at_home']} of {BUSY_STREAMS} busy streams at home"

    return run_pairs(SETTINGS, args.pairs, 3000, functools.partial(run_setting, args=args), describe)


def report(args: argparse.Namespace, pairs: list[dict]) -> None:
    ratios = [p["fetch"]["ttft_s"] / p["no_fetch"]["ttft_s"] for p in pairs]
    rows = [
        [s, " ".join(f"{p[s]['ttft_s'] * 1000:.0f}" for p in pairs), " ".join(str(p[s]["cached"]) for p in pairs)]
        for s in SETTINGS
    ]
    print_table(["setting", "turn TTFT ms (per pair)", "cached tokens (per pair)"], rows)
    print(f"\nTTFT fetch / no_fetch, per pair: {spread_text(ratios)}")
    summary = {"ttft_fetch_over_no_fetch": spread(ratios)}
    write_json("busy_home", {"args": vars(args) | {"json": None}, "pairs": pairs, "summary": summary}, args.json)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    report(args, run(args))


if __name__ == "__main__":
    main()
