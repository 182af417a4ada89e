"""Router side of the global prefix index: which replica holds how much of a request's prefix.

One server-side script answers a lookup in one round trip. A lookup never raises and never waits longer
than its timeout: on timeout or any Redis error it returns ``None`` ("unknown") and the router falls
back to load-only routing. After a failure the client stays quiet for a short back-off, so a dead Redis
costs the request path nothing. Scripts are registered once; redis-py reloads them transparently if Redis
restarted and forgot them (NOSCRIPT). Replicas found registered but without a heartbeat are purged in the
background by whoever notices first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvmesh.core.defaults import PREDICT_TTL_S
from kvmesh.core.hashing import BlockHash
from kvmesh.core.messages import RedisHealth, ReplicaStatus
from kvmesh.router.index_schema import block_key, chain_arg, index_prefix, probe_depths, script_source
from kvmesh.router.sessions import SESSION_DECAY_S, decayed

log = logging.getLogger(__name__)

SWEEP_PERIOD_S = 1.0
"""How often an ingress sweeps the index for replicas whose heartbeat expired."""

PURGE_CHUNK = 2000


@dataclass(slots=True)
class IndexAnswer:
    """One lookup: per live candidate, the request's leading blocks on its device and, past them, in its
    host tier and then its disk tier; plus the candidates' decayed counts of recent conversation starts."""

    device_hits: dict[str, int] | None
    """Leading blocks on each live candidate's device; None when the index could not answer in time.
    Candidates with no live heartbeat are left out."""
    host_hits: dict[str, int] = field(default_factory=dict)
    """Blocks following the device hits that the candidate's host tier holds (absent: none)."""
    disk_hits: dict[str, int] = field(default_factory=dict)
    """Blocks following the device and host hits that the candidate's disk tier holds (absent: none)."""
    starts: dict[str, float] = field(default_factory=dict)


class PrefixIndex:
    def __init__(
        self,
        redis_url: str,
        deployment: str,
        model: str,
        timeout_s: float = 0.02,
        backoff_s: float = 0.5,
        session_decay_s: float = SESSION_DECAY_S,
    ) -> None:
        if session_decay_s <= 0:
            raise ValueError("session_decay_s must be > 0")
        self.prefix = index_prefix(deployment, model)
        self.session_decay_s = session_decay_s
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.client = aioredis.Redis.from_url(
            redis_url, socket_timeout=max(timeout_s, 0.5), socket_connect_timeout=max(timeout_s, 0.5)
        )
        self._lookup = self.client.register_script(script_source("lookup"))
        self._purge = self.client.register_script(script_source("purge"))
        self._session = self.client.register_script(script_source("session"))
        self._down_until = 0.0
        self._purging: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    async def lookup(self, block_hashes: list[BlockHash], replica_ids: list[str]) -> dict[str, int] | None:
        """Leading blocks of ``block_hashes`` held by each *live* replica among ``replica_ids``.

        Replicas missing from the result have no live heartbeat in the index. ``None`` means the index
        could not answer in time; it is never an exception.
        """
        return (await self.query(block_hashes, replica_ids)).device_hits

    async def query(self, block_hashes: list[BlockHash], replica_ids: list[str]) -> IndexAnswer:
        """``lookup``'s answer, the host-tier depths past it and each candidate's decayed count of
        conversation starts (``start_session``), in one round trip; ``device_hits`` None when the index could not
        answer."""
        if not replica_ids:
            return IndexAnswer({})
        if time.monotonic() < self._down_until:
            return IndexAnswer(None)
        try:
            raw, missing, dead, starts, now = await asyncio.wait_for(
                self._lookup(args=[self.prefix, chain_arg(block_hashes), *replica_ids]), self.timeout_s
            )
        except (TimeoutError, RedisError, OSError) as exc:
            self._down_until = time.monotonic() + self.backoff_s
            log.debug("index lookup failed: %r", exc)
            return IndexAnswer(None)
        for rid in dead:
            self._start_purge(rid.decode())
        out, host, disk = dict.fromkeys(replica_ids, 0), {}, {}
        for k in missing:
            out.pop(replica_ids[k - 1], None)
        for i in range(0, len(raw), 4):
            rid = replica_ids[raw[i] - 1]
            out[rid] = raw[i + 1]
            if raw[i + 2] > raw[i + 1]:
                host[rid] = raw[i + 2] - raw[i + 1]
            if raw[i + 3] > raw[i + 2]:
                disk[rid] = raw[i + 3] - raw[i + 2]
        return IndexAnswer(out, host, disk, self._decayed_starts(replica_ids, starts, float(now)))

    def _decayed_starts(self, replica_ids: list[str], raw: list[bytes | None], now: float) -> dict[str, float]:
        counts = dict.fromkeys(replica_ids, 0.0)
        for rid, value in zip(replica_ids, raw, strict=True):
            if value:
                count, at = value.split()
                counts[rid] = decayed(float(count), now - float(at), self.session_decay_s)
        return counts

    async def start_session(self, replica_id: str) -> bool:
        """Count one new conversation started on ``replica_id``, for every router to see. False on failure
        (ignored by callers: placement then rests on each router's own counts until Redis is back)."""
        if time.monotonic() < self._down_until:
            return False
        try:
            await asyncio.wait_for(
                self._session(args=[self.prefix, replica_id, self.session_decay_s]), self.timeout_s * 5
            )
        except (TimeoutError, RedisError, OSError) as exc:
            log.debug("conversation start not recorded: %r", exc)
            return False
        return True

    async def predict(
        self, block_hashes: list[BlockHash], replica_id: str, ttl_ms: int = int(PREDICT_TTL_S * 1000)
    ) -> None:
        """Record that ``replica_id`` will hold these blocks (written right after routing, short TTL).

        Keys sit at the depths the lookup script checks (1, 2, 4, ..., the end) so siblings routed by any
        router process before the replica's events arrive still find the prefix. Failures are ignored.
        """
        if not block_hashes or time.monotonic() < self._down_until:
            return
        depths = probe_depths(len(block_hashes))
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for d in depths:
                    pipe.set(self.prefix.encode() + b"p:" + block_key(block_hashes[d - 1]), replica_id, px=ttl_ms)
                await asyncio.wait_for(pipe.execute(), self.timeout_s * 5)
        except (TimeoutError, RedisError, OSError) as exc:
            log.debug("prediction not recorded: %r", exc)

    async def replica_reports(self) -> dict[str, ReplicaStatus]:
        """The latest status report of every registered replica with a live heartbeat (for metrics, status).

        Reports are JSON written by the replicas' publishers; nothing read here is evaluated or unpickled.
        Raises ``RedisError`` when Redis is unreachable: callers show that, they do not route on it.
        """
        ids = sorted(k.decode() for k in await self.client.hkeys(self.prefix + "reg"))
        if not ids:
            return {}
        raw = await self.client.mget([f"{self.prefix}st:{rid}" for rid in ids])
        reports = {}
        for rid, report in zip(ids, raw, strict=True):
            if report is None:
                continue
            try:
                reports[rid] = ReplicaStatus.from_dict(json.loads(report))
            except ValueError as exc:  # not JSON, or a field of the wrong type (MalformedReport)
                log.warning("ignoring replica %s's malformed status report: %s", rid, exc)
        return reports

    async def health(self) -> RedisHealth:
        """Redis reachability, round-trip time and memory, for ``kvmesh status``."""
        t0 = time.perf_counter()
        try:
            await self.client.ping()
            rtt = time.perf_counter() - t0
            memory = await self.client.info("memory")
        except (RedisError, OSError) as exc:
            return RedisHealth(ok=False, error=repr(exc))
        return RedisHealth(ok=True, ping_ms=round(1000 * rtt, 3), used_memory=memory.get("used_memory_human"))

    async def sweep(self) -> list[str]:
        """Purge every registered replica whose heartbeat expired (a crash, a lost node); returns their ids.

        Lookups purge the dead they meet, but only on traffic; the ingress also sweeps once a second so a
        dead incarnation leaves the index within the heartbeat TTL plus a second, traffic or not. Raises
        ``RedisError`` when Redis is unreachable (the caller retries on its next tick)."""
        ids = [k.decode() for k in await self.client.hkeys(self.prefix + "reg")]
        if not ids:
            return []
        beats = await self.client.mget([f"{self.prefix}hb:{rid}" for rid in ids])
        dead = [rid for rid, beat in zip(ids, beats, strict=True) if beat is None]
        return [rid for rid in dead if await self.purge_replica(rid)]

    async def sweep_forever(self, period_s: float = SWEEP_PERIOD_S) -> None:
        """``sweep`` every ``period_s`` until cancelled; a Redis outage skips ticks (routing degrades already)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                for rid in await self.sweep():
                    log.warning("replica %s stopped beating: its index entries were removed", rid)
            except (RedisError, OSError) as exc:
                log.debug("index sweep failed: %r", exc)

    def _start_purge(self, replica_id: str) -> None:
        if replica_id in self._purging:
            return
        self._purging.add(replica_id)
        task = asyncio.get_running_loop().create_task(self.purge_replica(replica_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def purge_replica(self, replica_id: str) -> bool:
        """Remove every entry of a replica whose heartbeat expired; False if it is alive or Redis failed."""
        try:
            while True:
                done = await self._purge(args=[self.prefix, replica_id, "", PURGE_CHUNK])
                if done == -1:
                    return False
                if done == 1:
                    log.info("purged index entries of dead replica %s", replica_id)
                    return True
        except RedisError as exc:
            log.warning("purge of %s failed: %r", replica_id, exc)
            return False
        finally:
            self._purging.discard(replica_id)

    async def close(self, purge_grace_s: float = 2.0) -> None:
        """Close the connection, letting in-flight purges finish for up to ``purge_grace_s``."""
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=purge_grace_s)
            for task in pending:
                task.cancel()
        await self.client.aclose()
