"""Decoding streams' inter-token latency while long prompts arrive: conditional disaggregation with a
dedicated prefill replica against every replica prefilling and decoding (colocated), on a real Ray Serve
fleet.

    kvmesh bench disaggregation [--pairs 3] [--seconds 40] [--long-tokens 1280] [--long-every-s 8] [--json OUT.json]

A local Ray session, a real Redis index, two SmolLM2 engine replicas (one torch thread each, so each has a
core of this 2-core machine) behind the KV-aware router on the engine handle. Open loop, for ``--seconds``:
a decoding stream (a short fresh prompt, ``--stream-tokens`` out) starts every ``--stream-every-s`` seconds
and a long fresh prompt (``--long-tokens``, 16 out) every ``--long-every-s``, so both settings are offered
the same work (the output rate shows whether they kept up with it). Settings, in an order that alternates
from pair to pair: ``split`` (``--prefill-replicas 1``: one replica only prefills, the other fetches and
decodes) and ``colocated`` (no prefill replica, disaggregation off: each long prompt is prefilled where it
is decoded, in chunks between the streams' steps). Per setting: the streams' inter-token p50/p99/p99.9 (each
chunk's gap spread over its tokens), the long prompts' TTFT p50, and output tokens per second of everything
served. Per pair, split over colocated. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import random
import time
from pathlib import Path

import numpy as np

from kvmesh.bench.harness.report import median, print_table, spread, spread_text, write_json
from kvmesh.bench.harness.serve_fleet import MODEL, app_name, run_pairs, stream
from kvmesh.cluster.engines.engine_deployment import engine_deployment
from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.core.engine_config import EngineConfig

SETTINGS = ("split", "colocated")
LONG_OUTPUT = 16
STREAM_PROMPT = 64


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvmesh bench disaggregation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--stream-every-s", type=float, default=1.6, help="a new decoding stream this often")
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=1280)
    ap.add_argument("--long-every-s", type=float, default=8.0)
    ap.add_argument("--json", type=Path, default=None)
    return ap


async def drive(handle, args: argparse.Namespace, rng: random.Random) -> dict:
    """The streams and the long prompts for ``args.seconds``; what each request saw, and the elapsed time."""
    fresh = lambda n: [rng.randrange(100, 40_000) for _ in range(n)]  # noqa: E731
    stop_at = time.perf_counter() + args.seconds

    async def arrivals(every_s: float, delay_s: float, tokens: int, max_tokens: int) -> list[dict]:
        sent = []
        await asyncio.sleep(min(delay_s, args.seconds))
        while time.perf_counter() < stop_at:
            sent.append(asyncio.ensure_future(stream(handle, fresh(tokens), max_tokens)))
            await asyncio.sleep(every_s)
        return list(await asyncio.gather(*sent))

    began = time.perf_counter()
    streams, longs = await asyncio.gather(
        arrivals(args.stream_every_s, 0.0, STREAM_PROMPT, args.stream_tokens),
        arrivals(args.long_every_s, args.long_every_s / 2, args.long_tokens, LONG_OUTPUT),
    )
    return {"streams": streams, "longs": longs, "elapsed_s": time.perf_counter() - began}


def measure(seen: dict) -> dict:
    """Inter-token p50/p99 of the streams, the long prompts' TTFT p50 and output tokens per second."""
    gaps, weights = [], []
    for row in seen["streams"]:
        times = [t for t, _ in row["arrivals"]]
        for (t0, t1), (_, n) in zip(itertools.pairwise(times), row["arrivals"][1:], strict=True):
            gaps.append((t1 - t0) / n)
            weights.append(n)
    per_token = np.repeat(np.array(gaps), np.array(weights))
    tokens = sum(n for row in seen["streams"] + seen["longs"] for _, n in row["arrivals"])
    return {
        "itl_p50_s": float(np.percentile(per_token, 50)),
        "itl_p99_s": float(np.percentile(per_token, 99)),
        "itl_p999_s": float(np.percentile(per_token, 99.9)),
        "long_ttft_p50_s": median([r["ttft_s"] for r in seen["longs"]]) if seen["longs"] else float("nan"),
        "output_tok_s": tokens / seen["elapsed_s"],
        "streams": len(seen["streams"]),
        "long_prompts": len(seen["longs"]),
        "long_replicas": sorted({r["replica"] for r in seen["longs"]}),
        "stream_replicas": sorted({r["replica"] for r in seen["streams"]}),
    }


def run_setting(serve, redis_url: str, setting: str, seed: int, args: argparse.Namespace) -> dict:
    split = setting == "split"
    engine = EngineConfig(model=MODEL, num_kv_blocks=1024, torch_threads=1, max_num_seqs=8)
    kwargs = {} if split else {"disaggregate_tokens": 10**9}
    name = app_name("disaggregation", setting, seed)
    routing = RoutingSettings(
        redis_url=redis_url, deployment=f"dis-{setting}-{seed}", stats_period_s=0.5, policy_kwargs=kwargs
    )
    app = engine_deployment(engine, routing, num_replicas=2, replicas_per_node=2, prefill_replicas=int(split))
    handle = serve.run(app, name=name, route_prefix=None).options(method_name="generate", stream=True)
    try:
        time.sleep(2.0)  # load reports (KV addresses, roles, rates) reach the router
        return measure(asyncio.run(drive(handle, args, random.Random(seed))))
    finally:
        serve.delete(name)


def run(args: argparse.Namespace) -> list[dict]:
    def describe(m: dict) -> str:
        return (
            f"ITL p99 {m['itl_p99_s'] * 1000:.0f} ms, "
            f"long TTFT p50 {m['long_ttft_p50_s'] * 1000:.0f} ms, {m['output_tok_s']:.1f} tok/s"
        )

    return run_pairs(SETTINGS, args.pairs, 2000, functools.partial(run_setting, args=args), describe)


def report(args: argparse.Namespace, pairs: list[dict]) -> None:
    table, summary = [], {}
    for key in ("itl_p50_s", "itl_p99_s", "itl_p999_s", "long_ttft_p50_s", "output_tok_s"):
        values = {s: [p[s][key] for p in pairs] for s in SETTINGS}
        ratios = [a / b for a, b in zip(values["split"], values["colocated"], strict=True)]
        summary[key] = {
            **values,
            "split_over_colocated": spread(ratios),
        }
        fmt = (lambda v: f"{v:.1f}") if key == "output_tok_s" else (lambda v: f"{v * 1000:.0f} ms")
        cells = [" ".join(fmt(v) for v in values[s]) for s in SETTINGS]
        table.append([key, *cells, spread_text(ratios)])
    print_table(["measure", "split (per pair)", "colocated (per pair)", "split/colocated median"], table)
    write_json("disaggregation", {"args": vars(args) | {"json": None}, "pairs": pairs, "summary": summary}, args.json)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    report(args, run(args))


if __name__ == "__main__":
    main()
