"""The model's elementwise layers: RMSNorm (alone and fused with the residual add), SiLU-and-mul, rotary.

The torch versions are the definition (Hugging Face's Llama arithmetic) and serve on CUDA, where they are
captured into CUDA graphs. On the CPU the compiled versions (``csrc/layers_cpu.cpp``) do each in one pass
over the rows, reusing their inputs' memory where the forward pass owns it: a fused residual add writes
the sum into ``residual`` and the normalised rows into ``x``; rotary rotates ``q`` and ``k`` in place.
The compiled versions compute in fp32 and round once, so in fp16/bf16 they may differ from the torch ones
in the last bit (torch rounds each intermediate, e.g. ``q * cos``); the tests bound the difference.
Callers therefore use the returned tensors and never read an input they handed over again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.kernels.cpu_extension import DTYPES, cpu_op


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: the next sublayer's input and the new residual."""
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of ``q``/``k`` ([tokens, heads, head_dim]) by the ``cos``/``sin`` table rows at
    ``positions``."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def _rows(x: torch.Tensor) -> bool:
    """Whether the compiled kernels take ``x``: [rows, dim] on the CPU, dim contiguous, a float dtype."""
    return x.dim() == 2 and x.stride(1) == 1 and x.dtype in DTYPES


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _rows(x) or weight.dtype != x.dtype:
        return rms_norm_torch(x, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    cpu_op("rms_norm")(out, x, weight, eps)
    return out


def add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if not (_rows(x) and _rows(residual)) or weight.dtype != x.dtype or residual.dtype != x.dtype:
        return add_rms_norm_torch(x, residual, weight, eps)
    cpu_op("add_rms_norm")(x, residual, weight, eps)
    return x, residual


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    if not _rows(x):
        return silu_and_mul_torch(x)
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    cpu_op("silu_and_mul")(out, x)
    return out


def rotary_cpu(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.dtype not in DTYPES or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.dtype != torch.float32:
        return rotary_torch(q, k, cos, sin, positions)
    cpu_op("rotary")(q, k, cos, sin, positions)
    return q, k


def cpu_layers_available(device: torch.device) -> bool:
    """Whether the compiled layers serve on ``device``: a CPU where the extension builds."""
    return device.type == "cpu" and cpu_op("rms_norm") is not None


TORCH_LAYERS = (rms_norm_torch, add_rms_norm_torch, silu_and_mul_torch, rotary_torch)
CPU_LAYERS = (rms_norm_cpu, add_rms_norm_cpu, silu_and_mul_cpu, rotary_cpu)
"""``(rms_norm, add_rms_norm, silu_and_mul, rotary)`` of each implementation."""
