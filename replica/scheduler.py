"""Continuous batching: which requests run this step, and how many tokens each computes.

Each step has a token budget (``max_num_batched_tokens``). Running requests go first, in admission order:
decodes take one token, unfinished prefills take the next chunk of their prompt, so long prompts are
chunked and mixed with decodes. When the pool cannot give a running request a block, the newest running
request is preempted: swapped out to host memory when the engine has a swap space and moving its blocks
is cheaper than recomputing them (``preemption_mode`` "auto"; "swap" whenever there is room), else its
blocks are freed and its progress reset, to be recomputed later (often partly from the prefix cache).
A swapped request resumes where it stopped once readmitted: its blocks are copied back in. Waiting
requests are admitted only in steps that preempted nothing, so a preempted request is not immediately
displaced by a newcomer and the step loop cannot thrash.

A request with ``n > 1`` is admitted as one sequence holding ``n`` seats of ``max_num_seqs``; once its
prompt is prefilled the engine calls ``fork`` and its children take the reserved seats. A forked sequence is
scheduled, preempted and recomputed on its own like any request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvmesh.core.engine_config import EngineConfig
from kvmesh.replica.kv_cache_manager import KVCacheManager
from kvmesh.replica.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start: int = 0
    """``num_computed_tokens`` before this step (set at launch): where a failed step rolls back to."""


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: EngineConfig) -> None:
        """Batches over ``kv``'s blocks within the config's ``max_num_seqs`` and ``max_num_batched_tokens``,
        preempting by its ``preemption_mode`` (``EngineConfig`` checked them)."""
        self.kv = kv
        self.preemption_mode = config.preemption_mode
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_loras = config.max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0
        self.num_swapped_in = 0
        self.num_recomputed_tokens = 0
        """Computed tokens thrown away by preemptions that recompute (swapped sequences lose none)."""
        self.prompt_tokens_queried = 0
        self.prompt_tokens_hit = 0
        self.prompt_tokens_hit_host = 0
        """Of ``prompt_tokens_hit``, those loaded back from the host tier."""
        self.requests_admitted = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_tokens = len(req.all_token_ids) + req.num_pending
            if req.num_pending and num_tokens - req.num_prompt_tokens >= req.max_new_tokens:
                i += 1  # the token in flight is its last: nothing left to compute
                continue
            n = min(num_tokens - req.num_computed_tokens, budget)
            if n == 1 and self.kv.has_room_for_one(req):  # a decode within its last block: the usual case
                out.append(ScheduledRequest(req, 1))
                budget -= 1
                i += 1
                continue
            while not self.kv.allocate(req, n):
                victim = self.running.pop()  # the newest running request goes first
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
                continue
            break
        if preempted:
            return out
        seats = sum(r.num_seqs for r in self.running)
        adapters = self._running_adapters()
        passed: list[Request] = []  # waiting on an adapter beyond max_loras: kept in order, for a later step
        while self.waiting and budget > 0 and seats + self.waiting[0].num_seqs <= self.max_num_seqs:
            req = self.waiting[0]
            if adapters is not None and req.lora is not None and req.lora.id not in adapters:
                if len(adapters) >= self.max_loras:
                    passed.append(self.waiting.popleft())
                    continue
                adapters.add(req.lora.id)
            swapped = self.kv.is_swapped(req)
            hits = [] if swapped else self.kv.computed_blocks(req)
            loads = [] if swapped else self.kv.host_hits(req, len(hits))
            num_hit = req.num_computed_tokens if swapped else (len(hits) + len(loads)) * self.kv.block_size
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.allocate(req, n, hits, loads):
                break
            self.waiting.popleft()
            if swapped:
                self.kv.swap_in(req)
                self.num_swapped_in += 1
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:  # count the first admission only, not recomputes
                req.num_cached_tokens = num_hit
                self.prompt_tokens_queried += req.num_tokens
                self.prompt_tokens_hit += num_hit
                self.prompt_tokens_hit_host += len(loads) * self.kv.block_size
                self.requests_admitted += 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seats += req.num_seqs
            out.append(ScheduledRequest(req, n))
            budget -= n
        self.waiting.extendleft(reversed(passed))
        return out

    def _running_adapters(self) -> set[int] | None:
        """The adapters running requests use, where a step's adapters are capped (``max_loras``); else None."""
        if self.max_loras is None:
            return None
        return {r.lora.id for r in self.running if r.lora is not None}

    def fork(self, parent: Request) -> list[Request]:
        """Split ``parent``, whose prompt is now computed, into its ``n`` sequences (``parent`` is sequence 0).

        The children share all of the parent's blocks and run right after it, in admission order, so the
        newest-first preemption order is unchanged. Returns the sequences in index order."""
        children = [parent.fork(i) for i in range(1, parent.params.n)]
        parent.fork_pending = False
        for child in children:
            self.kv.fork(parent, child)
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        return [parent, *children]

    def reset_counters(self) -> None:
        self.num_preemptions = self.prompt_tokens_queried = self.prompt_tokens_hit = self.requests_admitted = 0
        self.prompt_tokens_hit_host = 0
        self.num_swapped_out = self.num_swapped_in = self.num_recomputed_tokens = 0

    def _preempt(self, req: Request) -> None:
        mode = self.preemption_mode
        if mode != "recompute" and self.kv.swap_out(req, force=mode == "swap"):
            self.num_swapped_out += 1
        else:
            self.kv.free(req)
            self.num_recomputed_tokens += req.num_computed_tokens
            req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request (stopped, aborted): its blocks go back to the pool, cached ones stay reusable."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
