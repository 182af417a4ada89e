"""Owns the model and its paged KV cache; turns a scheduled batch into logits for the sampling rows."""

from __future__ import annotations

import torch

from kernels import AttentionMetadata
from replica.context import ForwardContext, forward_context
from replica.model_loader import LoadedModel
from replica.scheduler import ScheduledRequest


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    attn = loaded.model.layers[0].self_attn
    per_token = 2 * attn.num_kv_heads * attn.head_dim * dtype.itemsize
    return per_token * block_size * len(loaded.model.layers)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int) -> None:
        self.model = loaded.model
        self.block_size = block_size
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        attn = self.model.layers[0].self_attn
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        # Zero-filled: padded block-table entries point at real (masked) memory that must not hold NaN.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in self.model.layers
        ]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``(source, destination)`` in every layer's caches: copy-on-write of forked
        sequences, done once per step before the forward pass. Each tensor gathers all sources before
        writing any destination, so a block may be a destination and another copy's source."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.kv_caches:
            for cache in layer:
                cache[dst] = cache[src]

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
