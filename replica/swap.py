"""The host-memory swap tier: where a preempted sequence's KV blocks wait instead of being recomputed.

Preemption frees a running sequence's device blocks when the pool runs dry. Recomputing its tokens later
costs a prefill of all of them; copying its blocks out to host memory and back costs two copies of its
bytes. ``SwapSpace.worth_it`` compares the two with this replica's own numbers (the host copy bandwidth
measured at start-up, the engine's measured prefill rate), so long sequences swap and short ones, for
which a recompute is nearly free, do not. The pool is bounded (``swap_space_bytes``); when it is full the
sequence is recomputed as before.

Copies are queued during scheduling and run by the engine before the step's forward pass: swap-outs first
(their device blocks may already be handed to other sequences this step, but nothing writes them before
the forward pass), then copy-on-write copies, then swap-ins into freshly allocated blocks. They run where
the step runs (``replica/device_queue.py``), after every step launched before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.quant import as_bytes
from replica.context import LayerCache


@dataclass
class SwapCopies:
    """One step's swap copies: ``(device ids, host ids)`` out, then ``(host ids, device ids)`` in."""

    outs: list[tuple[list[int], list[int]]]
    ins: list[tuple[list[int], list[int]]]


class SwapSpace:
    def __init__(self, device_caches: list[LayerCache], num_blocks: int, prefill_tok_s: Callable[[], float]) -> None:
        if num_blocks < 1:
            raise ValueError(f"a swap space needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._device = [[as_bytes(t) for t in layer.per_block()] for layer in device_caches]
        pin = self._device[0][0].is_cuda
        self._host = [
            [torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in layer]
            for layer in self._device
        ]
        self.block_bytes = sum(t[0].numel() * t.element_size() for layer in self._device for t in layer)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._outs: list[tuple[list[int], list[int]]] = []
        self._ins: list[tuple[list[int], list[int]]] = []
        self._prefill_tok_s = prefill_tok_s
        self.copy_bytes_s = self._measure_bandwidth()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def worth_it(self, num_tokens: int, num_blocks: int) -> bool:
        """Whether moving ``num_blocks`` out and back is cheaper than recomputing ``num_tokens`` (and fits)."""
        swap_s = 2 * num_blocks * self.block_bytes / self.copy_bytes_s
        return num_blocks <= self.num_free and swap_s < num_tokens / self._prefill_tok_s()

    def swap_out(self, device_ids: list[int]) -> list[int]:
        """Reserve host blocks for ``device_ids`` and queue the copy out; returns the host block ids."""
        host_ids = [self._free.pop() for _ in device_ids]
        self._outs.append((device_ids, host_ids))
        return host_ids

    def swap_in(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Queue the copy of ``host_ids`` back into ``device_ids``; the host blocks free once it has run."""
        self._ins.append((host_ids, device_ids))

    def discard(self, host_ids: list[int]) -> None:
        """Give back the host blocks of a swapped sequence that will never come back (aborted)."""
        self._free += host_ids

    def take(self) -> SwapCopies:
        """The copies queued since the last call, to run in order before the step's forward pass. The host
        blocks swapped in are free again from here: a later swap-out may take them, and its copy runs after."""
        copies = SwapCopies(self._outs, self._ins)
        self._outs, self._ins = [], []
        for host_ids, _ in copies.ins:
            self._free += host_ids
        return copies

    def copy_out(self, copies: SwapCopies) -> None:
        """Device work, before anything writes the blocks the swapped sequences leave."""
        for device_ids, host_ids in copies.outs:
            self._copy(self._device, device_ids, self._host, host_ids)

    def copy_in(self, copies: SwapCopies) -> None:
        """Device work, into the blocks the readmitted sequences were just given."""
        for host_ids, device_ids in copies.ins:
            self._copy(self._host, host_ids, self._device, device_ids)

    def check_integrity(self, held: int) -> None:
        """Free + held by swapped sequences == total, with no block counted twice."""
        assert len(set(self._free)) == len(self._free) and len(self._free) + held == self.num_blocks

    @staticmethod
    def _copy(src: list[list[torch.Tensor]], src_ids: list[int], dst: list[list[torch.Tensor]], dst_ids: list[int]):
        src_index = torch.tensor(src_ids, device=src[0][0].device)
        dst_index = torch.tensor(dst_ids, device=dst[0][0].device)
        for src_layer, dst_layer in zip(src, dst, strict=True):
            for s, d in zip(src_layer, dst_layer, strict=True):
                d.index_copy_(0, dst_index, s.index_select(0, src_index).to(d.device, non_blocking=True))
        if dst[0][0].is_cuda or src[0][0].is_cuda:
            torch.cuda.current_stream().synchronize()

    def _measure_bandwidth(self) -> float:
        """Host copy bandwidth (bytes/s) of a swap-sized copy: one block out of every tensor, timed."""
        n = min(self.num_blocks, 8)
        ids = list(range(n))
        self._copy(self._device, ids, self._host, ids)  # first touch of the host pages is not a copy's cost
        start = time.perf_counter()
        self._copy(self._device, ids, self._host, ids)
        return max(n * self.block_bytes / max(time.perf_counter() - start, 1e-6), 1e6)
