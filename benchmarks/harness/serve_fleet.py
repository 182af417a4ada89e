"""A local Ray Serve session with a real Redis index, and requests sent to an engine deployment's handle as
the ingress sends them (SmolLM2 token ids, blocks hashed with the engines' seed), for benchmarks that
deploy and redeploy engine fleets themselves."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator

from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis
from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.messages import GenerateCall
from kvmesh.core.sampling_params import SamplingParams

MODEL = "smollm2-135m"
BLOCK = 16


@contextlib.contextmanager
def local_serve() -> Iterator[tuple[object, str]]:
    """Ray Serve (no HTTP proxy) on a local Ray session and an embedded Redis: ``(serve, redis_url)``."""
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(proxy_location="Disabled")
        with EmbeddedRedis() as redis:
            yield serve, redis.url
        serve.shutdown()
    finally:
        ray.shutdown()


def run_pairs(
    settings: tuple[str, str], pairs: int, seed: int, run_setting: Callable, describe: Callable[[dict], str]
) -> list[dict]:
    """``pairs`` pairs of runs of the two ``settings`` on one local Serve session, in an order that alternates
    from pair to pair: ``run_setting(serve, redis_url, setting, seed)`` (the pair's seed: ``seed + pair``)
    returns a setting's measures, printed with ``describe`` as they come. Each pair's record holds them by
    setting."""
    records = []
    with local_serve() as (serve, redis_url):
        for p in range(pairs):
            order = settings if p % 2 == 0 else settings[::-1]
            record = {"pair": p, "order": list(order)}
            for setting in order:
                record[setting] = run_setting(serve, redis_url, setting, seed + p)
                print(f"pair {p} {setting}: {describe(record[setting])}", flush=True)
            records.append(record)
    return records


def app_name(bench: str, setting: str, seed: int) -> str:
    """A Serve application name of its own per setting and seed: handles in one process share the router of
    an application's deployment, so settings deployed under one name would all run the first one's router
    (its policy options, its index namespace)."""
    return f"{bench}-{setting}-{seed}"


def generate_call(tokens: list[int], max_tokens: int) -> GenerateCall:
    """What the ingress sends for ``tokens``: ``max_tokens`` greedy tokens, blocks hashed with the seed."""
    return GenerateCall(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=tokens,
        block_hashes=hash_blocks(tokens, BLOCK, model_seed(MODEL)),
        block_size=BLOCK,
        params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


async def stream(handle, tokens: list[int], max_tokens: int, on_first: Callable[[str], None] | None = None) -> dict:
    """One request through ``handle`` (``generate``, streamed): when each chunk of tokens arrived (seconds
    from the call, with its token count), its TTFT, cached prompt tokens and the replica that served it.
    ``on_first``: called with the replica's id at the first token. Cancelled, it cancels the request on its
    replica."""
    start, arrivals, cached, replica = time.perf_counter(), [], 0, None
    response = handle.remote(generate_call(tokens, max_tokens))
    try:
        async for chunk in response:
            if chunk.token_ids:
                if not arrivals and on_first is not None:
                    on_first(chunk.replica)
                arrivals.append((time.perf_counter() - start, len(chunk.token_ids)))
            cached, replica = chunk.num_cached_tokens, chunk.replica
    except asyncio.CancelledError:
        response.cancel()  # the caller stopped reading: the engine frees the request's blocks now, as the ingress does
        raise
    ttft = arrivals[0][0] if arrivals else None
    return {"ttft_s": ttft, "arrivals": arrivals, "prompt": len(tokens), "cached": cached, "replica": replica}
