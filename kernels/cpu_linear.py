"""Linear layers with weights prepacked for oneDNN, for models served on the CPU.

``torch.nn.functional.linear`` on the CPU repacks its weight into the GEMM's blocked layout on every call;
for a serving engine, whose weights never change, that is work thrown away on every step (on SmolLM2's
shapes oneDNN on a prepacked weight is 1.2-1.9x faster from 16 to 1,024 rows: ``benchmarks/cpu_linear.py``).
``pack_linears`` replaces each ``nn.Linear`` of a model on the CPU with a ``PackedLinear`` holding its
weight once, in oneDNN's layout (same bytes as before: the dense weight is dropped unless something else,
such as a tied embedding, still holds it).

Two ways to use the threads: oneDNN's own, or one single-threaded oneDNN call per thread on its share of the
rows (``linear_rows``, ``csrc/linear_cpu.cpp``). On bf16 weights with AMX oneDNN leaves a thread idle on
some shapes (with two threads, SmolLM2's 1,536 -> 576 projection at 512 rows ran no faster than with one),
on others its own split is the faster. Which one serves is measured, not guessed: ``RowSplit`` times both on
the first calls for each weight shape and size of batch (rows, by powers of two) and keeps the faster. The two
can differ in the last bit of a bf16 result, like any change of GEMM blocking.

Where oneDNN is missing or refuses the dtype, the model keeps its plain layers. ``KVMESH_CPU_PACKED_LINEAR=0``
turns packing off.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from kernels.cpu_extension import cpu_op

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)


class RowSplit:
    """Per (weight shape, dtype, threads, rows rounded up to a power of two): whether splitting the rows between
    threads beats oneDNN's own threading, from ``trials`` timings of each on the first calls (the faster's
    best time wins). Shared by every layer of a shape: a model's 30 identical projections decide together."""

    def __init__(self, trials: int = 3, clock: Callable[[], float] = time.perf_counter) -> None:
        self.trials, self.clock = trials, clock
        self.chosen: dict[tuple, bool] = {}
        self._times: dict[tuple, tuple[list[float], list[float]]] = {}

    def run(self, key: tuple, call: Callable[[bool], torch.Tensor]) -> torch.Tensor:
        """``call(split)``'s result, with ``split`` the measured choice for ``key`` (or the next one to time)."""
        split = self.chosen.get(key)
        if split is not None:
            return call(split)
        own, rows = self._times.setdefault(key, ([], []))
        split = len(rows) < len(own)
        start = self.clock()
        out = call(split)
        (rows if split else own).append(self.clock() - start)
        if len(own) >= self.trials and len(rows) >= self.trials:
            self.chosen[key] = min(rows) < min(own)
            del self._times[key]
        return out


ROW_SPLIT = RowSplit()
MIN_ROWS = 16
"""Rows each thread takes at least (an AMX tile's height); fewer rows run as one call."""


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN's inner-product primitive; its threads used as
    ``ROW_SPLIT`` measured to be faster."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._rows_op = cpu_op("linear_rows")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()  # the primitive takes dense rows only
        threads, rows = torch.get_num_threads(), flat.shape[0]
        if self._rows_op is None or threads < 2 or rows < 2 * MIN_ROWS:
            y = self.run(flat, split=False)
        else:
            key = (self.in_features, self.out_features, flat.dtype, threads, rows.bit_length())
            y = ROW_SPLIT.run(key, lambda split: self.run(flat, split))
        return y.view(*x.shape[:-1], self.out_features)

    def run(self, flat: torch.Tensor, split: bool) -> torch.Tensor:
        """``flat @ W.T + b`` for dense rows, with oneDNN's threading or (``split``) the rows shared out."""
        if not split:
            return torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        out = flat.new_empty(flat.shape[0], self.out_features)
        self._rows_op(out, flat, self.packed, self.bias, MIN_ROWS)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_enabled(weight: torch.Tensor) -> bool:
    """Whether ``pack_linears`` applies to a model whose parameters look like ``weight``."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and os.environ.get("KVMESH_CPU_PACKED_LINEAR", "1") != "0"
    )


@torch.inference_mode()
def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` (on the CPU) by a ``PackedLinear``; returns how many.

    Each packed layer is checked once against ``F.linear`` on a random input; a layer oneDNN computes
    differently (it should not) or refuses stays as it was, so packing can only change speed.
    """
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if not linears or not packing_enabled(linears[0][1].weight):
        return 0
    packed = 0
    for name, linear in linears:
        try:
            layer = PackedLinear(linear)
            probe = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
            expected = nn.functional.linear(probe, linear.weight, linear.bias)
            tol = 1e-4 if linear.weight.dtype == torch.float32 else 3e-2
            if not torch.allclose(layer(probe), expected, rtol=tol, atol=tol * float(expected.abs().max())):
                raise RuntimeError("results differ from F.linear")
        except RuntimeError as exc:
            log.warning("keeping %s unpacked: %s", name, exc)
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
        packed += 1
    return packed
