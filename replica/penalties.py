"""``presence_penalty`` and ``frequency_penalty`` (OpenAI's definition), on the device.

A sampled token's logit drops by ``frequency_penalty x c + presence_penalty x [c > 0]``, where ``c`` counts
that token among the sequence's generated tokens (not the prompt). The counts live on the device: one row of
a ``[rows, vocab]`` tensor per sequence that asks for a penalty, updated from the sampled tokens inside the
step's device work. A step scheduled before the previous one's tokens reach the host (async scheduling)
therefore still sees them: every read and write of the tensor runs in device work, in launch order. The
host only hands out rows, and a row freed by a finished sequence is zeroed by the step that first uses it
again, after every step launched before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepPenalties:
    """One step's penalty work: rows to zero first, then the penalised sampling rows and their settings."""

    capacity: int
    """Rows the counts tensor must have."""
    zero: torch.Tensor | None  # int64 [Z]: count rows given to new sequences
    rows: torch.Tensor | None  # int64 [K]: the step's sampling rows that are penalised
    slots: torch.Tensor | None  # int64 [K]: their count rows
    presence: torch.Tensor | None  # float32 [K, 1]
    frequency: torch.Tensor | None  # float32 [K, 1]


class PenaltyCounts:
    """Each penalised sequence's generated-token counts, on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: torch.Tensor | None = None
        """Grown, zeroed and updated only inside device work (``apply`` and ``count``)."""
        self._free: list[int] = []
        self._size = 0
        self._zero: list[int] = []

    def assign(self) -> int:
        """A count row for a new sequence (zeroed by the next step launched)."""
        row = self._free.pop() if self._free else self._size
        self._size = max(self._size, row + 1)
        self._zero.append(row)
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def step(self, rows: list[int], slots: list[int], presence: list[float], frequency: list[float]) -> StepPenalties:
        """The next launched step's penalty work (``rows`` may be empty: rows assigned since the last step
        are zeroed all the same)."""
        zero, self._zero = self._zero, []

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor | None:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True) if values else None

        f32 = torch.float32
        return StepPenalties(
            self._size,
            tensor(zero, torch.int64),
            tensor(rows, torch.int64),
            tensor(slots, torch.int64),
            tensor(presence, f32)[:, None] if presence else None,
            tensor(frequency, f32)[:, None] if frequency else None,
        )

    @property
    def has_work(self) -> bool:
        """Whether the next step must touch the counts even if none of its rows is penalised."""
        return bool(self._zero)

    # ---------------------------------------------------------------- device work
    def apply(self, step: StepPenalties, logits: torch.Tensor) -> None:
        """Grow and zero rows as ``step`` says, then lower the penalised rows' logits in place."""
        counts = self.counts
        if counts is None or counts.shape[0] < step.capacity:
            rows = max(step.capacity, 2 * (counts.shape[0] if counts is not None else 4))
            grown = torch.zeros(rows, logits.shape[1], device=logits.device)  # as wide as the logits
            if counts is not None:
                grown[: counts.shape[0]] = counts
            self.counts = counts = grown
        if step.zero is not None:
            counts.index_fill_(0, step.zero, 0.0)
        if step.rows is not None:
            c = counts.index_select(0, step.slots)
            drop = c * step.frequency + (c > 0).to(c.dtype) * step.presence
            logits.index_add_(0, step.rows, -drop.to(logits.dtype))

    def count(self, step: StepPenalties, tokens: torch.Tensor) -> None:
        """Add the step's sampled tokens to their sequences' counts."""
        if step.rows is not None:
            ones = torch.ones(step.slots.shape[0], dtype=self.counts.dtype, device=self.counts.device)
            self.counts.index_put_((step.slots, tokens.index_select(0, step.rows)), ones, accumulate=True)
