"""Linear layers with weights prepacked for oneDNN, for models served on the CPU.

``torch.nn.functional.linear`` on the CPU repacks its weight into the GEMM's blocked layout on every call;
for a serving engine, whose weights never change, that is work thrown away on every step (on SmolLM2's
shapes oneDNN on a prepacked weight is 1.2-1.9x faster from 16 to 1,024 rows: ``benchmarks/cpu_linear.py``).
``pack_linears`` replaces each ``nn.Linear`` of a model on the CPU with a ``PackedLinear`` holding its
weight once, in oneDNN's layout (same bytes as before: the dense weight is dropped unless something else,
such as a tied embedding, still holds it).

Where oneDNN is missing or refuses the dtype, the model keeps its plain layers. ``KVMESH_CPU_PACKED_LINEAR=0``
turns packing off.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN's inner-product primitive."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()  # the primitive takes dense rows only
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

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
