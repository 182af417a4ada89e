"""Linear layers with weights prepacked for oneDNN, for models served on the CPU.

``torch.nn.functional.linear`` on the CPU repacks its weight into the GEMM's blocked layout on every call;
for a serving engine, whose weights never change, that is work thrown away on every step (measured by
``kvmesh bench cpu_linear``; figures in ``benchmarks/results/README.md``).
``pack_linears`` replaces each ``nn.Linear`` of a model on the CPU with a ``PackedLinear`` holding its
weight in oneDNN's layout (the dense weight is dropped unless something else, such as a tied embedding,
still holds it) and, in float32, a second copy in 32-column panels for ``linear_panels``
(``csrc/panel_linear_cpu.cpp``, on CPUs with AVX-512): float32 weights then take twice their size
(``KVMESH_CPU_PANELS=0``: once).

Three ways to compute a layer, and which serves is measured, not guessed: ``FastestWay`` times each on the
first calls for each weight shape and size of batch (rows, by powers of two) and keeps the fastest.

- ``onednn``: oneDNN's own threads.
- ``rows``: one single-threaded oneDNN call per thread on its share of the rows (``linear_rows``,
  ``csrc/linear_cpu.cpp``). On bf16 weights with AMX oneDNN leaves a thread idle on some shapes (with two
  threads, SmolLM2's 1,536 -> 576 projection at 512 rows ran no faster than with one).
- ``panels`` (float32): a decode step reads every weight once, more than stays in the caches between steps,
  and oneDNN's GEMM does not hide that stream behind its arithmetic; the panel kernel prefetches the next
  panel while one computes (faster on decode-sized batches: ``kvmesh bench cpu_linear
  --decode-step``). oneDNN stays faster on prefill-sized batches.

The ways can differ in the last bits of a result, like any change of GEMM blocking.

Where oneDNN is missing or refuses the dtype, the model keeps its plain layers. ``KVMESH_CPU_PACKED_LINEAR=0``
turns packing off.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kvmesh.kernels.cpu_extension import cpu_op

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)


class FastestWay:
    """Per (weight shape, dtype, threads, rows rounded up to a power of two): which way of computing a linear
    layer is fastest, from ``trials`` timings of each on the first calls (the best time wins; every call is
    served while timing). Shared by every layer of a shape: a model's 30 identical projections decide
    together."""

    def __init__(self, trials: int = 3, clock: Callable[[], float] = time.perf_counter) -> None:
        self.trials, self.clock = trials, clock
        self.chosen: dict[tuple, str] = {}
        self._times: dict[tuple, dict[str, list[float]]] = {}

    def run(self, key: tuple, ways: Sequence[str], call: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """``call(way)``'s result, with ``way`` the measured choice for ``key`` among ``ways`` (or the next
        one to time: the least timed so far, in the given order)."""
        way = self.chosen.get(key)
        if way is not None:
            return call(way)
        times = self._times.setdefault(key, {w: [] for w in ways})
        way = min(ways, key=lambda w: len(times[w]))
        start = self.clock()
        out = call(way)
        times[way].append(self.clock() - start)
        if all(len(t) >= self.trials for t in times.values()):
            self.chosen[key] = min(times, key=lambda w: min(times[w]))
            del self._times[key]
        return out


FASTEST = FastestWay()
MIN_ROWS = 16
"""Rows each thread takes at least in the rows-shared way (an AMX tile's height)."""
PANEL_MAX_ROWS = 128
"""The most rows the panel kernel is offered for: from 256 rows oneDNN is faster even on weights streamed from
memory (``benchmarks/results/README.md``), so timing it there could only mislead the choice."""


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN's inner-product primitive and, in float32, also in
    32-column panels; each call served by whichever way ``FASTEST`` measured fastest for its shape and batch
    size: ``onednn`` (oneDNN's threads), ``rows`` (the rows shared out between threads, one oneDNN call each)
    or ``panels`` (``linear_panels``)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self._rows_op = cpu_op("linear_rows")
        self._panels_op = cpu_op("linear_panels") if panels_enabled(weight) else None
        self.panels = cpu_op("pack_panels")(weight) if self._panels_op is not None else None

    def ways(self, rows: int, threads: int, panel_cap: int = PANEL_MAX_ROWS) -> list[str]:
        """The ways that may serve ``rows`` rows on ``threads`` threads, oneDNN's own first."""
        ways = ["onednn"]
        if self._rows_op is not None and threads >= 2 and rows >= 2 * MIN_ROWS:
            ways.append("rows")
        if self.panels is not None and rows <= panel_cap:
            ways.append("panels")
        return ways

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()  # the kernels take dense rows only
        threads, rows = torch.get_num_threads(), flat.shape[0]
        key = (self.in_features, self.out_features, flat.dtype, threads, rows.bit_length())
        way = FASTEST.chosen.get(key)  # measured already: the common case, kept cheap
        if way is not None:
            y = self.run(flat, way)
        else:
            y = FASTEST.run(key, self.ways(rows, threads), functools.partial(self.run, flat))
        return y.view(*x.shape[:-1], self.out_features)

    def run(self, flat: torch.Tensor, way: str) -> torch.Tensor:
        """``flat @ W.T + b`` for dense rows, computed the given way (one of ``ways``)."""
        if way == "onednn":
            return torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        out = flat.new_empty(flat.shape[0], self.out_features)
        if way == "rows":
            self._rows_op(out, flat, self.packed, self.bias, MIN_ROWS)
        else:
            self._panels_op(out, flat, self.panels, self.bias)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def panels_enabled(weight: torch.Tensor) -> bool:
    """Whether a packed layer also keeps its weight in panels: float32 on a CPU with AVX-512 (the kernel keeps
    24 accumulators of 16 floats in registers, more than AVX2's 16 registers hold). A second copy of the
    weight: ``KVMESH_CPU_PANELS=0`` saves that memory and gives up the way."""
    return (
        weight.dtype == torch.float32
        and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        and os.environ.get("KVMESH_CPU_PANELS", "1") != "0"
    )


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
            probe = torch.randn(2 * MIN_ROWS, linear.in_features, dtype=linear.weight.dtype)
            expected = nn.functional.linear(probe, linear.weight, linear.bias)
            tol = 1e-4 if linear.weight.dtype == torch.float32 else 3e-2
            for way in layer.ways(len(probe), torch.get_num_threads()):
                got = layer.run(probe, way)
                if not torch.allclose(got, expected, rtol=tol, atol=tol * float(expected.abs().max())):
                    raise RuntimeError(f"the {way} way's results differ from F.linear")
        except RuntimeError as exc:
            log.warning("keeping %s unpacked: %s", name, exc)
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
        packed += 1
    return packed
