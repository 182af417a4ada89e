"""What the engine decides for one step and hands to the device, and what it keeps until the step returns.

The engine schedules a batch, advances its sequences on the host (``Advanced``) and writes a ``StepPlan``:
everything the device work (``replica/device_step.py``) needs, decided up front so that work runs without
reading host state (``sampling_tensors``, ``plan_logits``). ``LaunchedStep`` is the engine's record of a step
in flight, kept to collect it (or undo it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmesh.replica.device_queue import HostLogprobs, StepHandle
from kvmesh.replica.logit_bias import LogitBias
from kvmesh.replica.outputs import token_logprob
from kvmesh.replica.penalties import PenaltyCounts, StepPenalties
from kvmesh.replica.request import Request
from kvmesh.replica.sampler import GREEDY, SamplingColumns, SamplingTensors
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

    def score(self, logprobs: HostLogprobs, base: int) -> None:
        """Append each target's log-probability to its owner's ``prompt_logprobs``; the step's rows for these
        positions are numbered from ``base`` (after its sampling rows)."""
        for j, (req, target) in enumerate(zip(self.owners, self.targets, strict=True)):
            req.prompt_logprobs.append(token_logprob(target, logprobs[base + j], req.params.prompt_logprobs))


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


@dataclass(slots=True)
class Advanced:
    """A batch advanced on the host: the sequences its step samples (forks included), each one's logits row
    and output position, the families it forked, and its token counts."""

    seqs: list[Request] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    forks: list[list[Request]] = field(default_factory=list)
    prefill: int = 0
    decodes: int = 0
    logits_rows: int = 0


def sampling_tensors(seqs: list[Request], positions: list[int], device: torch.device) -> tuple[SamplingTensors, dict]:
    """The step's sampling settings; a row whose settings cannot be turned into tensors is sampled greedily
    and failed when the step is collected (the others are not affected)."""
    params = [r.params for r in seqs]
    if all(p.greedy for p in params):
        return GREEDY, {}
    columns = SamplingColumns.of(params, [r.sample_seed for r in seqs], positions)
    try:
        return SamplingTensors.build(columns, device), {}
    except Exception:
        failures: dict[int, Exception] = {}
        for i in range(len(seqs)):
            try:
                SamplingTensors.build(columns.row(i), device)
            except Exception as exc:
                failures[i] = exc
                columns.neutralise(i)
        return SamplingTensors.build(columns, device), failures


def plan_logits(plan: StepPlan, advanced: Advanced, penalties: PenaltyCounts, device: torch.device) -> None:
    """Fill in the plan's logit work for the sampled sequences: forks' shared rows, biases, grammar masks,
    penalties and log-probabilities."""
    seqs = advanced.seqs
    if len(advanced.rows) > advanced.logits_rows:
        plan.expand = torch.tensor(advanced.rows)
    special = [i for i, seq in enumerate(seqs) if seq.logit_work]  # one scan; most steps find none
    if special:
        plan.bias = LogitBias.build(seqs, advanced.positions, special, device)
        plan.logprob_rows = [i for i in special if seqs[i].params.logprobs is not None]
        plan.top_logprobs = max((seqs[i].params.logprobs for i in plan.logprob_rows), default=0)
        constrained = [i for i in special if seqs[i].matcher is not None]
        if constrained:
            plan.grammar = GrammarRows(constrained, [seqs[i].matcher for i in constrained])
    penalised = [i for i in special if seqs[i].penalty_row >= 0]
    if penalised or penalties.has_work:
        ps = [seqs[i].params for i in penalised]
        slots = [seqs[i].penalty_row for i in penalised]
        presence, frequency = [p.presence_penalty for p in ps], [p.frequency_penalty for p in ps]
        plan.penalties = penalties.step(penalised, slots, presence, frequency)


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
