"""One request's state inside the engine: its tokens, progress, block hashes and stop conditions."""

from __future__ import annotations

import copy
import enum

import torch

from replica.detokenizer import IncrementalDetokenizer
from replica.sampling_params import SamplingParams
from router.hashing import BlockHash, hash_blocks


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A prompt plus everything generated so far.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the scheduler advances it, and resets
    it to zero on preemption (recompute). ``block_hashes`` covers every full block of prompt + output and
    grows as tokens are appended, so generated text is cacheable for the next chat turn too.

    A request with ``params.n > 1`` is one sequence until its prompt is prefilled (``fork_pending``); then
    the engine forks it into ``n`` sequences (``fork``), itself being sequence 0. Each sequence is a
    ``Request`` of its own with the same ``request_id`` and its ``index``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_total_tokens: int,
        eos_token_ids: set[int],
        detokenizer: IncrementalDetokenizer,
        block_size: int,
        hash_seed: BlockHash,
        hash_extra: bytes,
        block_hashes: list[BlockHash] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix hit of the first admission; -1 until admitted
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        prompt_len = len(prompt_token_ids)
        limit = max_total_tokens - prompt_len
        self.max_new_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        self.index = 0
        self.fork_pending = params.n > 1
        self.generator = self._seeded_generator()
        self._block_size = block_size
        self._hash_seed = hash_seed
        self._hash_extra = hash_extra
        # The ingress may pass precomputed prompt hashes so a prompt is hashed once per cluster.
        self.block_hashes = block_hashes if block_hashes is not None else []
        self._extend_hashes()

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_seqs(self) -> int:
        """Running slots this request takes: ``n`` until it forks (its children's seats are reserved at
        admission), then one per sequence."""
        return self.params.n if self.fork_pending else 1

    # ------------------------------------------------------------------ parallel sampling
    def _seeded_generator(self) -> torch.Generator | None:
        seed = self.params.seed
        # Modulo 2**64: torch's seed range, read as two's complement, so any seed keeps its meaning.
        return None if seed is None else torch.Generator().manual_seed((seed + self.index) % 2**64)

    def fork(self, index: int) -> Request:
        """Sequence ``index`` of this request: same tokens, progress and hashes, its own random generator
        (``seed + index``) and detokenizer. Only before the first output token: the detokenizer's decode
        state cannot be copied, so the child starts a fresh one. Blocks are shared by the KV manager."""
        if self.output_token_ids:
            raise RuntimeError("a request is forked when its prompt is prefilled, before any output")
        child = copy.copy(self)  # immutable parts (prompt, params, stop ids) are shared
        child.index = index
        child.fork_pending = False
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.detokenizer = self.detokenizer.fresh()
        child.generator = child._seeded_generator()
        return child

    # ------------------------------------------------------------------ progress
    def _extend_hashes(self) -> None:
        start = len(self.block_hashes)
        if (self.num_tokens // self._block_size) > start:
            parent = self.block_hashes[-1] if start else None
            self.block_hashes += hash_blocks(
                self.all_token_ids, self._block_size, self._hash_seed, self._hash_extra, parent, start
            )

    def append_token(self, token_id: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        self.all_token_ids.append(token_id)
        self._extend_hashes()
        if token_id in self._stop_ids or self.detokenizer.push(token_id):
            self.finish_reason = "stop"
        elif len(self.all_token_ids) - self.num_prompt_tokens >= self.max_new_tokens:
            self.finish_reason = "length"
