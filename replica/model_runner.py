"""Owns the model and its paged KV cache; turns a scheduled batch into logits for the sampling rows."""

from __future__ import annotations

import logging
import time
from itertools import chain

import numpy as np
import torch

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.hashing import BlockHash
from kvmesh.core.kv_dtype import kv_bytes_per_token
from kvmesh.kernels import AttentionMetadata, model_kernels
from kvmesh.kernels.int4_store import KeyTails
from kvmesh.kernels.metadata import MAX_SPLITS, slot_mapping, token_positions
from kvmesh.kernels.quant import (
    FP8_DTYPES,
    INT4_DTYPE,
    as_bytes,
    fp8_scale_from_amax,
    int4_rotation,
    storage_dtype,
    values_per_element,
)
from kvmesh.replica.context import ForwardContext, LayerCache, forward_context
from kvmesh.replica.cuda_graphs import DecodeGraphs, default_sizes
from kvmesh.replica.lora import LoRAStacks, LoRAStep
from kvmesh.replica.lora_weights import column_bounds
from kvmesh.replica.model_loader import LoadedModel
from kvmesh.replica.scheduler import ScheduledRequest
from kvmesh.replica.step_inputs import PreparedStep, StepInputs

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 256
"""Length of the fixed pseudo-random sequence whose K/V set a fp8 cache's per-head scales."""


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one KV block takes in a runner's cache of ``kv_cache_dtype`` (scales included)."""
    attn = loaded.model.layers[0].self_attn
    per_token = kv_bytes_per_token(
        len(loaded.model.layers), attn.num_kv_heads, attn.head_dim, kv_cache_dtype, dtype.itemsize, block_size
    )
    return per_token * block_size


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, num_blocks: int, max_blocks_per_seq: int) -> None:
        """The KV cache of ``num_blocks`` blocks in the config's ``block_size`` and ``kv_cache_dtype``, and step
        buffers for its ``max_num_batched_tokens`` and ``max_num_seqs`` of up to ``max_blocks_per_seq`` blocks."""
        self.model = loaded.model
        self.block_size = block_size = config.block_size
        max_num_seqs = config.max_num_seqs
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kernels = model_kernels(self.device)
        self.lora_bounds = column_bounds(self.model.lora_shapes()) if config.enable_lora else None
        """Steps look up their sequences' adapters (``replica/lora.py``) when LoRA is on; off, they never look."""
        self.lora_stacks = (
            LoRAStacks(self.lora_bounds) if self.lora_bounds and self.kernels.backend == "triton" else None
        )
        """With the Triton kernels, adapters run stacked (``kernels/triton_lora.py``)."""
        storage = storage_dtype(config.kv_cache_dtype, self.dtype)
        attn = self.model.layers[0].self_attn
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        # Zero-filled: padded block-table entries point at real (masked) memory that must not hold NaN.
        self.key_tails: KeyTails | None = None
        """int4: which block each key tail slot serves (``kernels/int4_store.py``)."""
        tails = 0
        if storage == INT4_DTYPE:  # at most one partial block per sequence a step, and those not scheduled
            tails = 2 * max_num_seqs + 8
            self.key_tails = KeyTails(num_blocks, tails, self.device)
        self.kv_caches = [self._layer_cache(shape, storage, tails) for _ in self.model.layers]
        if storage in FP8_DTYPES:
            self._calibrate_fp8_scales(storage)
        self._inputs = [
            StepInputs(config.max_num_batched_tokens, max_num_seqs, max_blocks_per_seq, self.device) for _ in range(2)
        ]
        self._turn = 0
        self.max_blocks_per_seq = max_blocks_per_seq
        self.graphs: DecodeGraphs | None = None
        """Captured decode steps (CUDA); ``forward`` replays them for the decode batches they fit."""

    def fingerprint(self, model_id: str, hash_seed: BlockHash, config: EngineConfig) -> bytes:
        """What a block's bytes depend on besides its tokens (``disk_tier.cache_fingerprint``)."""
        from kvmesh.replica.disk_tier import cache_fingerprint

        return cache_fingerprint(self, model_id, hash_seed, config)

    def prepare_decode(self, config: EngineConfig) -> None:
        """On CUDA, before serving: compile the Triton decode attention for every split count, and capture the
        decode steps' CUDA graphs for ``cuda_graph_sizes`` (not with ``enforce_eager``, nor for int4, whose
        keys are written whole blocks at a time from their tails, a step a graph cannot replay)."""
        if self.device.type != "cuda":
            return
        if self.kernels.backend == "triton":
            started = time.perf_counter()
            counts = self.compile_decode_splits()
            log.info("compiled decode attention for %d split counts in %.1f s", counts, time.perf_counter() - started)
        if not config.enforce_eager and self.key_tails is None:
            sizes = config.cuda_graph_sizes or default_sizes(config.max_num_seqs)
            sizes = [s for s in sizes if s <= config.max_num_seqs]
            started = time.perf_counter()
            self.capture_decode_graphs(sizes)
            log.info("captured %d CUDA graphs of decode steps in %.1f s", len(sizes), time.perf_counter() - started)

    def compile_decode_splits(self) -> int:
        """Run the decode attention once for each split count a step may choose (``decode_splits``: powers of
        two up to ``MAX_SPLITS``), over layer 0's block 0, read only; returns how many ran. Triton compiles a
        kernel per count, and the decode rows of a mixed step choose theirs by their context length, so a
        count first met while serving would hold that step, and every request in it, for the compile. The
        graphs and ``warm_up`` meet only some counts (short contexts choose 1)."""
        attn, cache = self.model.layers[0].self_attn, self.kv_caches[0]
        q = torch.zeros((1, attn.num_heads, attn.head_dim), dtype=self.dtype, device=self.device)
        meta = AttentionMetadata.build([1], [1], [[0]], cache.k.shape[1], device=self.device)
        counts = [1 << i for i in range(MAX_SPLITS.bit_length())]
        for splits in counts:
            meta.decode_splits = splits
            self.kernels.paged_attention(
                q, cache.k, cache.v, meta, attn.scale, k_scale=cache.k_scale, v_scale=cache.v_scale, window=attn.window
            )
        return len(counts)

    def capture_decode_graphs(self, sizes: list[int], capture: bool = True) -> None:
        """Capture a CUDA graph of a decode step per batch size in ``sizes`` (``capture=False``: the same
        padded static path run eagerly, for tests on the CPU). Not for int4: its key writes (whole blocks from
        their tails, ``kernels/int4_store.py``) are planned per step, which a graph cannot replay."""
        if self.key_tails is not None:
            raise ValueError("an int4 KV cache runs decode steps eagerly: no CUDA graphs")
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.kernels,
            self.device,
            sizes,
            self.max_blocks_per_seq,
            self.block_size,
            capture,
        )

    def _layer_cache(self, shape: tuple[int, ...], storage: torch.dtype, tails: int = 0) -> LayerCache:
        head_dim = shape[-1]
        shape = (*shape[:-1], head_dim // values_per_element(storage))
        k = torch.zeros(shape, dtype=storage, device=self.device)
        v = torch.zeros(shape, dtype=storage, device=self.device)
        if storage == INT4_DTYPE:  # kernels/quant.py: key ranges per block, value scales per slot
            return LayerCache(
                k,
                v,
                torch.zeros((shape[0], shape[2], 2, head_dim), dtype=torch.uint8, device=self.device),
                torch.zeros(shape[:-1], dtype=torch.uint8, device=self.device),
                int4_rotation(head_dim, self.dtype, self.device),
                torch.zeros((tails, *shape[1:-1], head_dim), dtype=self.dtype, device=self.device),
            )
        if storage == torch.int8:  # a float16 scale per slot and KV head
            zeros = torch.zeros(shape[:-1], dtype=torch.float16, device=self.device)
            return LayerCache(k, v, zeros, zeros.clone())
        if storage in FP8_DTYPES:  # per-head scales, set by _calibrate_fp8_scales
            ones = torch.ones(shape[2], dtype=torch.float32, device=self.device)
            return LayerCache(k, v, ones, ones.clone())
        return LayerCache(k, v)

    @torch.inference_mode()
    def _calibration_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V ([tokens, kv_heads, head_dim], model dtype) for one fixed calibration sequence
        (seeded pseudo-random token ids, run once through an unquantized scratch cache): the same on every
        replica of a model, so every replica derives the same static quantization constants from it."""
        n, bs = CALIBRATION_TOKENS, self.block_size
        nb = -(-n // bs)
        attn = self.model.layers[0].self_attn
        scratch = [self._layer_cache((nb, bs, attn.num_kv_heads, attn.head_dim), self.dtype) for _ in self.kv_caches]
        vocab = self.model.embed_tokens.num_embeddings
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).to(self.device)
        meta = AttentionMetadata.build([n], [n], [list(range(nb))], bs, self.device)
        rows = torch.tensor([n - 1], device=self.device)
        with forward_context(ForwardContext(meta, scratch, self.kernels)):
            self.model(ids, torch.arange(n, device=self.device), rows)
        return [(tmp.k.flatten(0, 1)[:n], tmp.v.flatten(0, 1)[:n]) for tmp in scratch]

    def _calibrate_fp8_scales(self, storage: torch.dtype) -> None:
        """Set each layer's per-head fp8 scales: the calibration K/V's largest |K| and |V| per head, with
        ``FP8_HEADROOM``; values beyond them saturate instead of overflowing."""
        for layer, (k, v) in zip(self.kv_caches, self._calibration_kv(), strict=True):
            for scale, values in ((layer.k_scale, k), (layer.v_scale, v)):
                scale.copy_(fp8_scale_from_amax(values.abs().amax(dim=(0, 2)), storage))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``(source, destination)`` in every layer's caches: copy-on-write of forked
        sequences, done once per step before the forward pass. Each tensor gathers all sources before
        writing any destination, so a block may be a destination and another copy's source."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.kv_caches:
            for tensor in map(as_bytes, layer.per_block()):
                tensor[dst] = tensor[src]
        self.forget_key_tails(dst)

    def forget_key_tails(self, blocks: torch.Tensor) -> None:
        """Blocks written by a copy, not by the store (forks, swap-ins): their int4 key tails are stale."""
        if self.key_tails is not None:
            self.key_tails.forget(blocks.to(self.device).long())

    def prepare(
        self, batch: list[ScheduledRequest], tables: np.ndarray, extra_rows: list[int] | None = None
    ) -> PreparedStep:
        """A step's inputs, built on the host with a few numpy operations over the whole batch into the
        next set of persistent buffers (two sets alternate, so a step in flight keeps its own).

        ``tables`` holds every sequence's block ids, a row per sequence (``KVCacheManager.tables``). A
        sequence whose input token is still being sampled by the step in flight (``Request.num_pending``)
        gets a placeholder, and the step fills it on the device from that step's tokens (``fill``).
        ``extra_rows``: more token positions (in the batch's flattened tokens) whose logits the step returns,
        after the sampling rows: prompt positions whose log-probabilities a request asked for."""
        n = len(batch)
        reqs = [sr.request for sr in batch]
        qlens = np.fromiter((sr.num_new_tokens for sr in batch), np.int64, n)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, n)
        known = np.fromiter((len(r.all_token_ids) for r in reqs), np.int64, n)
        rows = np.fromiter((r.kv_row for r in reqs), np.int64, n)
        slens = starts + qlens
        total = int(qlens.sum())
        self._turn ^= 1
        inp = self._inputs[self._turn]
        ids = inp.host("input_ids", total)
        starts_l, qlens_l = starts.tolist(), qlens.tolist()
        if total == n:  # decode only: one token each, the one at its computed position
            ids[:] = np.fromiter(
                (t[s] if s < len(t) else 0 for t, s in zip((r.all_token_ids for r in reqs), starts_l, strict=True)),
                np.int64,
                n,
            )
        else:
            flat = chain.from_iterable(
                r.all_token_ids[s : s + q] or _PLACEHOLDER for r, s, q in zip(reqs, starts_l, qlens_l, strict=True)
            )
            ids[:] = np.fromiter(flat, np.int64, total)
        qsl = inp.host("query_start_loc", n + 1)
        qsl[0] = 0
        np.cumsum(qlens, out=qsl[1:])
        pending = np.flatnonzero(starts >= known)
        fill = None
        if len(pending):
            src = np.fromiter((reqs[i].pending_row for i in pending.tolist()), np.int64, len(pending))
            fill = (torch.from_numpy(qsl[pending].astype(np.int64)), torch.from_numpy(src))
        positions, token_rows = token_positions(qlens, slens)
        inp.host("positions", total)[:] = positions
        inp.host("slot_mapping", total)[:] = slot_mapping(tables, rows[token_rows], positions, self.block_size)
        inp.host("seq_lens", n)[:] = slens
        width = -(-int(slens.max()) // self.block_size)
        inp.host("block_tables", n, width)[:] = tables[rows, :width]
        samples = slens == known + np.fromiter((r.num_pending for r in reqs), np.int64, n)
        logits_rows = qsl[1:][samples] - 1
        extra = len(extra_rows) if extra_rows else 0
        rows_buf = inp.host("logits_rows", len(logits_rows) + extra)
        rows_buf[: len(logits_rows)] = logits_rows
        if extra:
            rows_buf[len(logits_rows) :] = extra_rows
        lora = (
            LoRAStep.build([r.lora for r in reqs], qlens, self.device, self.lora_bounds, self.lora_stacks)
            if self.lora_bounds
            else None
        )
        return PreparedStep(inp, n, total, len(logits_rows) + extra, qlens, slens, width, fill, lora)

    def forward(self, step: PreparedStep, last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run the prepared step on the device; ``last_tokens``: the tokens of the step before, for the
        placeholders of ``step.fill``. Returns fp32 logits for the sampling rows."""
        if step.lora is None and self.graphs is not None and (logits := self.graphs.run(step, last_tokens)) is not None:
            return logits
        inp, n, total = step.inputs, step.n, step.total
        meta = AttentionMetadata(
            slot_mapping=inp.device("slot_mapping", total),
            query_start_loc=inp.device("query_start_loc", n + 1),
            seq_lens=inp.device("seq_lens", n),
            block_tables=inp.device("block_tables", n, step.width),
            query_lens_cpu=step.qlens,
            seq_lens_cpu=step.slens,
        )
        ids = inp.device("input_ids", total)
        if step.fill is not None:
            dst, src = (t.to(self.device, non_blocking=True) for t in step.fill)
            ids[dst] = last_tokens[src]
        positions = inp.device("positions", total)
        tails = None if self.key_tails is None else self.key_tails.plan(meta.slot_mapping, self.block_size)
        with forward_context(ForwardContext(meta, self.kv_caches, self.kernels, tails, step.lora)):
            return self.model(ids, positions, inp.device("logits_rows", step.num_logits))


_PLACEHOLDER = (0,)
"""The input id of a token still being sampled; the step overwrites it on the device before the forward."""
