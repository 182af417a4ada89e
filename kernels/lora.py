"""A batch's LoRA updates for one projection, each token through its own adapter (a segmented LoRA op).

``lora_update(y, x, a, b, rows, seg, bounds)``: the tokens ``rows[seg[i]:seg[i+1]]`` use adapter ``i``, with
``a[i]`` [slices * r, in] (each output slice's A, stacked) and ``b[i]`` [r, out] (each slice's scaled B,
transposed, side by side); output slice ``s`` owns columns ``bounds[s]:bounds[s+1]`` and shrink rows
``s*r:(s+1)*r``. A fused projection (q/k/v, gate/up) is one call with one slice per part, so no zero block
of a block-diagonal B is ever multiplied. An adapter without the projection has empty ``a[i]``/``b[i]``.

The torch version is the definition and serves where the compiled ones cannot; on the CPU
``csrc/lora_cpu.cpp`` does every adapter in one call, instead of a handful of torch ops per adapter; with
the Triton kernels (CUDA) ``triton_lora.py`` runs the step's adapters stacked (``replica/lora.py`` picks).
"""

from __future__ import annotations

import torch

from kvmesh.kernels.cpu_extension import DTYPES, cpu_op


def lora_update_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    rows: torch.Tensor,
    seg: list[int],
    bounds: list[int],
) -> None:
    """Add each adapter's update to its tokens' rows of ``y``, in place (``seg`` as a list of ints here)."""
    slices = len(bounds) - 1
    for i, (ai, bi) in enumerate(zip(a, b, strict=True)):
        if ai.numel() == 0 or seg[i] == seg[i + 1]:
            continue
        tokens = rows[seg[i] : seg[i + 1]]
        shrink = x.index_select(0, tokens) @ ai.T
        r = bi.shape[0]
        delta = torch.cat(
            [shrink[:, s * r : (s + 1) * r] @ bi[:, bounds[s] : bounds[s + 1]] for s in range(slices)], dim=1
        )
        y.index_add_(0, tokens, delta)


def lora_update(
    y: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    rows: torch.Tensor,
    seg: torch.Tensor,
    bounds: list[int],
) -> None:
    """``lora_update_torch``, compiled on the CPU (``seg`` an int64 tensor on the CPU)."""
    if x.device.type == "cpu" and x.dtype in DTYPES and (op := cpu_op("lora_update")) is not None:
        op(y, x, a, b, rows, seg, bounds)
    else:
        lora_update_torch(y, x, a, b, rows, seg.tolist(), bounds)
