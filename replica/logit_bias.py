"""Additive changes to a step's logits before sampling: ``logit_bias`` and the ``min_tokens`` ban.

Built once per step on the host from the rows' settings, as three flat tensors (row, token id, value), and
applied on the logits' device in one ``index_put_``: no per-row work on the device, nothing at all for a
step whose rows ask for neither. A ban is a bias of -inf. Rows are the step's sampling rows, so a fork's
sequences each get their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.replica.request import Request


@dataclass
class LogitBias:
    rows: torch.Tensor  # int64 [K]
    ids: torch.Tensor  # int64 [K]
    values: torch.Tensor  # float32 [K]

    @classmethod
    def build(
        cls, seqs: list[Request], positions: list[int], candidates: list[int], device: torch.device
    ) -> LogitBias | None:
        """For sequence ``seqs[i]`` sampling its output ``positions[i]``, over the rows ``candidates`` (those
        whose requests adjust logits at all); None when none of them asks for a bias or a ban now."""
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for i in candidates:
            seq, position = seqs[i], positions[i]
            params = seq.params
            if params.logit_bias:
                rows += [i] * len(params.logit_bias)
                ids += params.logit_bias.keys()
                values += params.logit_bias.values()
            if position < params.min_tokens and seq.stop_ids:
                rows += [i] * len(seq.stop_ids)
                ids += seq.stop_ids
                values += [-float("inf")] * len(seq.stop_ids)
        if not rows:
            return None

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

        return cls(tensor(rows, torch.int64), tensor(ids, torch.int64), tensor(values, torch.float32))

    def apply(self, logits: torch.Tensor) -> None:
        """Add the biases to ``logits`` ([rows, vocab], fp32) in place."""
        logits.index_put_((self.rows, self.ids), self.values.to(logits.dtype), accumulate=True)
