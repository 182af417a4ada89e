"""Conversations, as ``kv_aware`` places them: where each one lives and how many each replica started.

A conversation's later turns belong where its history is cached, so a router remembers each session id's
replica (stickiness). Where a conversation starts therefore decides the long-run load, so new
conversations on a shared prefix are placed with bounded loads on recent start counts: every router's,
shared through the index (``kvmesh/router/lua/session.lua``) and fading over ``SESSION_DECAY_S``, plus this
router's own starts the index has not acknowledged yet; or, when the index did not answer, this router's
own fading counts. Which requests start a conversation is learned from the prompts' shapes (``Branches``).
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable

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


class Branches:
    """Which shared prefixes conversations grow from, learned from this router's own decisions.

    A request whose longest prefix this router has routed before (``known`` leading blocks) ends where an
    earlier request's prompt ended continues that conversation: its next turn, or a sub-agent forked from
    its whole context. Every block of a continued conversation is marked as one conversations grow from.
    A request that leaves the known prefix where no prompt ended branches off a shared prefix (a system or
    tool prompt, a document); if a conversation grew from there, it opens a new one however long the shared
    part is (an agent's tool prompt is most of its first request). Branches off a prefix no conversation
    continued from (RAG questions on one document, few-shot queries) stay one-off requests.
    """

    def __init__(self, size: int = MAX_SESSIONS) -> None:
        self._size = size
        self._ends: OrderedDict[Hashable, None] = OrderedDict()
        """The last full block of each routed prompt."""
        self._grown: OrderedDict[Hashable, None] = OrderedDict()
        """Blocks of prompts a later turn continued."""
        self._branched: OrderedDict[Hashable, int] = OrderedDict()
        """Blocks where requests left a known prefix short of any prompt's end, and how many did."""
        self._continued: OrderedDict[Hashable, None] = OrderedDict()
        """Prompt ends later requests continued from."""

    def shared(self, block: Hashable) -> bool:
        """Whether requests left a known prefix at ``block`` at least twice, where no prompt ended: a prefix
        one-off requests share (a document, a few-shot or tenant prompt), not a conversation's history (one
        retry branching off it is not enough)."""
        return self._branched.get(block, 0) >= 2

    def fresh(self, block: Hashable) -> bool:
        """Whether no request this router routed left or continued a prefix at ``block`` yet."""
        return block not in self._branched and block not in self._continued

    def opens(self, block_hashes: list, known: int) -> bool:
        """Whether the request branches off a prefix conversations grow from after ``known`` blocks."""
        if not 0 < known < len(block_hashes):
            return False
        fork = block_hashes[known - 1]
        return fork not in self._ends and fork in self._grown

    def routed(self, block_hashes: list, known: int) -> None:
        """Learn from a routed request whose first ``known`` blocks this router had routed before."""
        if not block_hashes or known >= len(block_hashes):
            return  # no full block, or a prompt seen whole before (a retry, a repeated question)
        if known and block_hashes[known - 1] not in self._ends:
            fork = block_hashes[known - 1]
            _remember(self._branched, fork, self._branched.get(fork, 0) + 1, self._size)
        elif known:  # continues the conversation whose prompt ended there
            fork = block_hashes[known - 1]
            _remember(self._continued, fork, None, self._size)
            for i in range(known - 1, -1, -1):  # back to the first block already marked: each block once
                if block_hashes[i] in self._grown:
                    break
                _remember(self._grown, block_hashes[i], None, self._size)
        _remember(self._ends, block_hashes[-1], None, self._size)


def _remember(table: OrderedDict, key: Hashable, value: object, size: int) -> None:
    """Set ``key`` as the most recent entry of a table bounded to ``size`` (the oldest dropped)."""
    table[key] = value
    table.move_to_end(key)
    if len(table) > size:
        table.popitem(last=False)


class SessionCounts:
    def __init__(self, decay_s: float = SESSION_DECAY_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.decay_s = decay_s
        self.branches = Branches(max_sessions)
        """Where conversations start on a shared prefix longer than half their first request."""
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
            _remember(self._homes, session_id, index_id, self._max_sessions)
