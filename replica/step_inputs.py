"""A step's inputs: persistent host and device buffers (``StepInputs``) and one step's view of them
(``PreparedStep``), which the model runner fills and the forward pass and CUDA graphs read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvmesh.replica.lora import LoRAStep


@dataclass
class PreparedStep:
    """One step's inputs, ready in their buffers: what ``ModelRunner.forward`` needs besides them."""

    inputs: StepInputs
    n: int
    total: int
    num_logits: int
    qlens: np.ndarray
    slens: np.ndarray
    width: int
    fill: tuple[torch.Tensor, torch.Tensor] | None
    """(token index in the batch, row of the previous step's tokens) of each placeholder input."""
    lora: LoRAStep | None = None
    """The adapters the step's sequences use (``replica/lora.py``); None: all on the base model."""


class StepInputs:
    """Persistent buffers of a step's inputs: filled on the host as numpy arrays (pinned memory on CUDA),
    copied to fixed device buffers once per step. On the CPU both are the same memory: nothing is copied.
    Fixed addresses are also what CUDA graphs replay on."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device) -> None:
        shapes = {
            "input_ids": ((max_tokens,), torch.int64),
            "positions": ((max_tokens,), torch.int64),
            "slot_mapping": ((max_tokens,), torch.int64),
            "logits_rows": ((max_tokens,), torch.int64),
            "query_start_loc": ((max_seqs + 1,), torch.int32),
            "seq_lens": ((max_seqs,), torch.int32),
            "block_tables": ((max_seqs * max_blocks,), torch.int32),
        }
        cuda = device.type == "cuda"
        self._host = {k: torch.zeros(shape, dtype=dt, pin_memory=cuda) for k, (shape, dt) in shapes.items()}
        self._np = {k: t.numpy() for k, t in self._host.items()}
        self._dev = {k: t.to(device) for k, t in self._host.items()} if cuda else self._host
        self._device = device

    def host(self, name: str, n: int, width: int | None = None) -> np.ndarray:
        """The host buffer's first ``n`` entries (``n x width`` for a 2-D view) to fill; grows if needed."""
        size = n * (width or 1)
        if size > len(self._np[name]):
            self._grow(name, size)
        view = self._np[name][:size]
        return view.reshape(n, width) if width else view

    def host_tensor(self, name: str, n: int, width: int | None = None) -> torch.Tensor:
        """The host buffer's filled part as a tensor (pinned on CUDA): a source for device copies."""
        view = self._host[name][: n * (width or 1)]
        return view.view(n, width) if width else view

    def device(self, name: str, n: int, width: int | None = None) -> torch.Tensor:
        """The device copy of what ``host`` filled (the same memory on the CPU)."""
        size = n * (width or 1)
        dev = self._dev[name][:size]
        if dev.data_ptr() != self._host[name].data_ptr():
            dev.copy_(self._host[name][:size], non_blocking=True)
        return dev.view(n, width) if width else dev

    def _grow(self, name: str, size: int) -> None:
        cuda = self._device.type == "cuda"
        host = torch.zeros(max(size, 2 * len(self._np[name])), dtype=self._host[name].dtype, pin_memory=cuda)
        self._host[name], self._np[name] = host, host.numpy()
        if cuda:
            self._dev[name] = host.to(self._device)
