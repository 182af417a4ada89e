"""Failure isolation: a request whose data makes a step fail is failed alone.

The step (and any launched after it, which read its tokens) is undone on the host and its requests run
again one at a time: those that fail alone get an output with ``finish_reason`` "error" and the cause,
every other request exactly the tokens the step would have given it. The engine builds a ``StepRecovery``
with what it needs (the live requests, the KV manager, and the engine's own launch and collect) and calls
``isolate`` when a step fails on the device, ``run_alone`` when its inputs could not even be prepared.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from kvmesh.replica.kv_cache_manager import KVCacheManager
from kvmesh.replica.live_requests import LiveRequests
from kvmesh.replica.outputs import RequestOutput
from kvmesh.replica.request import RequestStatus
from kvmesh.replica.scheduler import ScheduledRequest
from kvmesh.replica.step_plan import LaunchedStep, PrepareFailed

log = logging.getLogger(__name__)


class StepRecovery:
    def __init__(
        self,
        *,
        live: LiveRequests,
        kv: KVCacheManager,
        launch: Callable[[list[ScheduledRequest]], LaunchedStep],
        collect: Callable[[LaunchedStep], list[RequestOutput]],
    ) -> None:
        """``launch`` runs a given batch as a step (raising ``PrepareFailed`` if its inputs cannot be built);
        ``collect`` turns a step's tokens into outputs."""
        self.live, self.kv, self.launch, self.collect = live, kv, launch, collect

    def isolate(self, failed: LaunchedStep, later: LaunchedStep | None, exc: Exception) -> list[RequestOutput]:
        """``failed`` failed on the device: undo it and ``later`` (the step launched on top of it, if any), then
        run its requests one at a time."""
        log.warning("a step of %d requests failed (%r); running them one at a time", len(failed.batch), exc)
        if later is not None:
            with contextlib.suppress(Exception):
                later.handle.result()
            self._undo(later)
        self._undo(failed)
        return self.run_alone(failed.batch)

    def run_alone(self, batch: list[ScheduledRequest]) -> list[RequestOutput]:
        """Run each still-running request of ``batch`` as a step of its own, to completion; a request whose
        step fails is failed."""
        outputs: list[RequestOutput] = []
        for sr in batch:
            req = sr.request
            if req.status is not RequestStatus.RUNNING or req.request_id not in self.live.requests:
                continue
            try:
                single = self.launch([ScheduledRequest(req, sr.num_new_tokens)])
                single.handle.result()
            except PrepareFailed as err:
                outputs.append(self.live.fail(req.request_id, err.__cause__))
                continue
            except Exception as err:
                self._undo(single)
                outputs.append(self.live.fail(req.request_id, err))
                continue
            outputs += self.collect(single)
        return outputs

    def _undo(self, launched: LaunchedStep) -> None:
        """Take back what launching a step did on the host: pending tokens, forks, computed positions. A
        sequence preempted since is reset to recompute from scratch (what it kept may include the step)."""
        for seq in launched.seqs:
            seq.num_pending -= 1
        for family in launched.forks:
            self.live.unfork(family)
        for sr in launched.batch:
            req = sr.request
            if req.status is RequestStatus.RUNNING:
                req.num_computed_tokens = sr.start
            elif req.status is RequestStatus.WAITING and req.num_computed_tokens:
                self.kv.free(req)
                req.num_computed_tokens = 0
