"""LoRA adapters for benchmarks: random weights in PEFT's format for a model, sized from its config alone."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvmesh.core.model_files import model_config
from kvmesh.replica.lora_weights import ProjectionShapes


def shapes_of(model: str) -> ProjectionShapes:
    """The (in, out) width of each projection PEFT targets, from ``model``'s config (no weights read)."""
    c = model_config(model)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    q, kv, inter = heads * head_dim, c.get("num_key_value_heads", heads) * head_dim, c["intermediate_size"]
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return ProjectionShapes(shapes, c["num_hidden_layers"])


def write_adapter(path: Path, shapes: ProjectionShapes, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of ``rank`` over every projection, random A and B (scaled small), at ``path``."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for module, (width_in, width_out) in shapes.shapes.items():
            part = "self_attn" if module[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, width_in, generator=gen) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(width_out, rank, generator=gen) * 0.05
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(shapes.shapes)}
    (path / "adapter_config.json").write_text(json.dumps(config))


def zipf_choices(count: int, adapters: int, exponent: float, seed: int) -> list[int]:
    """``count`` adapter numbers drawn with Zipf popularity: adapter k (from 0) weighs ``1 / (k + 1) ** exponent``."""
    weights = [1.0 / (k + 1) ** exponent for k in range(adapters)]
    return random.Random(seed).choices(range(adapters), weights, k=count)
