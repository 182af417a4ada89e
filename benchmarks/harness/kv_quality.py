"""How much a KV cache format costs in quality, as ``kvmesh bench kv_quant`` and ``kv_int4_variants`` measure it (and
``tests/test_gpu.py``): a fixed set of chat prompts, log-probs teacher forced through the engine's own paged cache,
and the perplexity and top-1 predictions over Python's pydoc topics text."""

from __future__ import annotations

import numpy as np
import torch

from kvmesh.kernels import AttentionMetadata
from kvmesh.replica import LLM
from kvmesh.replica.context import ForwardContext, forward_context

PROMPTS = [
    "Explain how photosynthesis works in three sentences.",
    "Write a haiku about the sea.",
    "What is the capital of Australia, and why is it not Sydney?",
    "List five tips for writing clean Python code.",
    "Summarize the plot of Romeo and Juliet.",
    "How does a hash table handle collisions?",
    "Give me a recipe for a simple tomato soup.",
    "What are the main differences between TCP and UDP?",
    "Describe the water cycle to a ten-year-old.",
    "Why is the sky blue?",
    "Write a short poem about autumn leaves.",
    "What causes the seasons on Earth?",
    "Explain what a neural network is in plain words.",
    "Suggest three names for a bakery and explain each.",
    "How do vaccines train the immune system?",
    "What is the difference between weather and climate?",
]


@torch.inference_mode()
def teacher_forced_logprobs(llm: LLM, tokens: list[int], start: int) -> torch.Tensor:
    """Log-probs of ``tokens[start:]`` given their prefixes: one forward through the engine's own paged cache."""
    engine = llm.engine
    engine.reset_prefix_cache()  # the blocks below are overwritten; nothing cached may point at them
    runner, n = engine.runner, len(tokens)
    nb = -(-n // runner.block_size)
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], runner.block_size, runner.device)
    ids = torch.tensor(tokens, device=runner.device)
    rows = torch.arange(start - 1, n - 1, device=runner.device)
    with forward_context(ForwardContext(meta, runner.kv_caches, runner.kernels)):
        logits = runner.model(ids, torch.arange(n, device=runner.device), rows).float()
    engine.reset_prefix_cache()
    return logits.log_softmax(-1)


def perplexity_text() -> str:
    """A real English text every Python ships: the documentation topics of ``pydoc`` (``help()``), in order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def text_scores(llm: LLM, chunks: list[list[int]]) -> tuple[float, torch.Tensor]:
    """Teacher forced over each chunk: the perplexity of every token after its first (exp of the mean negative
    log-likelihood), and the top-1 prediction at each of those positions (concatenated)."""
    nll, top = [], []
    for c in chunks:
        lp = teacher_forced_logprobs(llm, c, 1)
        nll.append(-lp.gather(1, torch.tensor(c[1:])[:, None]).mean().item())
        top.append(lp.argmax(-1))
    return float(np.exp(np.mean(nll))), torch.cat(top)
