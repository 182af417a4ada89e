"""One request's state inside the engine: its tokens, progress, block hashes and stop conditions."""

from __future__ import annotations

import copy
import enum
import random

from kvmesh.core.hashing import BlockHash, first_block_extra, hash_blocks
from kvmesh.core.messages import TokenLogprob
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.replica.detokenizer import IncrementalDetokenizer
from kvmesh.replica.lora import LoRAAdapter


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
        *,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_total_tokens: int,
        eos_token_ids: set[int],
        detokenizer: IncrementalDetokenizer,
        block_size: int,
        hash_seed: BlockHash,
        cache_salt: str | None = None,
        block_hashes: list[BlockHash] | None = None,
        lora: LoRAAdapter | None = None,
    ) -> None:
        """``max_total_tokens``: prompt + output at most; ``block_size``, ``hash_seed`` and ``cache_salt`` (mixed
        into block 0's hash, with ``lora``'s name: an adapter's KV is its own) chain ``block_hashes``, unless the
        ingress passed the prompt's already. ``lora``: the adapter the request runs on (None: the base model)."""
        self.request_id = request_id
        self.cache_salt = cache_salt
        """The tenant salt mixed into block 0's hash: block 0's KV event names it (``extra_keys`` on the wire)."""
        self.lora = lora
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix hit of the first admission; -1 until admitted
        self.finish_reason: str | None = None
        self.detokenizer = detokenizer
        prompt_len = self.num_prompt_tokens = len(prompt_token_ids)
        limit = max_total_tokens - prompt_len
        self.max_new_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        self.index = 0
        self.fork_pending = params.n > 1
        self._seed_base = params.seed if params.seed is not None else random.getrandbits(64)
        self.sample_seed = self._sample_seed()
        self.kv_row = -1
        """This sequence's row of the KV manager's block tables while it holds blocks; -1 otherwise."""
        self.logit_work = params.adjusts_logits
        """Set once: steps look at this request's biases, penalties, grammar and logprobs only when it is true."""
        self.matcher = None
        """The response_format grammar's matcher (``replica/structured.py``), advanced by the device step."""
        self.prompt_logprobs: list[TokenLogprob] = []
        """Log-probabilities of prompt tokens 1.. so far, when ``params.prompt_logprobs`` asks for them."""
        self.penalty_row = -1
        """This sequence's row of the engine's penalty counts (``replica/penalties.py``); -1: no penalty."""
        self.num_pending = 0
        """Tokens sampled by a step still in flight (0 or 1): counted in ``num_tokens``, appended when the
        step's results are collected."""
        self.pending_row = -1
        """Where the pending token sits in its step's sampled tokens: the next step reads it there."""
        self._block_size = block_size
        self._hash_seed = hash_seed
        self._hash_extra = first_block_extra(cache_salt, lora.name if lora is not None else None)
        # The ingress may pass precomputed prompt hashes so a prompt is hashed once per cluster.
        self.block_hashes = block_hashes if block_hashes is not None else []
        self._extend_hashes()

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        """Tokens known or being sampled: the prompt, the output, and a token in flight."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_seqs(self) -> int:
        """Running slots this request takes: ``n`` until it forks (its children's seats are reserved at
        admission), then one per sequence."""
        return self.params.n if self.fork_pending else 1

    # ------------------------------------------------------------------ parallel sampling
    def _sample_seed(self) -> int:
        """The seed of this sequence's draws (``replica/sampler.py``): the request's seed + its index, modulo
        2**64, as a signed 64-bit value; unseeded requests start from a random one."""
        seed = (self._seed_base + self.index) % 2**64
        return seed - 2**64 if seed >= 2**63 else seed

    def fork(self, index: int) -> Request:
        """Sequence ``index`` of this request: same tokens, progress and hashes, its own draws
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
        child.sample_seed = child._sample_seed()
        child.kv_row = -1
        child.num_pending, child.pending_row = 0, -1
        child.matcher = self.matcher.fork() if self.matcher is not None else None
        return child

    # ------------------------------------------------------------------ progress
    def _extend_hashes(self) -> None:
        start = len(self.block_hashes)
        if (len(self.all_token_ids) // self._block_size) > start:
            parent = self.block_hashes[-1] if start else None
            self.block_hashes += hash_blocks(
                self.all_token_ids, self._block_size, self._hash_seed, self._hash_extra, parent, start
            )

    def append_token(self, token_id: int) -> bool:
        """Record a sampled token and decide whether the request is done; True when it filled a block."""
        tokens = self.all_token_ids
        tokens.append(token_id)
        filled = len(tokens) % self._block_size == 0
        if filled:
            self._extend_hashes()
        if token_id in self.stop_ids or self.detokenizer.push(token_id):
            self.finish_reason = "stop"
        elif len(tokens) - self.num_prompt_tokens >= self.max_new_tokens:
            self.finish_reason = "length"
        return filled
