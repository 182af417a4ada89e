"""The engine's KV events on vLLM's wire (``core/kv_event_wire.py``), so any router that consumes
vLLM's events (Dynamo, llm-d, SGLang's router, Ray's ``KVAwareRouter``, kvmesh's own) can route kvmesh engines.

The engine thread only queues each step's events (never blocks: a full queue drops the step and says so).
A background thread turns them into one batch per step, merging a request's consecutive blocks into one
``BlockStored`` as vLLM does, publishes it on a ZMQ PUB socket with the next sequence number, keeps the last
``buffer_steps`` batches and answers replay requests on a ROUTER socket. Host-tier stores name the tokens and
parent their device store named: the thread remembers them for every hash cached in either tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from kvmesh.core.kv_event_wire import (
    CPU,
    END_SEQ,
    GPU,
    AllCleared,
    EventBatch,
    KVEventsConfig,
    RemovedBlocks,
    StoredBlocks,
    WireEvent,
    encode_batch,
    wire_hash,
)
from kvmesh.replica.kv_events import DEVICE, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

_MEDIUM = {DEVICE: GPU, "host": CPU, "disk": "DISK"}


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local transport binds, an address connects to a subscriber that binds."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class WireEncoder:
    """Turns one step's engine events into wire events; remembers each cached hash's parent and tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._known: dict[bytes, tuple[bytes | None, list[int], str | None]] = {}
        self._media: dict[bytes, int] = {}

    def encode(self, events: list[KVEvent]) -> list[WireEvent]:
        out: list[WireEvent] = []
        emptied: list[bytes] = []
        for e in events:
            if e.kind == "cleared":
                self._known.clear()
                self._media.clear()
                out.append(AllCleared())
            elif e.kind == "stored":
                self._stored(e, out)
            else:
                self._removed(e, out, emptied)
        for h in emptied:  # a hash moving between tiers is removed from one before it is stored in the other
            if not self._media.get(h):
                self._media.pop(h, None)
                self._known.pop(h, None)
        return out

    def _stored(self, e: BlockStored, out: list[WireEvent]) -> None:
        if e.medium == DEVICE:
            self._known[e.block_hash] = (e.parent_block_hash, list(e.token_ids), e.cache_salt, e.lora_name)
        known = self._known.get(e.block_hash)
        if known is None:  # a host store of a hash never stored on the device: nothing to name it by
            return
        self._media[e.block_hash] = self._media.get(e.block_hash, 0) + 1
        parent, tokens, salt, lora = known
        medium = _MEDIUM[e.medium]
        last = out[-1] if out else None
        if (
            isinstance(last, StoredBlocks)
            and last.medium == medium
            and parent is not None
            and last.block_hashes[-1] == wire_hash(parent)
        ):
            last.block_hashes.append(wire_hash(e.block_hash))
            last.token_ids.extend(tokens)
            return
        out.append(
            StoredBlocks(
                block_hashes=[wire_hash(e.block_hash)],
                parent_block_hash=None if parent is None else wire_hash(parent),
                token_ids=list(tokens),
                block_size=self.block_size,
                medium=medium,
                cache_salt=salt,
                lora_name=lora,
            )
        )

    def _removed(self, e: BlockRemoved, out: list[WireEvent], emptied: list[bytes]) -> None:
        if e.block_hash not in self._media:
            return
        self._media[e.block_hash] -= 1
        emptied.append(e.block_hash)
        medium = _MEDIUM[e.medium]
        last = out[-1] if out else None
        if isinstance(last, RemovedBlocks) and last.medium == medium:
            last.block_hashes.append(wire_hash(e.block_hash))
        else:
            out.append(RemovedBlocks(block_hashes=[wire_hash(e.block_hash)], medium=medium))


class ZmqKVEventPublisher:
    """One engine's event stream: pass ``publish`` to the engine's ``kv_event_sinks``; ``close`` at shutdown."""

    def __init__(self, config: KVEventsConfig, block_size: int, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.rank = data_parallel_rank
        self.encoder = WireEncoder(block_size)
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self.next_seq = 0
        self.dropped = 0
        self._warned_at = 0.0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = self._ctx.socket(zmq.ROUTER) if config.replay_endpoint else None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if self._replay is not None:
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()
            where = f"{config.endpoint} / {config.replay_endpoint}"
            raise ValueError(f"KV events: cannot listen on {where}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (engine thread; never blocks)."""
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1
            if time.monotonic() - self._warned_at > 30:
                self._warned_at = time.monotonic()
                size = self.config.max_queue_size
                log.warning("KV event queue full (%d steps): %d steps dropped", size, self.dropped)

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued (up to ``timeout_s``), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    events = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if events is None:
                    return
                wire = self.encoder.encode(events)
                if wire:
                    self._send(encode_batch(EventBatch(time.time(), wire, self.rank)))
        except Exception:  # the engine must keep serving; routers then resynchronise from replay or a restart
            log.exception("KV event publisher stopped")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _send(self, payload: bytes) -> None:
        seq = self.next_seq
        self.next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """A DEALER's ``[b"", start_seq]``: every buffered batch from ``start_seq`` on, then the end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ.to_bytes(8, "big", signed=True), b""))
