"""Conversations, as ``kv_aware`` places them: where each one lives and how many each replica holds.

A conversation's later turns belong where its history is cached, so a router remembers each session id's
replica (stickiness). Where a conversation starts therefore decides the load, so new conversations on a
shared prefix are placed with bounded loads on the conversations each replica holds: the ones this router
sent there that are still live (a turn within a few of the usual gaps between turns, ``LiveConversations``),
plus the recent starts of other routers, shared through the index (``router/lua/session.lua``) and
fading over ``SESSION_DECAY_S``. Which requests start or continue a conversation is learned from the
prompts' shapes (``Branches``).
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable

SESSION_DECAY_S = 600.0
"""Time constant over which counts of conversation starts fade (about a conversation's lifetime); also how
long a conversation counts as live before this router has seen any gap between turns."""
LIVE_GAPS = 3.0
"""A conversation is live while its last turn is at most this many mean gaps between turns old: its next
turn may still come, and its history still holds room in its replica's cache."""
MIN_LIVE_S = 10.0
"""Shortest time a conversation counts as live after a turn: turns in quick succession (an agent's tool
calls) must not make every conversation look ended between them."""
GAP_SMOOTHING = 0.05
"""Weight of each new gap in the running mean of gaps between a conversation's turns."""
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
        self._ends: OrderedDict[Hashable, Hashable] = OrderedDict()
        """The last full block of each routed prompt, and the conversation it belongs to (the last block of
        the conversation's first prompt)."""
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

    def routed(self, block_hashes: list, known: int) -> tuple[Hashable | None, bool]:
        """Learn from a routed request whose first ``known`` blocks this router had routed before; returns
        the conversation the prompt is filed under (None: a prompt without a full block, or seen whole
        before) and whether it continued that conversation (else it is the first prompt of its own)."""
        if not block_hashes or known >= len(block_hashes):
            return None, False  # no full block, or a prompt seen whole before (a retry, a repeated question)
        conversation, fork = block_hashes[-1], block_hashes[known - 1] if known else None
        continued = fork is not None and fork in self._ends
        if fork is not None and not continued:
            _remember(self._branched, fork, self._branched.get(fork, 0) + 1, self._size)
        elif continued:  # continues the conversation whose prompt ended there
            conversation = self._ends[fork]
            _remember(self._continued, fork, None, self._size)
            for i in range(known - 1, -1, -1):  # back to the first block already marked: each block once
                if block_hashes[i] in self._grown:
                    break
                _remember(self._grown, block_hashes[i], None, self._size)
        _remember(self._ends, block_hashes[-1], conversation, self._size)
        return conversation, continued


def _remember(table: OrderedDict, key: Hashable, value: object, size: int) -> None:
    """Set ``key`` as the most recent entry of a table bounded to ``size`` (the oldest dropped)."""
    table[key] = value
    table.move_to_end(key)
    if len(table) > size:
        table.popitem(last=False)


class LiveConversations:
    """The conversations this router sent to each replica that are still live: their last turn at most
    ``live_s`` ago, ``LIVE_GAPS`` x the mean gap this router saw between a conversation's turns (at least
    ``MIN_LIVE_S``; ``SESSION_DECAY_S`` before it saw one). Under cache pressure a replica holds few
    conversations' histories at once, so what a new one should avoid is the replicas with the most live
    ones, not those that started the most over the last minutes (ended ones hold only evictable blocks)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, size: int = MAX_SESSIONS) -> None:
        self.clock = clock
        self._size = size
        self._last: OrderedDict[Hashable, tuple[str, float, int]] = OrderedDict()
        """Per conversation, its replica, when its last turn was routed and that prompt's blocks: oldest first."""
        self._per_replica: Counter[str] = Counter()
        self._blocks: Counter[str] = Counter()
        self.mean_gap_s: float | None = None

    @property
    def live_s(self) -> float:
        if self.mean_gap_s is None:
            return SESSION_DECAY_S
        return min(max(LIVE_GAPS * self.mean_gap_s, MIN_LIVE_S), SESSION_DECAY_S)

    def touch(self, conversation: Hashable, replica: str, blocks: int = 0) -> None:
        """A turn of ``conversation`` (its first or a later one), a prompt of ``blocks`` full blocks, went to
        ``replica``."""
        now = self.clock()
        last = self._last.pop(conversation, None)
        if last is not None:
            self._per_replica[last[0]] -= 1
            self._blocks[last[0]] -= last[2]
            gap = now - last[1]
            self.mean_gap_s = (
                gap if self.mean_gap_s is None else self.mean_gap_s + GAP_SMOOTHING * (gap - self.mean_gap_s)
            )
        self._last[conversation] = (replica, now, blocks)
        self._per_replica[replica] += 1
        self._blocks[replica] += blocks
        if len(self._last) > self._size:
            self._drop_oldest()

    def counts(self, replicas: list[str]) -> dict[str, float]:
        """Live conversations per replica in ``replicas``."""
        self._expire()
        return {rid: float(self._per_replica[rid]) for rid in replicas}

    def blocks(self, replicas: list[str]) -> dict[str, int]:
        """Per replica in ``replicas``, the blocks of its live conversations' last prompts (a prefix they share
        counted for each): the cache they need to stay hits."""
        self._expire()
        return {rid: self._blocks[rid] for rid in replicas}

    def _expire(self) -> None:
        limit = self.clock() - self.live_s
        while self._last and next(iter(self._last.values()))[1] < limit:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (replica, _, blocks) = self._last.popitem(last=False)
        self._per_replica[replica] -= 1
        self._blocks[replica] -= blocks


class SessionCounts:
    def __init__(
        self,
        decay_s: float = SESSION_DECAY_S,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.decay_s = decay_s
        self.branches = Branches(max_sessions)
        """Where conversations start on a shared prefix longer than half their first request."""
        self.live = LiveConversations(clock, max_sessions)
        """Conversations this router sent to each replica that are still live: what the bound counts."""
        self.local = DecayingCounts(decay_s, clock)
        """Conversations this router started on each replica (fading): its own part of the index's counts."""
        self.unacknowledged: Counter[str] = Counter()
        """Starts this router has sent to the index that it has not confirmed yet."""
        self._homes: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions

    def home(self, session_id: str | None) -> str | None:
        """The replica this router last sent ``session_id`` to."""
        return self._homes.get(session_id) if session_id else None

    def starts(self, index_ids: list[str], shared: dict[str, float] | None) -> dict[str, float]:
        """Conversations per replica for the bound: this router's live ones, plus the recent starts of other
        routers where the index gave its counts (all routers' starts, with this router's unacknowledged
        ones, less this router's own)."""
        live = self.live.counts(index_ids)
        if not shared:
            return live
        return {
            rid: live[rid] + max(shared.get(rid, 0.0) + self.unacknowledged[rid] - self.local.get(rid), 0.0)
            for rid in index_ids
        }

    def routed(
        self,
        session_id: str | None,
        index_id: str,
        opened: bool,
        conversation: Hashable | None,
        continued: bool,
        blocks: int = 0,
    ) -> None:
        """A request of ``blocks`` full blocks went to ``index_id``; ``opened``: it started a conversation
        there; ``conversation``: the one it belongs to by its prompt (``Branches.routed``), ``continued``: as a
        later turn."""
        if opened:
            self.local.add(index_id)
        if opened or continued:  # a first prompt seen continued counts from its second turn
            key = session_id or conversation
            if key is not None:
                self.live.touch(key, index_id, blocks)
        if session_id:
            _remember(self._homes, session_id, index_id, self._max_sessions)
