"""Replica side of the global prefix index: mirror the engine's KV events into Redis.

The engine thread only appends each step's events to a bounded in-memory queue (``publish`` never blocks
and never touches the network). A background thread drains the queue into one pipelined script call per
batch, beats the heartbeat, and resynchronises when its view may be stale: at start, after a queue
overflow, a Redis error or restart, a prefix-cache reset, or when the slot's purge log has grown far past
the live set. A resync publishes the engine's whole cached set under a fresh slot and switches to it
atomically, then purges the old slot, so lookups always see one complete state. Batches are numbered
under their slot and Redis keeps the last number it applied: one that comes back holding an older state
(restored from a snapshot, a lagging replica promoted) answers a gap, and the publisher sends the batches
it lost again from the last ``REPLAY_BATCHES`` it keeps, instead of the whole cached set.

Why a snapshot may be taken while the engine runs: events are idempotent set updates (add / remove a
hash), so replaying events that the snapshot already reflects leaves exactly the state after the last of
them; all that matters is that every event emitted after the snapshot is applied after it, which the
queue lock guarantees.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Protocol

import redis
from redis.exceptions import RedisError

from kvmesh.core.hashing import BlockHash
from kvmesh.core.messages import ReplicaStatus
from kvmesh.router.index_schema import DEFAULT_HEARTBEAT_TTL_S, block_key, index_prefix, script_source

log = logging.getLogger(__name__)

CHUNK = 5000
"""Entries per script call during resync and purge: bounds how long one call blocks Redis (~ms)."""
REPLAY_BATCHES = 4096
"""Batches kept after they are applied, numbered under the slot: when Redis comes back without the last of
them (a restart from an older snapshot, a lagging replica promoted), they are sent again instead of the
whole cached set."""
LOG_EVERY_S = 30.0
"""While Redis stays unreachable the publisher retries every second but warns once per this period."""


class KVEventLike(Protocol):
    """The engine's KV events as the publisher sees them (``replica/kv_events.py``)."""

    kind: str  # "stored" | "removed" | "cleared"
    block_hash: bytes
    medium: str  # "device" | "host" | "disk" (not read on "cleared")


OPS = {
    ("stored", "device"): b"+",
    ("removed", "device"): b"-",
    ("stored", "host"): b"H",
    ("removed", "host"): b"h",
    ("stored", "disk"): b"D",
    ("removed", "disk"): b"d",
}
"""The op byte of each event in a ``publish.lua`` batch."""


class StaleSlotError(RuntimeError):
    """Redis no longer knows our slot (restart, data loss, purge after a stall): resynchronise."""


class KVIndexPublisher:
    """Publishes one replica's cached block set, per medium. Pass the engine's snapshot functions: the
    device pool's ``cached_hashes`` and, with a host prefix tier, the tier's, and with a disk tier, its."""

    def __init__(
        self,
        redis_url: str,
        deployment: str,
        model: str,
        replica_name: str,
        snapshot: Callable[[], list[BlockHash]],
        heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S,
        heartbeat_interval_s: float | None = None,
        max_queued_steps: int = 4096,
        redis_timeout_s: float = 1.0,
        unique_name: bool = False,
        status: Callable[[], ReplicaStatus] | None = None,
        host_snapshot: Callable[[], list[BlockHash]] | None = None,
        disk_snapshot: Callable[[], list[BlockHash]] | None = None,
    ) -> None:
        self.prefix = index_prefix(deployment, model)
        # A restarted replica must never inherit its predecessor's entries: add an incarnation, unless the
        # caller's name is already unique per process (Ray Serve replica ids are).
        self.replica_id = replica_name if unique_name else f"{replica_name}#{uuid.uuid4().hex[:8]}"
        self._snapshot = snapshot
        self._host_snapshot = host_snapshot
        self._disk_snapshot = disk_snapshot
        self._status = status
        """Called on each heartbeat; its report is stored beside the heartbeat for metrics and status."""
        self.ttl_ms = int(heartbeat_ttl_s * 1000)
        self.interval_s = heartbeat_interval_s or heartbeat_ttl_s / 5
        self.max_queued_steps = max_queued_steps
        self.client = redis.Redis.from_url(
            redis_url, socket_timeout=redis_timeout_s, socket_connect_timeout=redis_timeout_s
        )
        kwargs = self.client.connection_pool.connection_kwargs
        self.address = f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        """Where the index Redis is (host:port, no password): what errors name."""
        names = ("publish", "beat", "claim", "switch", "purge")
        self._scripts = {n: self.client.register_script(script_source(n)) for n in names}
        self._meta = {"deployment": deployment, "model": model}
        self._queue: deque[bytes] = deque()
        self._cv = threading.Condition()
        self._needs_resync = True
        self._stop = False
        self._thread: threading.Thread | None = None
        self.slot: bytes | None = None
        self._live = 0
        self._logged = 0
        self._busy = False
        self.last_error: str | None = None
        """Why the last write to Redis failed; None once one succeeds (read by the replica's load report)."""
        self._warned_at = -LOG_EVERY_S
        self._seq = 0
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self.stats = {"events": 0, "batches": 0, "resyncs": 0, "overflows": 0, "errors": 0, "replayed": 0}

    # ------------------------------------------------------------------ engine thread
    def publish(self, events: list[KVEventLike]) -> None:
        """Queue one step's events; O(events), never blocks on Redis."""
        if not events:
            return
        ops = []
        resync = False
        for e in events:
            if e.kind == "cleared":
                ops.clear()  # the resync publishes the (now empty) cache
                resync = True
            else:
                ops.append(OPS[e.kind, e.medium] + block_key(e.block_hash))
        with self._cv:
            if resync:
                self._needs_resync = True
            elif len(self._queue) >= self.max_queued_steps:
                self._queue.clear()  # the resync snapshot supersedes everything queued
                self._needs_resync = True
                self.stats["overflows"] += 1
            elif ops:
                self._queue.append(b"".join(ops))
            self._cv.notify()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> KVIndexPublisher:
        self._thread = threading.Thread(target=self._run, name=f"kv-publisher-{self.replica_id}", daemon=True)
        self._thread.start()
        return self

    def wait_synced(self, timeout: float) -> bool:
        """Block until the queue is drained into Redis under a live slot (tests, graceful shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cv:
                idle = not self._queue and not self._needs_resync and not self._busy and self.slot is not None
            if idle:
                return True
            time.sleep(0.005)
        return False

    def close(self, remove_entries: bool = True) -> None:
        """Stop the thread; by default also remove this replica's heartbeat and every entry (clean shutdown)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if remove_entries:
            try:
                # lookups stop seeing us at once
                self.client.delete(self.prefix + "hb:" + self.replica_id, self.prefix + "st:" + self.replica_id)
                while self._scripts["purge"](args=[self.prefix, self.replica_id, "", CHUNK]) != 1:
                    pass
            except RedisError as exc:
                log.warning(
                    "could not remove index entries of %s: %r (they expire with the heartbeat)", self.replica_id, exc
                )
        self.client.close()

    # ------------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        next_beat = 0.0
        backoff = 0.05
        while True:
            with self._cv:
                if self._stop:
                    return
                if not self._queue and not self._needs_resync and time.monotonic() < next_beat:
                    self._cv.wait(timeout=max(0.0, next_beat - time.monotonic()))
                    continue
                resync = self._needs_resync
                batch = b"".join(self._queue) if not resync else b""
                self._queue.clear()
                self._busy = True
            try:
                if resync:
                    self._resync()
                elif batch:
                    self._apply(batch)
                if time.monotonic() >= next_beat:
                    beat = [self.prefix, self.replica_id, self.slot, self.ttl_ms, self._status_json()]
                    if self._scripts["beat"](args=beat) != 1:
                        raise StaleSlotError("heartbeat refused")
                    next_beat = time.monotonic() + self.interval_s
                backoff = 0.05
                if self.last_error is not None:
                    log.warning("index publisher %s: Redis reachable again, index caught up", self.replica_id)
                    self.last_error = None
            except (RedisError, OSError, StaleSlotError) as exc:
                self.stats["errors"] += 1
                self.last_error = f"{exc!r} at {self.address}"
                if time.monotonic() - self._warned_at >= LOG_EVERY_S:
                    self._warned_at = time.monotonic()
                    log.warning(
                        "index publisher %s: %s; retrying every second (warning every %.0f s)",
                        self.replica_id,
                        self.last_error,
                        LOG_EVERY_S,
                    )
                with self._cv:
                    if resync or isinstance(exc, StaleSlotError):
                        self._needs_resync = True
                    elif batch:  # sent again under its number: Redis's answer says what it still holds
                        self._queue.appendleft(batch)
                    self._cv.wait(timeout=backoff)  # let Redis come back; close() still wakes us
                backoff = min(2 * backoff, 1.0)
            finally:
                self._busy = False

    def _status_json(self) -> str:
        """The replica's ``ReplicaStatus`` with this heartbeat's index size and time, as JSON for Redis."""
        if self._status is None:
            return ""
        try:
            report = self._status()
        except Exception as exc:  # a status bug must never stop the heartbeat
            report = ReplicaStatus(error=repr(exc))
        report = dataclasses.replace(
            report,
            index_entries=self._live,
            reported_at=time.time(),
            index_resyncs=self.stats["resyncs"],
            index_replayed_batches=self.stats["replayed"],
            index_errors=self.stats["errors"],
        )
        return json.dumps(report.as_dict())

    def _apply(self, ops: bytes) -> None:
        seq = self._seq + 1
        result = self._publish(ops, seq)
        if isinstance(result, list) and int(result[1]) == seq:
            result = 1  # applied before its reply was lost: a retry after a connection error
        elif isinstance(result, list):  # Redis lost batches it had acknowledged: send them again, then this one
            self._replay_after(int(result[1]), seq)
            result = self._publish(ops, seq)
        if result != 1:
            raise StaleSlotError("publish refused")
        self._seq = seq
        self._sent.append((seq, ops))
        n = len(ops) // 9
        self.stats["events"] += n
        self.stats["batches"] += 1
        adds = ops[::9].count(b"+") + ops[::9].count(b"H") + ops[::9].count(b"D")
        self._live += 2 * adds - n
        self._logged += adds
        if self._logged > 4 * max(self._live, CHUNK):
            with self._cv:  # the purge log is mostly dead weight now: start a fresh slot
                self._needs_resync = True

    def _publish(self, ops: bytes, seq: int | str):
        return self._scripts["publish"](args=[self.prefix, self.replica_id, self.slot, ops, seq])

    def _replay_after(self, last: int, seq: int) -> None:
        """Send again the batches after ``last`` (what Redis holds) and before ``seq``; a resync if they are not
        all still kept (or Redis is ahead of us: a second writer under our slot)."""
        missing = [(s, ops) for s, ops in self._sent if last < s < seq]
        if last >= seq or len(missing) != seq - last - 1:
            raise StaleSlotError(f"index holds batch {last}, expected {seq - 1}: past the replay buffer")
        for s, ops in missing:
            if self._publish(ops, s) != 1:
                raise StaleSlotError("replay refused")
        self.stats["replayed"] += len(missing)
        log.warning("index publisher %s: Redis had lost %d batches; sent them again", self.replica_id, len(missing))

    def _resync(self) -> None:
        with self._cv:
            self._needs_resync = False
            self._queue.clear()
            keys = [b"+" + block_key(h) for h in self._snapshot()]  # later events are queued after this point
            if self._host_snapshot is not None:
                keys += [b"H" + block_key(h) for h in self._host_snapshot()]
            if self._disk_snapshot is not None:
                keys += [b"D" + block_key(h) for h in self._disk_snapshot()]
        slot = self._scripts["claim"](args=[self.prefix, self.replica_id])
        for i in range(0, len(keys), CHUNK):
            chunk = [self.prefix, self.replica_id, slot, b"".join(keys[i : i + CHUNK]), ""]
            if self._scripts["publish"](args=chunk) != 1:
                raise StaleSlotError("claim lost during resync")
        old = self._scripts["switch"](args=[self.prefix, self.replica_id, slot, self.ttl_ms])
        if old is None:
            raise StaleSlotError("claim lost before switch")
        self.slot, self._live, self._logged = slot, len(keys), len(keys)
        self._seq = 0  # switch.lua numbers the new slot's batches from 1
        self._sent.clear()
        self.client.hset(self.prefix + "meta", mapping=self._meta)
        self.stats["resyncs"] += 1
        if old:
            while self._scripts["purge"](args=[self.prefix, self.replica_id, old, CHUNK]) != 1:
                pass
