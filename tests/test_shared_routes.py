"""Several ``kvmesh router`` processes sharing what each just routed through a real Redis (``--redis-url``).

Each router follows every worker's events and load itself; what the others sent since a worker's last load
report, and where they sent a prefix the worker has not announced yet, comes from Redis before each decision.
Workers here are ``Worker`` objects without servers: the decisions are what is tested, on real Redis reads.
"""

from __future__ import annotations

import asyncio
import socket
import time

from kvmesh.cluster.workers.router_server import LocalRouter
from kvmesh.cluster.workers.worker_client import Worker
from kvmesh.cluster.workers.worker_spec import WorkerSpec
from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.kv_event_wire import EventBatch, StoredBlocks
from kvmesh.core.messages import GenerateCall, LoadReport
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.router.shared_routes import SharedRoutes

MODEL = "m"
URLS = ("http://a:1", "http://b:1", "http://x:1")


def fleet(reported_at: float) -> list[Worker]:
    """Three idle workers; ``a`` and ``b`` cache a little, so a new prompt goes to ``x`` (the emptiest)."""
    workers = []
    for i, url in enumerate(URLS):
        w = Worker(WorkerSpec(url=url), MODEL, MODEL, 16)
        w.report = LoadReport(index_id=url, reported_at=reported_at, prefill_tok_s=1000.0, cache_fill=0.0)
        if url != "http://x:1":
            tokens = list(range(50_000 + 32 * i, 50_032 + 32 * i))
            stored = StoredBlocks(
                block_hashes=[i * 10 + 1, i * 10 + 2], parent_block_hash=None, token_ids=tokens, block_size=16
            )
            w.blocks.apply(EventBatch(ts=0.0, events=[stored]))
        workers.append(w)
    return workers


def call(request_id: str, first: int, n: int = 320) -> GenerateCall:
    tokens = list(range(first, first + n))
    return GenerateCall(
        request_id=request_id,
        prompt_token_ids=tokens,
        block_hashes=hash_blocks(tokens, 16, model_seed(MODEL)),
        block_size=16,
        params=SamplingParams(max_tokens=4),
    )


async def settled(shared: SharedRoutes) -> None:
    """Wait for the router's background writes to Redis."""
    await asyncio.gather(*shared._tasks)


def test_routers_sharing_redis_see_each_others_requests_and_prefixes_at_once(redis_server):
    """Router A sends three long prompts to ``x``; router B, whose last load reads of ``x`` predate them, sends
    a new prompt elsewhere (alone it would pick ``x``, the emptiest), and a sibling of A's prompt to ``x``,
    where its prefix will be (``x``'s events have not said so yet). A report taken after A's requests counts
    them: B then no longer adds them. A router never counts its own routes twice."""

    async def main():
        before = time.time() - 0.1
        shared_a, shared_b = SharedRoutes(redis_server.url, MODEL), SharedRoutes(redis_server.url, MODEL)
        a, b = LocalRouter(fleet(before), shared=shared_a), LocalRouter(fleet(before), shared=shared_b)
        try:
            for i in range(3):
                shared_a.record(call(f"a{i}", 1000 + 10_000 * i, 4000).block_hashes, "http://x:1", f"a{i}", 4000)
            await settled(shared_a)
            new = call("b0", 900_000)
            assert b.choose(new, None)[0] == "http://x:1"  # without the others' routes: the emptiest
            view = await b._shared_view(new)
            assert view is not None and view.routed == {"http://x:1": (3, 12000)}
            assert b.choose(new, view)[0] != "http://x:1"
            sibling = call("b1", 1000, 4000 + 160)  # A's first prompt, continued
            view = await b._shared_view(sibling)  # recorded at depths 1, 2, 4, ..., 128 and 250; looked up at
            assert view.predicted == {"http://x:1": 128}  # 1, 2, 4, ..., 256 and 260: 128 is the deepest shared
            assert b.choose(sibling, view) == ("http://x:1", 128)
            assert (await a._shared_view(new)).routed == {}  # its own, it counts itself
            for w in b.workers.values():  # x's report now counts A's requests
                w.report = LoadReport(index_id=w.spec.url, reported_at=time.time(), prefill_tok_s=1000.0)
            assert (await b._shared_view(new)).routed == {}
            shared_a.done("http://x:1", "a0", 4000)
            await settled(shared_a)
            for w in b.workers.values():
                w.report.reported_at = before
            assert (await b._shared_view(new)).routed == {"http://x:1": (2, 8000)}
        finally:
            await shared_a.aclose()
            await shared_b.aclose()

    asyncio.run(main())


def test_a_router_whose_redis_does_not_answer_routes_on_its_own():
    """A Redis that is down costs each decision the others' routes and nothing else: ``look`` answers None
    within its timeout, writes are dropped quietly, and the router still chooses."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed

    async def main():
        shared = SharedRoutes(f"redis://127.0.0.1:{port}/0", MODEL, timeout_s=0.05)
        router = LocalRouter(fleet(time.time()), shared=shared)
        try:
            start = time.monotonic()
            view = await router._shared_view(call("r0", 0))
            shared.record(call("r0", 0).block_hashes, "http://x:1", "r0", 320)
            await settled(shared)
            assert view is None and time.monotonic() - start < 1.0
            assert router.choose(call("r1", 5000), await router._shared_view(call("r1", 5000)))[0] in URLS
        finally:
            await shared.aclose()

    asyncio.run(main())
