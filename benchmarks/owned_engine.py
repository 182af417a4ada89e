"""What running a kvmesh engine in an actor its Serve replica owns costs (how a deployment mixing external
workers with kvmesh's engines runs them, ``cluster/workers/mixed_deployment.py``) against the engine in the
replica's own process (the engine deployment).

    kvmesh bench owned_engine [--repeats 3] [--requests 6] [--streams 4] [--max-tokens 64]

Both deployments run side by side in one local Ray session, one SmolLM2 engine each (two torch threads), and
are called through their Serve handles with ``GenerateCall``s, alternating run by run: ``--requests``
sequential requests (new 128-token prompts, greedy, ``--max-tokens`` tokens each), then ``--streams`` at once.
Per run: the median time to the first chunk and between chunks of the sequential requests, and the tokens per
second of the concurrent ones. Medians over ``--repeats``; prints a table and writes
``benchmarks/results/owned_engine.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
import uuid

import ray
from ray import serve

from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.cluster.engines.engine_deployment import engine_deployment
from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.cluster.workers.mixed_deployment import OwnedEngines, mixed_deployment
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.messages import GenerateCall
from kvmesh.core.model_files import resolve_model_dir
from kvmesh.core.sampling_params import SamplingParams

PROMPT_TOKENS = 128
ROUTING = RoutingSettings(redis_url="", deployment="owned-bench")
"""No index (an empty URL): one engine each, nothing to route between."""


def new_call(rng: random.Random, max_tokens: int) -> GenerateCall:
    """A request for a prompt no engine has seen (block hashes left to the engine)."""
    tokens = [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return GenerateCall(
        request_id=uuid.uuid4().hex, prompt_token_ids=tokens, block_hashes=[], block_size=16, params=params
    )


async def stream(handle, call: GenerateCall) -> tuple[float, list[float], int]:
    """Time to the first chunk, the gaps between chunks, and the tokens streamed."""
    t0 = time.perf_counter()
    times, tokens = [], 0
    async for chunk in handle.remote(call):
        times.append(time.perf_counter())
        tokens += len(chunk.token_ids)
    return times[0] - t0, [b - a for a, b in itertools.pairwise(times)], tokens


async def run(handle, rng: random.Random, args: argparse.Namespace) -> dict:
    """One run: sequential requests, then concurrent streams."""
    ttfts, gaps = [], []
    for _ in range(args.requests):
        ttft, between, _ = await stream(handle, new_call(rng, args.max_tokens))
        ttfts.append(ttft)
        gaps += between
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream(handle, new_call(rng, args.max_tokens)) for _ in range(args.streams)))
    elapsed = time.perf_counter() - t0
    return {
        "ttft_ms": 1000 * statistics.median(ttfts),
        "gap_ms": 1000 * statistics.median(gaps),
        "concurrent_tok_s": sum(tokens for _, _, tokens in results) / elapsed,
    }


def deploy(args: argparse.Namespace) -> dict:
    """Both deployments, each with one engine, as Serve handles by name."""
    model = str(resolve_model_dir("smollm2-135m", weights=True))
    engine = EngineConfig(model=model, torch_threads=2, num_kv_blocks=1024, max_num_seqs=16)
    in_process = engine_deployment(engine, ROUTING, num_replicas=1)
    owned = mixed_deployment([], model, ROUTING, OwnedEngines(engine=engine, actor_options={"num_cpus": 0}), 1)
    handles = {}
    for name, app in (("in the replica", in_process), ("owned actor", owned)):
        handle = serve.run(app, name=name.replace(" ", "-"), route_prefix=None)
        handles[name] = handle.options(method_name="generate", stream=True)
    return handles


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench owned_engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(proxy_location="Disabled")
    rng = random.Random(0)
    try:
        handles = deploy(args)
        for handle in handles.values():  # warm: first shapes, connections
            asyncio.run(run(handle, rng, argparse.Namespace(requests=1, streams=2, max_tokens=8)))
        runs: dict[str, list[dict]] = {name: [] for name in handles}
        for _ in range(args.repeats):
            for name, handle in handles.items():
                runs[name].append(asyncio.run(run(handle, rng, args)))
    finally:
        serve.shutdown()
        ray.shutdown()
    keys = ("ttft_ms", "gap_ms", "concurrent_tok_s")
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    header = ["engine", "TTFT ms (sequential)", "ms between chunks", f"tokens/s, {args.streams} streams"]
    print(f"\nSmolLM2, {PROMPT_TOKENS}-token prompts, {args.max_tokens} tokens each, medians of {args.repeats} runs")
    print_table(header, [[name, *(m[k] for k in keys)] for name, m in medians.items()])
    payload = {"args": vars(args), "medians": medians, "runs": runs}
    write_json("owned_engine", payload)


if __name__ == "__main__":
    main()
