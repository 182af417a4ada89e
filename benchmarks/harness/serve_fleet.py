"""A local Ray Serve session with a real Redis index, and requests sent to an engine deployment's handle as
the ingress sends them (SmolLM2 token ids, blocks hashed with the engines' seed), for benchmarks that
deploy and redeploy engine fleets themselves."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator

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


def generate_call(tokens: list[int], max_tokens: int) -> GenerateCall:
    """What the ingress sends for ``tokens``: ``max_tokens`` greedy tokens, blocks hashed with the seed."""
    return GenerateCall(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=tokens,
        block_hashes=hash_blocks(tokens, BLOCK, model_seed(MODEL)),
        block_size=BLOCK,
        params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )


async def stream(handle, tokens: list[int], max_tokens: int) -> dict:
    """One request through ``handle`` (``generate``, streamed): when each chunk of tokens arrived (seconds
    from the call, with its token count), its TTFT, cached prompt tokens and the replica that served it."""
    start, arrivals, cached, replica = time.perf_counter(), [], 0, None
    async for chunk in handle.remote(generate_call(tokens, max_tokens)):
        if chunk.token_ids:
            arrivals.append((time.perf_counter() - start, len(chunk.token_ids)))
        cached, replica = chunk.num_cached_tokens, chunk.replica
    ttft = arrivals[0][0] if arrivals else None
    return {"ttft_s": ttft, "arrivals": arrivals, "prompt": len(tokens), "cached": cached, "replica": replica}
