"""A PEFT LoRA adapter read and checked against the base model, in the layout of our fused projections.

PEFT saves ``adapter_config.json`` and ``adapter_model.safetensors`` with, per targeted module, ``lora_A``
([rank, in]) and ``lora_B`` ([out, rank]). Our model fuses q/k/v and gate/up into one matmul each
(``replica/llama.py``), so an adapter's q, k and v become one pair for ``qkv``: their A matrices stacked, their
B matrices transposed side by side at each one's output columns, the scaling folded into B. Anything we
cannot serve exactly (DoRA, per-module ranks, biases, shapes of another base model) is refused with a
``LoRAError`` naming what is wrong, before the adapter is used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

TARGETS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up"}
TARGETS |= {"up_proj": "gate_up", "down_proj": "down"}
"""PEFT's module names, and our fused projection each one is part of."""
FUSED_ORDER = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj")}
FUSED_ORDER |= {"down": ("down_proj",)}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served: missing or unreadable files, not a LoRA, or not for this model."""


@dataclass(frozen=True)
class ProjectionShapes:
    """The base model's input and output width of each PEFT module name (``LlamaForCausalLM.lora_shapes``)."""

    shapes: dict[str, tuple[int, int]]
    num_layers: int


@dataclass
class LoRAWeights:
    """One adapter: per layer and fused projection, ``(A, B)`` as ``kernels/lora.py`` takes them: A [parts * r,
    in], B [r, out] (scaling in B); part ``p`` adds ``(x @ A[p*r:(p+1)*r].T) @ B[:, its columns]``."""

    name: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for pair in layer.values() for t in pair)


def load_peft(name: str, path: str | Path, model: ProjectionShapes, max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """Read the PEFT adapter at ``path``, check it fits ``model`` and ``max_rank``, fuse it; ``LoRAError`` if not."""
    path = Path(path)
    config = _read_config(path)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"adapter {name!r}: rank r={rank!r} is not a positive integer")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, over this engine's max_lora_rank {max_rank}")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise LoRAError(f"adapter {name!r} uses {key}, which is not supported")
    if config.get("bias", "none") != "none" or config.get("fan_in_fan_out"):
        raise LoRAError(f"adapter {name!r}: LoRA biases and fan_in_fan_out are not supported")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    pairs = _read_pairs(name, path / "adapter_model.safetensors", model, rank)
    layers = [_fuse(pairs.get(i, {}), model, scaling, dtype) for i in range(model.num_layers)]
    return LoRAWeights(name, rank, layers)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise LoRAError(f"{path} has no adapter_config.json (not a PEFT adapter directory)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{path}/adapter_config.json cannot be read: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    return config


def _read_pairs(
    name: str, file: Path, model: ProjectionShapes, rank: int
) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """``{layer: {module: {"A": .., "B": ..}}}`` from the safetensors file, every shape checked."""
    try:
        tensors = load_file(file)
    except FileNotFoundError:
        raise LoRAError(f"adapter {name!r}: {file} is missing") from None
    except (SafetensorError, OSError) as exc:
        raise LoRAError(f"adapter {name!r}: {file} cannot be read ({exc})") from None
    pairs: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match[2] not in TARGETS:
            raise LoRAError(f"adapter {name!r}: unsupported weight {key!r}")
        layer, module, side = int(match[1]), match[2], match[3]
        if layer >= model.num_layers:
            raise LoRAError(f"adapter {name!r} names layer {layer}; the base model has {model.num_layers}")
        width_in, width_out = model.shapes[module]
        want = (rank, width_in) if side == "A" else (width_out, rank)
        if tuple(tensor.shape) != want:
            raise LoRAError(
                f"adapter {name!r}: {key} has shape {tuple(tensor.shape)}, this base model needs {want} "
                "(an adapter for another model?)"
            )
        pairs.setdefault(layer, {}).setdefault(module, {})[side] = tensor
    for layer, modules in pairs.items():
        for module, sides in modules.items():
            if len(sides) != 2:
                raise LoRAError(f"adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
    if not pairs:
        raise LoRAError(f"adapter {name!r}: {file} holds no LoRA weights")
    return pairs


def _fuse(
    modules: dict[str, dict[str, torch.Tensor]], model: ProjectionShapes, scaling: float, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One layer's pairs as ours: per fused projection, each part's A stacked ([parts * r, in]; zeros for a
    part the adapter does not target) and each part's scaled B transposed, side by side ([r, out])."""
    fused = {}
    for target, names in FUSED_ORDER.items():
        present = [n for n in names if n in modules]
        if not present:
            continue
        rank, width_in = modules[present[0]]["A"].shape
        a = torch.zeros(len(names) * rank, width_in, dtype=dtype)
        b = torch.zeros(rank, sum(model.shapes[n][1] for n in names), dtype=dtype)
        col = 0
        for part, n in enumerate(names):
            width = model.shapes[n][1]
            if n in modules:
                a[part * rank : (part + 1) * rank] = modules[n]["A"]
                b[:, col : col + width] = modules[n]["B"].T * scaling
            col += width
        fused[target] = (a, b)
    return fused


def column_bounds(model: ProjectionShapes) -> dict[str, list[int]]:
    """Per fused projection, where each part's output columns start and end (``kernels/lora.py``'s ``bounds``)."""
    bounds = {}
    for target, names in FUSED_ORDER.items():
        edges = [0]
        for n in names:
            edges.append(edges[-1] + model.shapes[n][1])
        bounds[target] = edges
    return bounds
