"""Several ``kvmesh router`` processes in front of one fleet, sharing what each just routed through Redis.

Each router follows every worker's KV events and reads each worker's load, but between two load reads it
sees only its own requests, and a prefix it has not seen stored yet (the holder is still prefilling) looks
cached nowhere. With ``--redis-url`` each router records, as it sends a request, the worker and the prefill
tokens it sent there, and where the request's prefix will be cached (the Serve routers' prediction keys,
``router/index_schema.py``); before each decision it reads, in one round trip, what the other routers sent
each candidate since that worker's last load report and where they sent this prefix. A Redis that does not
answer within the timeout costs one decision that information, never the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvmesh.core.defaults import PREDICT_TTL_S
from kvmesh.core.hashing import BlockHash
from kvmesh.router.index_schema import block_key, chain_arg, index_prefix, probe_depths, script_source

log = logging.getLogger(__name__)

WINDOW_S = 2.0
"""How long a route is kept: a worker's report older than this no longer stands for what it was sent."""


@dataclass(slots=True)
class SharedView:
    """What the other routers did, as one decision needs it."""

    predicted: dict[str, int] = field(default_factory=dict)
    """Per worker, the leading blocks of the request's prefix another router just sent there (not yet in its events)."""
    routed: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per worker, the requests and prefill tokens other routers sent it since its last load report."""


class SharedRoutes:
    """One router's link to the routes every router sharing ``redis_url`` records for ``model``'s workers."""

    def __init__(
        self,
        redis_url: str,
        model: str,
        predict_ttl_s: float = PREDICT_TTL_S,
        timeout_s: float = 0.02,
        backoff_s: float = 0.5,
    ) -> None:
        self.prefix = index_prefix("kvmesh-router", model)
        self.router_id = uuid.uuid4().hex[:12]
        self.predict_ttl_ms = int(predict_ttl_s * 1000)
        self.timeout_s, self.backoff_s = timeout_s, backoff_s
        self.client = aioredis.Redis.from_url(
            redis_url, socket_timeout=max(timeout_s, 0.5), socket_connect_timeout=max(timeout_s, 0.5)
        )
        self._look = self.client.register_script(script_source("shared_routes"))
        self._down_until = 0.0
        self._tasks: set[asyncio.Task] = set()

    async def look(self, block_hashes: list[BlockHash], since: dict[str, float]) -> SharedView | None:
        """Where other routers sent ``block_hashes``' prefix, and what they sent each worker of ``since`` (url ->
        unix time of its last load report) after it; None when Redis did not answer in time."""
        if time.monotonic() < self._down_until:
            return None
        args = [self.prefix, self.router_id, chain_arg(block_hashes)]
        floor = time.time() - WINDOW_S
        for url, at in since.items():
            args += [url, repr(max(at, floor))]
        try:
            owners, routed = await asyncio.wait_for(self._look(args=args), self.timeout_s)
        except (TimeoutError, RedisError, OSError) as exc:
            self._down_until = time.monotonic() + self.backoff_s
            log.debug("shared routes not read: %r", exc)
            return None
        view = SharedView()
        for depth, owner in zip(probe_depths(len(block_hashes)), owners, strict=False):
            if owner:
                url = owner.decode()
                view.predicted[url] = max(view.predicted.get(url, 0), depth)
        for k, url in enumerate(since):
            if routed[2 * k]:
                view.routed[url] = (routed[2 * k], routed[2 * k + 1])
        return view

    def record(self, block_hashes: list[BlockHash], url: str, request_id: str, prefill_tokens: int) -> None:
        """Record, in the background, that this router sent ``request_id`` to ``url`` with ``prefill_tokens`` to
        prefill, and that ``url`` will hold the prefix."""
        self._background(self._record(block_hashes, url, request_id, prefill_tokens))

    def done(self, url: str, request_id: str, prefill_tokens: int) -> None:
        """The request completed: it no longer counts (a completed request's report counts it no more either)."""
        self._background(self.client.zrem(self._routes_key(url), self._member(request_id, prefill_tokens)))

    async def _record(self, block_hashes: list[BlockHash], url: str, request_id: str, prefill_tokens: int) -> None:
        now, key = time.time(), self._routes_key(url)
        async with self.client.pipeline(transaction=False) as pipe:
            for depth in probe_depths(len(block_hashes)):
                pipe.set(self.prefix.encode() + b"p:" + block_key(block_hashes[depth - 1]), url, px=self.predict_ttl_ms)
            pipe.zadd(key, {self._member(request_id, prefill_tokens): now})
            pipe.zremrangebyscore(key, "-inf", now - WINDOW_S)
            pipe.pexpire(key, int(WINDOW_S * 1000) * 2)
            await asyncio.wait_for(pipe.execute(), self.timeout_s * 5)

    def _routes_key(self, url: str) -> str:
        return f"{self.prefix}r:{url}"

    def _member(self, request_id: str, prefill_tokens: int) -> str:
        return f"{self.router_id} {request_id.replace(' ', '_')} {max(int(prefill_tokens), 0)}"

    def _background(self, coro) -> None:
        if time.monotonic() < self._down_until:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(self._quietly(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _quietly(self, coro) -> None:
        try:
            await coro
        except (TimeoutError, RedisError, OSError) as exc:
            self._down_until = time.monotonic() + self.backoff_s
            log.debug("shared route not written: %r", exc)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.client.aclose()
