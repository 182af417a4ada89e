"""What the engine decides for one step and hands to the device, and what it keeps until the step returns.

The engine schedules a batch, advances its sequences on the host and writes a ``StepPlan``: everything the
device work (``kvmesh/replica/device_step.py``) needs, decided up front so that work runs without reading
host state. ``LaunchedStep`` is the engine's record of a step in flight, kept to collect it (or undo it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.replica.device_queue import StepHandle
from kvmesh.replica.logit_bias import LogitBias
from kvmesh.replica.penalties import StepPenalties
from kvmesh.replica.request import Request
from kvmesh.replica.sampler import SamplingTensors
from kvmesh.replica.scheduler import ScheduledRequest
from kvmesh.replica.step_inputs import PreparedStep
from kvmesh.replica.structured import GrammarRows
from kvmesh.replica.swap import SwapCopies


@dataclass(slots=True, kw_only=True)
class PromptRows:
    """The prompt positions of a step whose log-probabilities requests asked for (``prompt_logprobs``): the
    logits at ``rows`` (flattened batch positions, returned after the sampling rows) score ``targets``, the
    prompt tokens that follow them, for ``owners``; ``k`` alternatives, the most any of them asked for."""

    rows: list[int]
    targets: list[int]
    owners: list[Request]
    k: int


def prompt_rows(batch: list[ScheduledRequest]) -> PromptRows | None:
    """The positions of ``batch`` (before it advances) whose logits score a prompt token that a request
    wants the log-probability of and has not been given yet."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[Request] = []
    k, offset = 0, 0
    for sr in batch:
        req, n = sr.request, sr.num_new_tokens
        want = req.params.prompt_logprobs
        if want is not None:
            start, prompt = req.num_computed_tokens, req.prompt_token_ids
            first = max(start, len(req.prompt_logprobs))  # position p scores token p + 1
            last = min(start + n, len(prompt) - 1)
            if first < last:
                rows += range(offset + first - start, offset + last - start)
                targets += prompt[first + 1 : last + 1]
                owners += [req] * (last - first)
                k = max(k, want)
        offset += n
    return PromptRows(rows=rows, targets=targets, owners=owners, k=k) if rows else None


@dataclass(slots=True, kw_only=True)
class StepPlan:
    """One step's device work, in the order it runs. Who sets each field is named beside it."""

    prepared: PreparedStep
    """The forward pass's inputs (``ModelRunner.prepare``)."""
    copies: list[tuple[int, int]]
    """Copy-on-write block copies, source -> destination (``KVCacheManager.take_copies``)."""
    swaps: SwapCopies | None
    """Blocks to move out to and in from the host tier, before the forward pass (``SwapSpace.take``)."""
    sampling: SamplingTensors
    """Per-row sampling settings (the engine, from its sequences' params)."""
    expand: torch.Tensor | None = None
    """The logits row of each sampled sequence, when forks share their parent's row (the engine)."""
    bias: LogitBias | None = None
    """``logit_bias`` and ``min_tokens`` bans (the engine, for rows that ask)."""
    penalties: StepPenalties | None = None
    """Presence / frequency penalties (``PenaltyCounts.step``)."""
    grammar: GrammarRows | None = None
    """Structured-output masks (the engine, for rows with a grammar)."""
    logprob_rows: list[int] = field(default_factory=list)
    """Sampling rows that report the sampled token's log-probability (the engine)."""
    top_logprobs: int = 0
    """Alternatives to report per row: the most any of ``logprob_rows`` asked for."""
    prompt: PromptRows | None = None
    """Prompt positions to score (``prompt_rows``); their logits follow the sampling rows."""


@dataclass(slots=True, kw_only=True)
class LaunchedStep:
    """A step handed to the device and not collected yet."""

    batch: list[ScheduledRequest]
    seqs: list[Request]
    """The sequences this step samples, in the order of its tokens."""
    forks: list[list[Request]]
    """Families forked when it was launched (parent first)."""
    handle: StepHandle
    t0: float
    prefill: int
    decodes: int
    failures: dict[int, Exception]
    """Rows already known to fail (their settings), by row."""
    prompt: PromptRows | None = None
    ran_s: float | None = None
    """Its time, when the device ran it inside its launch (the CPU's inline queue); None: timed on collection."""


class PrepareFailed(Exception):
    """A step's inputs could not be built: nothing was launched or changed."""

    def __init__(self, batch: list[ScheduledRequest]) -> None:
        super().__init__(f"preparing a step of {len(batch)} requests failed")
        self.batch = batch
