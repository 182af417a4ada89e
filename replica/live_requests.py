"""The engine's live requests, and what starts and ends them.

A request is live from ``admit`` until its last sequence ends: it stopped (``retire``), was aborted, or its
data made a step fail (``fail``). Ending a sequence gives back its blocks (the scheduler) and its penalty
row. A request with ``n > 1`` is one sequence until its prompt is prefilled; ``fork`` then splits it into its
``n`` sequences, and ``unfork`` takes that back when the step that forked it is undone (``recovery.py``).
"""

from __future__ import annotations

import logging

from kvmesh.replica.outputs import RequestOutput
from kvmesh.replica.penalties import PenaltyCounts
from kvmesh.replica.request import Request
from kvmesh.replica.scheduler import Scheduler
from kvmesh.replica.structured import GrammarCompiler

log = logging.getLogger(__name__)


class LiveRequests:
    def __init__(self, scheduler: Scheduler, penalties: PenaltyCounts, grammars: GrammarCompiler) -> None:
        self.scheduler, self.penalties, self.grammars = scheduler, penalties, grammars
        self.requests: dict[str, list[Request]] = {}
        """Each live request's unfinished sequences (one, or up to ``n`` once forked)."""
        self.prompt_logprob_ids: set[str] = set()
        """Live requests that report their prompt's log-probabilities: only then are batches scanned for them."""

    def admit(self, req: Request) -> None:
        """Queue a new request, with its grammar's matcher and a penalty row if its parameters ask for them."""
        params = req.params
        if params.json_schema is not None:
            req.matcher = self.grammars.matcher(params.json_schema)
        if params.presence_penalty or params.frequency_penalty:
            req.penalty_row = self.penalties.assign()
        if params.prompt_logprobs is not None:
            self.prompt_logprob_ids.add(req.request_id)
        self.requests[req.request_id] = [req]
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """End a request (all its sequences) at once; False if unknown or finished."""
        seqs = self.requests.pop(request_id, None)
        if seqs is None:
            return False
        for req in seqs:
            self._end(req, "abort")
        return True

    def fork(self, req: Request) -> list[Request]:
        """Split ``req``, whose prompt is computed, into its ``n`` sequences (``req`` first)."""
        family = self.scheduler.fork(req)
        for child in family[1:]:
            if child.penalty_row >= 0:  # its own counts (still empty: forks come before any output)
                child.penalty_row = self.penalties.assign()
        self.requests[req.request_id] = list(family)
        return family

    def unfork(self, family: list[Request]) -> None:
        """Take back a ``fork``: the children end, the parent is one sequence again, to fork later."""
        parent = family[0]
        for child in family[1:]:
            self._end(child, "abort")
        if parent.request_id in self.requests:
            self.requests[parent.request_id] = [parent]
        parent.fork_pending = True

    def retire(self, req: Request) -> None:
        """A sequence stopped: free its blocks; the request ends with its last sequence."""
        self._end(req, req.finish_reason)
        seqs = self.requests[req.request_id]
        seqs.remove(req)
        if not seqs:
            del self.requests[req.request_id]

    def fail(self, request_id: str, exc: BaseException) -> RequestOutput:
        """End a request (all its sequences) that made a step fail; its output names the cause."""
        seqs = self.requests.pop(request_id, [])
        for req in seqs:
            self._end(req, "error")
        log.warning("request %s failed in the engine: %r", request_id, exc)
        req = seqs[0] if seqs else None
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=req.prompt_token_ids if req else [],
            token_ids=req.output_token_ids if req else [],
            text=req.detokenizer.text if req else "",
            delta_text="",
            delta_token_ids=[],
            num_cached_tokens=max(req.num_cached_tokens, 0) if req else 0,
            finish_reason="error",
            index=req.index if req else 0,
            error=f"{type(exc).__name__}: {exc}"[:500],
        )

    def _end(self, req: Request, reason: str | None) -> None:
        """Finish a sequence in the scheduler (its blocks) and free its penalty counts."""
        self.scheduler.finish(req, reason)
        self.prompt_logprob_ids.discard(req.request_id)
        if req.penalty_row >= 0:
            self.penalties.release(req.penalty_row)
            req.penalty_row = -1
