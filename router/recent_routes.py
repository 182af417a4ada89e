"""What one router sent each replica since that replica's last load report.

A report is up to one period old and counts every router's requests as of then; the requests this router
sent since are added by it, so a burst routed between two reports sees itself. The Serve router
(``router/serve_router.py``) and ``kvmesh router`` (``cluster/workers/router_server.py``) both keep one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable

MAX_TRACKED = 100_000
"""Most requests remembered as in flight: memory stays bounded whatever happens (a completion never seen)."""


class RecentRoutes:
    """Per replica, the requests this router sent it that have not completed: when, and the prompt tokens
    each had left to prefill there."""

    def __init__(self, report_period_s: float = 1.0, max_tracked: int = MAX_TRACKED) -> None:
        self.report_period_s = report_period_s
        self.max_tracked = max_tracked
        self._where: OrderedDict[str, Hashable] = OrderedDict()
        self._routes: dict[Hashable, OrderedDict[str, tuple[float, int]]] = {}

    def add(self, request_id: str, replica: Hashable, prefill_tokens: int) -> None:
        """Count ``request_id`` at ``replica`` from now (moved there if it was counted elsewhere)."""
        self.done(request_id)
        self._routes.setdefault(replica, OrderedDict())[request_id] = (time.time(), max(prefill_tokens, 1))
        self._where[request_id] = replica
        if len(self._where) > self.max_tracked:
            self.done(next(iter(self._where)))

    def done(self, request_id: str) -> None:
        """``request_id`` completed (or failed): it no longer counts anywhere."""
        replica = self._where.pop(request_id, None)
        if replica is not None:
            self._routes.get(replica, {}).pop(request_id, None)

    def where(self, request_id: str) -> Hashable | None:
        return self._where.get(request_id)

    def drop(self, replica: Hashable) -> None:
        """Forget a replica that went away."""
        for request_id in self._routes.pop(replica, {}):
            self._where.pop(request_id, None)

    def queued(
        self, replica: Hashable, reported_at: float, reported_prefill: int, prefill_tok_s: float
    ) -> tuple[int, int, int]:
        """What is still queued for prefill at ``replica``: ``(requests sent after its report taken at
        ``reported_at`` (unix time; 0: none), reported prefill tokens left, sent tokens left)``.

        The replica's queue is a FIFO draining at its prefill rate: the report's backlog first, then what
        this router sent since. Each part shrinks with its age instead of counting in full until the next
        report: a report taken while prompts queued would otherwise keep a replica looking busy for a whole
        period after it finished them, and move conversations away from their cached history.
        """
        now = time.time()
        routes = self._routes.get(replica)
        horizon = max(reported_at, now - 2 * self.report_period_s)  # never trust a stale report forever
        while routes and next(iter(routes.values()))[0] < horizon:  # counted by the report, or too old to be
            routes.popitem(last=False)  # still queued; ``where`` still answers for it (no re-counting on a move)
        queued = list(routes.values()) if routes else []  # in routing order, none before the report
        start = min(reported_at, now)  # 0 without a report: nothing reported to drain
        backlog, prev = float(reported_prefill), start
        for routed_at, tokens in queued:
            backlog, prev = max(0.0, backlog - (routed_at - prev) * prefill_tok_s) + tokens, routed_at
        left = max(0.0, backlog - (now - prev) * prefill_tok_s)
        reported_left = max(0.0, reported_prefill - (now - start) * prefill_tok_s)
        return len(queued), int(reported_left), int(max(0.0, left - reported_left))
