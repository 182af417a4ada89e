"""Follows one engine's KV-event stream (vLLM's ZMQ protocol, ``core/kv_event_wire.py``): every batch
once, in sequence order, across gaps, joins and publisher restarts.

A SUB socket takes the live stream; a DEALER asks the engine's ROUTER socket for buffered batches
(``[b"", start_seq]``, answered batch by batch and closed by sequence -1). On start the consumer replays from
0, so it learns what the engine cached before it connected (as far as the engine's ``buffer_steps`` reach),
and after five quiet seconds it asks for anything past its last batch (a lost last batch has no successor
to reveal the gap).
A live batch past the next expected number is a gap (the PUB socket dropped some): the missing ones are
replayed first. A number below the last applied one whose payload differs from what was applied under it
means the publisher restarted: ``on_restart`` drops what it held, then its new stream is replayed from 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import zmq

from kvmesh.core.kv_event_wire import END_SEQ, EventBatch, WireFormatError, decode_batch

log = logging.getLogger(__name__)

IDLE_REPLAY_S = 5.0
"""After this long without a live batch, ask for a replay from the next expected number: a batch lost at the
end of a burst is otherwise noticed only when the next one arrives (the protocol has no heartbeat)."""
REPLAY_TIMEOUT_S = 2.0
"""How long a replay may stay silent before it is given up (the engine answers from memory)."""
POLL_S = 1.0
"""The longest the thread sleeps on a silent stream: a router follows one stream per worker, and each wake-up
costs it CPU (at 100 ms, 32 idle workers took 9% of a core). ``close`` and ``request_rebuild`` wake it at once."""
_REMEMBERED = 256
"""Recent (seq -> payload hash) pairs kept to tell a duplicate from a restarted publisher's batch."""


class KVEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        on_batch: Callable[[EventBatch], None],
        on_restart: Callable[[], None],
        topic: str = "",
        name: str = "worker",
    ) -> None:
        self.endpoint, self.replay_endpoint, self.topic, self.name = endpoint, replay_endpoint, topic, name
        self._on_batch, self._on_restart = on_batch, on_restart
        self.last_seq: int | None = None
        self._applied: OrderedDict[int, int] = OrderedDict()
        self.stats = {"batches": 0, "replayed": 0, "gaps": 0, "lost": 0, "restarts": 0, "bad": 0}
        self.lag_s: float | None = None
        """Seconds from the engine's timestamp of the last batch to its application here."""
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._rebuild = threading.Event()
        self._replay_failing = False
        self._thread: threading.Thread | None = None
        self._wake_address = f"inproc://kvmesh-kv-events-{id(self)}"

    def start(self) -> KVEventSubscriber:
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{self.name}", daemon=True)
        self._thread.start()
        return self

    def request_rebuild(self) -> None:
        """Drop what is held and replay the engine's buffer from 0 (its consumer lost track of it)."""
        self._rebuild.set()
        self._wake()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _wake(self) -> None:
        """Interrupt the thread's wait for the stream (inproc: a connect may precede the bind; a wake lost
        before it costs at most ``POLL_S``)."""
        waker = self._ctx.socket(zmq.PUSH)
        waker.setsockopt(zmq.LINGER, 0)
        try:
            waker.connect(self._wake_address)
            waker.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the thread is gone, or already woken
        finally:
            waker.close()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        wake = self._ctx.socket(zmq.PULL)
        wake.setsockopt(zmq.LINGER, 0)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            wake.bind(self._wake_address)
            sub.connect(self.endpoint)
            time.sleep(0.05)  # let the subscription reach the publisher before asking what it missed
            self._replay(0)
            quiet_since = time.monotonic()
            while not self._stop.is_set():
                if self._rebuild.is_set():
                    self._rebuild.clear()
                    self._restart()
                ready = dict(poller.poll(int(POLL_S * 1000)))
                if wake in ready:
                    wake.recv()
                    continue
                if sub not in ready:
                    if time.monotonic() - quiet_since > IDLE_REPLAY_S:
                        self._replay(0 if self.last_seq is None else self.last_seq + 1)
                        quiet_since = time.monotonic()
                    continue
                quiet_since = time.monotonic()
                frames = sub.recv_multipart()
                if len(frames) < 2:
                    self.stats["bad"] += 1
                    continue
                self._live(int.from_bytes(frames[-2], "big", signed=True), frames[-1])
        except Exception:
            log.exception("KV event subscriber for %s stopped", self.name)
        finally:
            sub.close()
            wake.close()

    def _live(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is not None and seq <= last:
            if self._applied.get(seq) == hash(payload):
                return  # a duplicate of what a replay already applied
            log.warning("KV event publisher of %s restarted (sequence %d after %d): rebuilding", self.name, seq, last)
            self.stats["restarts"] += 1
            self._restart()
            return
        expected = 0 if last is None else last + 1
        if seq > expected:
            self.stats["gaps"] += 1
            self._replay(expected)
            expected = 0 if self.last_seq is None else self.last_seq + 1
            if seq < expected:
                return  # the replay brought it
            if seq > expected:
                self.stats["lost"] += seq - expected
                log.warning("KV events %d..%d of %s are lost (past its replay buffer)", expected, seq - 1, self.name)
        self._apply(seq, payload)

    def _restart(self) -> None:
        self._on_restart()
        self.last_seq = None
        self._applied.clear()
        self._replay(0)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except WireFormatError as exc:
            self.stats["bad"] += 1
            log.warning("KV event batch %d of %s skipped: %s", seq, self.name, exc)
        else:
            self._on_batch(batch)
            self.lag_s = max(0.0, time.time() - batch.ts)
        self.stats["batches"] += 1
        self.last_seq = seq
        self._applied[seq] = hash(payload)
        while len(self._applied) > _REMEMBERED:
            self._applied.popitem(last=False)

    def _replay(self, start: int) -> None:
        """Apply the engine's buffered batches from ``start`` on (none if it has no replay socket)."""
        if not self.replay_endpoint:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                frames = dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]  # the delimiter; then (topic,) seq, payload
                if len(frames) < 2:
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    self._replay_failing = False
                    return
                if self.last_seq is None or seq > self.last_seq:
                    self.stats["replayed"] += 1
                    self._apply(seq, frames[-1])
            if not self._replay_failing:  # once per outage, not every idle poll
                log.warning("KV event replay from %s gave no end marker within %.0f s", self.name, REPLAY_TIMEOUT_S)
            self._replay_failing = True
        finally:
            dealer.close()
