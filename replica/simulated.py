"""The simulated engine (``EngineConfig.simulate``): the real server, scheduler, paged KV cache manager (prefix
cache, host tier, eviction) and KV events over no weights and no KV bytes. Each step sleeps for what the timing
model (``core/step_timing.py``) says it costs and yields tokens that depend only on the prompt and the position,
so routers, gateways and autoscalers can be exercised against tens of engines on one machine.

``SimulatedModel`` stands in for the model where the engine sizes its KV (layers, heads, head size: the pool
holds as many blocks as the real model's would in the same bytes); ``SimulatedRunner`` stands in for the model
runner (nothing is stored) and ``SimulatedStep`` for the device step. A plain step (greedy, no logit work)
returns its tokens directly; a step with sampling, penalties, grammars or log-probabilities builds logits that
peak at those tokens and runs the real sampler over them.
"""

from __future__ import annotations

import functools
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.model_files import load_tokenizer, resolve_model_dir
from kvmesh.core.step_timing import StepTiming
from kvmesh.replica.device_queue import StepResult
from kvmesh.replica.device_step import DeviceStep
from kvmesh.replica.llama import layer_windows
from kvmesh.replica.model_loader import LoadedModel
from kvmesh.replica.sampler import GREEDY
from kvmesh.replica.scheduler import ScheduledRequest
from kvmesh.replica.step_plan import StepPlan

PEAK_LOGIT = 30.0
"""The simulated token's logit over 0 for every other: sampled at any usual temperature, ranked first."""
WORD = re.compile(r"^Ġ[a-z]{3,}$")
"""Vocabulary entries output tokens are drawn from: a space and a lower-case word, which detokenize and
tokenize again to themselves, so a conversation's next turn hits the blocks of the reply before it."""


class SimulatedModel(nn.Module):
    """The model's shape without its weights: one parameter (the dtype), and per layer what sizes the KV."""

    def __init__(self, config) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.layers = [
            SimpleNamespace(self_attn=SimpleNamespace(num_kv_heads=kv_heads, head_dim=head_dim, window=window))
            for window in layer_windows(config)
        ]

    def lora_shapes(self):
        raise ValueError("a simulated engine serves no LoRA adapters")


@functools.lru_cache(maxsize=4)
def _model_files(model: str):
    """The config and tokenizer of ``model``, shared by the simulated engines of one process."""
    from transformers import AutoConfig

    path = resolve_model_dir(model)
    return path, AutoConfig.from_pretrained(path), load_tokenizer(path)


def load_simulated(model: str) -> LoadedModel:
    path, config, tokenizer = _model_files(model)
    return LoadedModel(SimulatedModel(config), tokenizer, config, Path(path))


@functools.lru_cache(maxsize=4)
def _words(tokenizer) -> np.ndarray:
    """The ids of the vocabulary's plain words (``WORD``), in id order."""
    vocab = tokenizer.get_vocab()
    words = np.array(sorted(i for token, i in vocab.items() if WORD.match(token)), dtype=np.int64)
    if not len(words):  # another tokenizer family: any id past the specials
        words = np.arange(len(tokenizer.all_special_ids) + 256, len(vocab), dtype=np.int64)
    return words


@dataclass(slots=True)
class SimulatedInputs:
    """A step's work for the timing model and the tokens its logits rows yield."""

    prefill: int
    decodes: int
    tokens: torch.Tensor
    num_logits: int


class SimulatedRunner:
    """The model runner's part the engine calls, storing nothing: the KV bytes are not simulated, only blocks."""

    lora_bounds = None
    graphs = None

    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, num_blocks: int, max_blocks_per_seq: int) -> None:
        self.model = loaded.model
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.block_size = config.block_size
        self.kv_caches: list = []
        self.timing: StepTiming = config.simulate
        self.words = _words(loaded.tokenizer)
        self.vocab_size = loaded.config.vocab_size

    def prepare_decode(self, config: EngineConfig) -> None:
        pass

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass

    def forget_key_tails(self, blocks: torch.Tensor) -> None:
        pass

    def fingerprint(self, model_id: str, hash_seed: bytes, config: EngineConfig) -> bytes:
        """What blocks from a peer must carry: only simulated engines of the same model and KV layout match."""
        meta = f"simulated|{model_id}|{config.kv_cache_dtype}|{config.block_size}".encode()
        return hashlib.sha256(meta + hash_seed).digest()

    def prepare(
        self, batch: list[ScheduledRequest], tables: np.ndarray, extra_rows: list[int] | None = None
    ) -> SimulatedInputs:
        """The step's token counts, and the token of each request whose step samples: a function of its
        prompt's first tokens and the position it samples at."""
        prefill = decodes = 0
        tokens = []
        for sr in batch:
            req, n = sr.request, sr.num_new_tokens
            prefill, decodes = (prefill + n, decodes) if n > 1 else (prefill, decodes + 1)
            end = req.num_computed_tokens + n
            if end == len(req.all_token_ids) + req.num_pending:
                key = hash(tuple(req.all_token_ids[:16])) ^ req.num_prompt_tokens
                tokens.append(int(self.words[(key + end * 0x9E3779B1) % len(self.words)]))
        extra = len(extra_rows) if extra_rows else 0
        return SimulatedInputs(prefill, decodes, torch.tensor(tokens, dtype=torch.int64), len(tokens) + extra)

    def forward(self, step: SimulatedInputs, last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits that peak at the step's tokens (prompt rows, after them, peak nowhere)."""
        logits = torch.zeros(step.num_logits, self.vocab_size)
        rows = torch.arange(len(step.tokens))
        logits[rows, step.tokens] = PEAK_LOGIT
        return logits


class SimulatedStep(DeviceStep):
    """The device step of a simulated engine: the modelled time, then the tokens."""

    runner: SimulatedRunner

    def __call__(self, plan: StepPlan) -> StepResult:
        step: SimulatedInputs = plan.prepared
        time.sleep(self.runner.timing.step_s(step.prefill, step.decodes))
        if not _plain(plan):
            return super().__call__(plan)
        self._move_blocks(plan)
        self.last_tokens = step.tokens
        return step.tokens, {}, None


def _plain(plan: StepPlan) -> bool:
    """Whether the step's tokens are its rows' simulated tokens as they stand: greedy, no logit work."""
    return (
        plan.sampling is GREEDY
        and plan.expand is None
        and plan.prompt is None
        and not plan.logprob_rows
        and plan.bias is None
        and plan.penalties is None
        and plan.grammar is None
    )
