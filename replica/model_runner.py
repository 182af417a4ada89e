"""Owns the model and its paged KV cache; turns a scheduled batch into logits for the sampling rows."""

from __future__ import annotations

import torch

from kernels import AttentionMetadata
from kernels.quant import FP8_DTYPES, as_bytes, fp8_scale_from_amax, storage_dtype
from replica.context import ForwardContext, LayerCache, forward_context
from replica.kv_dtype import kv_bytes_per_token
from replica.model_loader import LoadedModel
from replica.scheduler import ScheduledRequest

CALIBRATION_TOKENS = 256
"""Length of the fixed pseudo-random sequence whose K/V set a fp8 cache's per-head scales."""


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one KV block takes in a runner's cache of ``kv_cache_dtype`` (scales included)."""
    attn = loaded.model.layers[0].self_attn
    per_token = kv_bytes_per_token(
        len(loaded.model.layers), attn.num_kv_heads, attn.head_dim, kv_cache_dtype, dtype.itemsize
    )
    return per_token * block_size


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto") -> None:
        self.model = loaded.model
        self.block_size = block_size
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        storage = storage_dtype(kv_cache_dtype, self.dtype)
        attn = self.model.layers[0].self_attn
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        # Zero-filled: padded block-table entries point at real (masked) memory that must not hold NaN.
        self.kv_caches = [self._layer_cache(shape, storage) for _ in self.model.layers]
        if storage in FP8_DTYPES:
            self._calibrate_fp8_scales(storage)

    def _layer_cache(self, shape: tuple[int, ...], storage: torch.dtype) -> LayerCache:
        k = torch.zeros(shape, dtype=storage, device=self.device)
        v = torch.zeros(shape, dtype=storage, device=self.device)
        if storage == torch.int8:  # a float16 scale per slot and KV head
            zeros = torch.zeros(shape[:-1], dtype=torch.float16, device=self.device)
            return LayerCache(k, v, zeros, zeros.clone())
        if storage in FP8_DTYPES:  # per-head scales, set by _calibrate_fp8_scales
            ones = torch.ones(shape[2], dtype=torch.float32, device=self.device)
            return LayerCache(k, v, ones, ones.clone())
        return LayerCache(k, v)

    @torch.inference_mode()
    def _calibrate_fp8_scales(self, storage: torch.dtype) -> None:
        """Set each layer's per-head fp8 scales from the K/V of one fixed calibration sequence.

        The sequence (seeded pseudo-random token ids) runs once through an unquantized scratch cache; each
        layer's largest |K| and |V| per head, with ``FP8_HEADROOM``, become its scales. Fixed input, so
        every replica of a model gets the same scales; values beyond them saturate instead of overflowing.
        """
        n, bs = CALIBRATION_TOKENS, self.block_size
        nb = -(-n // bs)
        attn = self.model.layers[0].self_attn
        scratch = [self._layer_cache((nb, bs, attn.num_kv_heads, attn.head_dim), self.dtype) for _ in self.kv_caches]
        vocab = self.model.embed_tokens.num_embeddings
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).to(self.device)
        meta = AttentionMetadata.build([n], [n], [list(range(nb))], bs, self.device)
        rows = torch.tensor([n - 1], device=self.device)
        with forward_context(ForwardContext(meta, scratch)):
            self.model(ids, torch.arange(n, device=self.device), rows)
        for layer, tmp in zip(self.kv_caches, scratch, strict=True):
            for scale, values in ((layer.k_scale, tmp.k), (layer.v_scale, tmp.v)):
                amax = values.flatten(0, 1)[:n].abs().amax(dim=(0, 2))
                scale.copy_(fp8_scale_from_amax(amax, storage))

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

    def execute(self, batch: list[ScheduledRequest], block_tables: list[list[int]]) -> torch.Tensor:
        """Run one forward over ``batch``; returns fp32 logits for the requests whose chunk ends their tokens."""
        tokens: list[int] = []
        positions = []
        query_lens, seq_lens, logits_rows = [], [], []
        for sr in batch:
            start = sr.request.num_computed_tokens
            end = start + sr.num_new_tokens
            tokens += sr.request.all_token_ids[start:end]
            positions.append(torch.arange(start, end))
            query_lens.append(sr.num_new_tokens)
            seq_lens.append(end)
            if sr.samples:
                logits_rows.append(len(tokens) - 1)
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, self.device)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos = torch.cat(positions).to(self.device)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        with forward_context(ForwardContext(meta, self.kv_caches)):
            return self.model(input_ids, pos, rows)
