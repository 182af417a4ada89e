"""A step's device work, in launch order (``replica/device_queue.py`` runs it): block copies, the
forward pass, logit biases, penalties and grammar masks, sampling (then the penalty counts), and the
log-probabilities a step's plan asks for. It reads only its ``StepPlan`` and device state, never the
engine's host state, so it can run while the host prepares the next step."""

from __future__ import annotations

import logging

import torch

from kvmesh.replica.device_queue import StepLogprobs, StepResult
from kvmesh.replica.model_runner import ModelRunner
from kvmesh.replica.penalties import PenaltyCounts
from kvmesh.replica.sampler import SamplingTensors, sample
from kvmesh.replica.step_plan import StepPlan
from kvmesh.replica.swap import SwapSpace

log = logging.getLogger(__name__)


class DeviceStep:
    def __init__(self, runner: ModelRunner, swap: SwapSpace | None, penalties: PenaltyCounts) -> None:
        self.runner, self.swap, self.penalties = runner, swap, penalties
        self.last_tokens: torch.Tensor | None = None
        """The tokens of the last step run (a decode's input is read from them on the device)."""

    def __call__(self, plan: StepPlan) -> StepResult:
        """The step's tokens, the rows that failed alone (token 0 and their exception), and the requested
        log-probabilities: sampled rows first, then the prompt positions' rows numbered after them."""
        self._move_blocks(plan)
        logits = self.runner.forward(plan.prepared, self.last_tokens)
        prompt_lp = None
        if plan.prompt is not None:  # the prompt positions' rows come after the sampling rows
            count = len(plan.prompt.rows)
            prompt_lp = torch.log_softmax(logits[-count:].float(), dim=-1)
            logits = logits[:-count]
        if plan.expand is not None:
            logits = logits[plan.expand.to(logits.device)]
        raw = None
        if plan.logprob_rows:  # from the raw logits: before biases and the sampler's in-place scaling
            picked = torch.tensor(plan.logprob_rows, device=logits.device)
            raw = torch.log_softmax(logits[picked].float(), dim=-1)
        self._shape(plan, logits)
        tokens, failures = _sample(logits, plan.sampling)
        self.last_tokens = tokens
        if plan.penalties is not None:
            self.penalties.count(plan.penalties, tokens)
        if plan.grammar is not None:
            failures.update(plan.grammar.accept(tokens))
        return tokens, failures, _logprobs(plan, tokens, raw, prompt_lp)

    def _move_blocks(self, plan: StepPlan) -> None:
        if plan.swaps is not None:
            self.swap.copy_out(plan.swaps)  # before anything writes the blocks they leave
        self.runner.copy_blocks(plan.copies)
        if plan.swaps is not None:
            self.swap.copy_in(plan.swaps)
            for _, device_ids in plan.swaps.ins:
                self.runner.forget_key_tails(torch.tensor(device_ids))

    def _shape(self, plan: StepPlan, logits: torch.Tensor) -> None:
        """Biases, penalties and grammar masks, in place."""
        if plan.bias is not None:
            plan.bias.apply(logits)
        if plan.penalties is not None:
            self.penalties.apply(plan.penalties, logits)
        if plan.grammar is not None:
            plan.grammar.mask(logits)


def _sample(logits: torch.Tensor, sampling: SamplingTensors) -> tuple[torch.Tensor, dict[int, Exception]]:
    """The batch's tokens; if the batch fails, row by row, each failing row alone getting token 0."""
    try:
        return sample(logits, sampling), {}
    except Exception as exc:
        log.warning("sampling %d rows failed (%r); sampling them one at a time", logits.shape[0], exc)
    failures: dict[int, Exception] = {}
    tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    for i in range(logits.shape[0]):
        try:
            tokens[i] = sample(logits[i : i + 1], sampling.row(i))[0]
        except Exception as row_exc:
            failures[i] = row_exc
    return tokens, failures


def _logprobs(
    plan: StepPlan, tokens: torch.Tensor, raw: torch.Tensor | None, prompt_lp: torch.Tensor | None
) -> StepLogprobs | None:
    """The scored tokens' log-probabilities and the top alternatives of every reported row."""
    if raw is None and prompt_lp is None:
        return None
    k = max(plan.top_logprobs, plan.prompt.k if prompt_lp is not None else 0)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (log-probabilities, scored token) per row
    rows = list(plan.logprob_rows)
    if raw is not None:
        parts.append((raw, tokens[torch.tensor(plan.logprob_rows, device=tokens.device)]))
    if prompt_lp is not None:
        targets = torch.tensor(plan.prompt.targets, device=prompt_lp.device)
        parts.append((prompt_lp, targets))
        rows += range(tokens.shape[0], tokens.shape[0] + prompt_lp.shape[0])
    values = torch.cat([lp for lp, _ in parts])
    scored = torch.cat([ids for _, ids in parts])
    top, top_ids = values.topk(k, dim=-1) if k else (values[:, :0], values[:, :0].long())
    return StepLogprobs(rows, values.gather(1, scored[:, None])[:, 0], top_ids, top)
