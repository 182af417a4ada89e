"""Load a model's weights into our Llama forward (files and tokenizer: ``kvmesh.core.model_files``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase

from kvmesh.core.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model_dir
from kvmesh.kernels.cpu_linear import pack_linears
from kvmesh.replica.llama import LlamaForCausalLM


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig
    path: Path
    """The Hugging Face directory the weights came from (the cache directory for GGUF models)."""


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (exact, and bf16 matmuls are slow there); bf16 on GPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(
    model: str = DEFAULT_MODEL,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    max_model_len: int | None = None,
) -> LoadedModel:
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    path = resolve_model_dir(model)
    config = AutoConfig.from_pretrained(path)
    tokenizer = load_tokenizer(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    max_positions = max_model_len or config.max_position_embeddings
    with torch.device("meta"):  # skip random initialisation: every parameter is replaced by a loaded one
        net = LlamaForCausalLM(config, max_positions)
    net.load_hf_weights({k: v.to(dtype) for k, v in weights.items()})
    net.to(device).eval()
    pack_linears(net)  # CPU only: weights in oneDNN's layout once, instead of on every matmul
    return LoadedModel(net, tokenizer, config, path)
