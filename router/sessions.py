"""Conversations, as ``kv_aware`` places them: where each one lives and how many each replica started.

A conversation's later turns belong where its history is cached, so a router remembers each session id's
replica (stickiness). Where a conversation starts therefore decides the long-run load, so new
conversations on a shared prefix are placed with bounded loads on recent start counts: every router's,
shared through the index (``router/lua/session.lua``) and fading over ``SESSION_DECAY_S``, plus this
router's own starts the index has not acknowledged yet; or, when the index did not answer, this router's
own fading counts.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

SESSION_DECAY_S = 600.0
"""Time constant over which counts of conversation starts fade (about a conversation's lifetime)."""
MAX_SESSIONS = 100_000
"""Session ids a router remembers (least recently routed forgotten first); ids are at most 256 characters."""


def decayed(count: float, age_s: float, tau_s: float) -> float:
    """A count as it stands ``age_s`` after it was taken: the one fading rule of conversation counts (the
    index's ``session.lua`` applies the same on writes)."""
    return count * math.exp(-max(age_s, 0.0) / tau_s) if count else 0.0


class DecayingCounts:
    """Counts per key that fade as ``exp(-age / tau)``: what happened recently, not since start-up. The
    clock is injectable so the trace simulator can run it on simulated time."""

    def __init__(self, tau_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if tau_s <= 0:
            raise ValueError("session_decay_s must be > 0")
        self.tau_s = tau_s
        self.clock = clock
        self._counts: dict[str, tuple[float, float]] = {}

    def get(self, key: str) -> float:
        count, at = self._counts.get(key, (0.0, 0.0))
        return decayed(count, self.clock() - at, self.tau_s)

    def add(self, key: str, amount: float = 1.0) -> None:
        self._counts[key] = (self.get(key) + amount, self.clock())


class SessionCounts:
    def __init__(self, decay_s: float = SESSION_DECAY_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.decay_s = decay_s
        self.local = DecayingCounts(decay_s)
        """Conversations this router started on each replica: what the bound uses when the index is silent."""
        self.unacknowledged: Counter[str] = Counter()
        """Starts this router has sent to the index that it has not confirmed yet."""
        self._homes: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions

    def home(self, session_id: str | None) -> str | None:
        """The replica this router last sent ``session_id`` to."""
        return self._homes.get(session_id) if session_id else None

    def starts(self, index_ids: list[str], shared: dict[str, float] | None) -> dict[str, float]:
        """Recent conversation starts per replica: the index's counts (with this router's unacknowledged
        ones) when it gave any, else this router's own."""
        if shared:
            return {rid: shared.get(rid, 0.0) + self.unacknowledged[rid] for rid in index_ids}
        return {rid: self.local.get(rid) for rid in index_ids}

    def routed(self, session_id: str | None, index_id: str, opened: bool) -> None:
        """A request went to ``index_id``; ``opened``: it started a conversation there."""
        if opened:
            self.local.add(index_id)
        if session_id:
            self._homes[session_id] = index_id
            self._homes.move_to_end(session_id)
            if len(self._homes) > self._max_sessions:
                self._homes.popitem(last=False)
