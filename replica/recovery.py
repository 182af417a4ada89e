"""Failure isolation: a request whose data makes a step fail is failed alone.

The step (and any launched after it, which read its tokens) is undone on the host and its requests run
again one at a time: those that fail alone get an output with ``finish_reason`` "error" and the cause,
every other request exactly the tokens the step would have given it. ``LLMEngine`` mixes this in.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from kvmesh.replica.outputs import RequestOutput
from kvmesh.replica.request import RequestStatus
from kvmesh.replica.scheduler import ScheduledRequest
from kvmesh.replica.step_plan import LaunchedStep, PrepareFailed

if TYPE_CHECKING:
    from kvmesh.replica.engine import LLMEngine

log = logging.getLogger(__name__)


class StepRecovery:
    def _isolate(self: LLMEngine, launched: LaunchedStep, exc: Exception) -> list[RequestOutput]:
        """A step failed on the device: undo it and the step launched on top of it, then run its requests
        one at a time."""
        log.warning("a step of %d requests failed (%r); running them one at a time", len(launched.batch), exc)
        later, self._launched_step = self._launched_step, None
        if later is not None and later is not launched:
            with contextlib.suppress(Exception):
                later.handle.result()
            self._undo(later)
        self._undo(launched)
        return self._run_alone(launched.batch)

    def _run_alone(self: LLMEngine, batch: list[ScheduledRequest]) -> list[RequestOutput]:
        """Run each still-running request of ``batch`` as a step of its own, to completion; a request whose
        step fails is failed."""
        outputs: list[RequestOutput] = []
        for sr in batch:
            req = sr.request
            if req.status is not RequestStatus.RUNNING or req.request_id not in self.requests:
                continue
            try:
                single = self._launch([ScheduledRequest(req, sr.num_new_tokens)])
                single.handle.result()
            except PrepareFailed as err:
                outputs.append(self._fail(req.request_id, err.__cause__))
                continue
            except Exception as err:
                self._undo(single)
                outputs.append(self._fail(req.request_id, err))
                continue
            outputs += self._collect(single)
        return outputs

    def _undo(self: LLMEngine, launched: LaunchedStep) -> None:
        """Take back what launching a step did on the host: pending tokens, forks, computed positions. A
        sequence preempted since is reset to recompute from scratch (what it kept may include the step)."""
        for seq in launched.seqs:
            seq.num_pending -= 1
        for family in launched.forks:
            parent, children = family[0], family[1:]
            for child in children:
                self._end(child, "abort")
            if parent.request_id in self.requests:
                self.requests[parent.request_id] = [parent]
            parent.fork_pending = True
        for sr in launched.batch:
            req = sr.request
            if req.status is RequestStatus.RUNNING:
                req.num_computed_tokens = sr.start
            elif req.status is RequestStatus.WAITING and req.num_computed_tokens:
                self.kv.free(req)
                req.num_computed_tokens = 0

    def _fail(self: LLMEngine, request_id: str, exc: BaseException) -> RequestOutput:
        """End a request (all its sequences) that made the step fail; its output names the cause."""
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
