"""Where a step's device work runs: in launch order, while the host goes on with the next step.

The engine hands each step's device work (block copies, the forward pass, sampling) to ``submit`` and gets
a handle; ``result()`` gives the sampled tokens on the host. On CUDA the work is launched from the calling
thread and runs on the current stream (kernels are asynchronous); its tokens are copied to pinned memory
behind an event. On the CPU, with ``overlap``, it runs in one worker thread: torch releases the GIL inside
its kernels, so the host schedules the next step and turns the last one's tokens into outputs meanwhile.
Without ``overlap`` (or for the engine's synchronous paths) it runs inline. Either way, work runs strictly
in submission order, which is what makes freeing and reusing blocks between steps safe.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch


@dataclass
class StepLogprobs:
    """Log-probabilities of some rows of a step, on the device: ``rows`` [L], the sampled tokens'
    ``chosen`` [L], and each row's ``top_ids`` / ``top`` [L, K] (K may be 0)."""

    rows: list[int]
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top: torch.Tensor

    def to_host(self) -> dict[int, tuple[float, list[int], list[float]]]:
        """Row -> (sampled token's logprob, top ids, top logprobs)."""
        chosen, ids, top = self.chosen.tolist(), self.top_ids.tolist(), self.top.tolist()
        return {row: (chosen[i], ids[i], top[i]) for i, row in enumerate(self.rows)}


StepResult = tuple[torch.Tensor, dict[int, Exception], StepLogprobs | None]
"""A step's sampled token ids (device tensor), the rows whose sampling failed, by row, and the
log-probabilities of the rows that asked for them."""
HostLogprobs = dict[int, tuple[float, list[int], list[float]]]


class StepHandle:
    """The tokens of one submitted step, on the host once ``result()`` returns."""

    def __init__(self, future: Future | None = None) -> None:
        self._future = future
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._failures: dict[int, Exception] = {}
        self._logprobs: StepLogprobs | None = None
        self._error: BaseException | None = None

    @property
    def ran_inline(self) -> bool:
        """Whether the work ran to its end inside ``submit`` (the CPU without a worker thread)."""
        return self._future is None and self._event is None

    def result(self) -> tuple[list[int], dict[int, Exception], HostLogprobs]:
        """Token ids by row, the rows whose sampling failed and the log-probabilities of the rows that asked
        (by row); raises what the device work raised."""
        if self._future is not None:
            tokens, failures, logprobs = self._future.result()
            return tokens.tolist(), failures, logprobs.to_host() if logprobs is not None else {}
        if self._error is not None:
            raise self._error
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist(), self._failures, self._logprobs.to_host() if self._logprobs is not None else {}


class DeviceQueue:
    def __init__(self, device: torch.device, worker_thread: bool, torch_threads: int | None = None) -> None:
        self.device = device
        self._worker = None
        if worker_thread and device.type == "cpu":
            self._worker = ThreadPoolExecutor(
                1, thread_name_prefix="kvmesh-device", initializer=_init_worker, initargs=(torch_threads,)
            )

    def submit(self, work: Callable[[], StepResult]) -> StepHandle:
        if self._worker is not None:
            return StepHandle(self._worker.submit(_in_inference_mode, work))
        handle = StepHandle()
        try:
            tokens, handle._failures, handle._logprobs = _in_inference_mode(work)
        except Exception as exc:  # raised where the caller collects the step, as from the worker
            handle._error = exc
            return handle
        if tokens.is_cuda:
            handle._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            handle._host.copy_(tokens, non_blocking=True)
            handle._event = torch.cuda.Event()
            handle._event.record()
        else:
            handle._host = tokens
        return handle

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


def _init_worker(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)  # OpenMP's thread count is per thread: set it in the worker too


def _in_inference_mode(work: Callable[[], StepResult]) -> StepResult:
    with torch.inference_mode():
        return work()
