"""Models in real models' shapes with random weights, for machines the real weights cannot reach: Llama-family
configs over SmolLM2's vocabulary (SmolLM2-135M's, Llama-3-8B's layers), Qwen3-0.6B's, their random weights
saved with SmolLM2's tokenizer, and the 1-layer model whose forward pass is nearly free (``tiny_model``).
``kvmesh bench gpu_suite``, ``gpu_peer_routers`` and ``ttft_floor`` run on them."""

from __future__ import annotations

import dataclasses
import gc
import shutil
import sys
import time
from pathlib import Path

from kvmesh.core.model_files import resolve_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclasses.dataclass(frozen=True)
class Scale:
    """Sizes of one ``kvmesh bench gpu_suite`` run: the real ones on a GPU, toy ones for the CPU smoke run (whose
    ``layers`` also narrow ``smollm2_config`` and ``qwen3_config``)."""

    requests: int = 256
    smollm_repeats: int = 3
    qwen_repeats: int = 2
    attention_batches: tuple[int, ...] = (1, 2, 4, 8)
    attention_contexts: tuple[int, ...] = (8192, 16384, 32768)
    step_batch: int = 256
    timed_steps: int = 50
    layers: dict | None = None  # overrides of the model configs (smoke: 2 layers, narrow)


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def llama_shaped(shape: dict, tied: bool, rope_theta: float = 100000.0):
    """A Llama-family config of ``shape`` over SmolLM2's 49,152-token vocabulary (its tokenizer drives every
    random model here)."""
    from transformers import LlamaConfig

    common = {"max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
    return LlamaConfig(vocab_size=49152, rope_theta=rope_theta, tie_word_embeddings=tied, **common, **shape)


def smollm2_config(scale: Scale, tied: bool = True):
    shape = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9}
    shape |= {**scale.layers, "num_key_value_heads": 2} if scale.layers else {"num_key_value_heads": 3}
    return llama_shaped(shape, tied)


LLAMA3_8B_SHAPE = {
    **{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32},
    **{"num_attention_heads": 32, "num_key_value_heads": 8},
}
"""Llama-3-8B's layers: 32 of them, 4096 wide, 32 query and 8 KV heads of 128."""


def qwen3_config(scale: Scale):
    from transformers import Qwen3Config

    shape = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16}
    shape.update(scale.layers or {})
    return Qwen3Config(
        vocab_size=151936,
        num_key_value_heads=8 if not scale.layers else 2,
        head_dim=128 if not scale.layers else 16,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        **shape,
    )


def save_random_model(path: Path, config, tokenizer: Path, dtype: str, sharpen: float = 1.0) -> Path:
    """Random weights for ``config`` at ``path`` with ``tokenizer``'s files. ``sharpen`` scales the output
    head (untied) so greedy argmax is not a near-tie everywhere, as the tests' tiny models do."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if sharpen != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, path / name)
    del model
    free_device_memory()
    return path


def random_model(name: str, config, tokenizer: Path, dtype: str) -> Path:
    """``/tmp/kvmesh-random-{name}``: random weights for ``config`` saved there, or an earlier run's reused (an
    8B model takes minutes to write, and GPU sessions are short)."""
    path, t0 = Path(f"/tmp/kvmesh-random-{name}"), time.monotonic()
    if (path / "model.safetensors.index.json").exists() or (path / "model.safetensors").exists():
        print(f"random {name} weights of an earlier run reused: {path}", file=sys.stderr, flush=True)
        return path
    save_random_model(path, config, tokenizer, dtype)
    print(f"random {name} weights written in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return path


def tiny_model(path: Path, vocab: int) -> Path:
    """A 1-layer Llama with random weights (hidden 128, 4 query / 2 KV heads) sharing SmolLM2's tokenizer
    (ids below ``vocab`` are real tokens of it, so detokenization does its usual work)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    smollm = resolve_model_dir("smollm2-135m", weights=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm / name).exists():
            shutil.copy(smollm / name, path / name)
    return path
