"""The batch description every attention backend reads: where each sequence's queries and KV live.

A step's batch is flattened: the new tokens of all sequences are concatenated (``query_start_loc`` marks
where each sequence starts), and each sequence's full context (cached prefix + new tokens) is found in the
paged cache through its row of ``block_tables``. Decode sequences simply have a query length of 1.

Everything here is built with a few numpy operations over the whole batch, never per sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] int64: cache slot (block_id * block_size + offset) of each new token, -1 to skip."""
    query_start_loc: torch.Tensor
    """[batch + 1] int32: prefix sums of the query lengths."""
    seq_lens: torch.Tensor
    """[batch] int32: context length of each sequence including its new tokens."""
    block_tables: torch.Tensor
    """[batch, max_blocks] int32: physical block ids of each sequence (entries past its length: any valid id)."""
    query_lens_cpu: np.ndarray
    """[batch] int64, on the host: what the backends plan their launches with."""
    seq_lens_cpu: np.ndarray
    decode_splits: int | None = None
    """Parts each decode context is split into on a GPU; None lets the backend choose from the batch
    (a CUDA graph fixes it, since a replay cannot choose)."""

    @property
    def max_query_len(self) -> int:
        return int(self.query_lens_cpu.max()) if len(self.query_lens_cpu) else 0

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_cpu.max()) if len(self.seq_lens_cpu) else 0

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences whose new tokens sit at the end of their contexts (tests, benchmarks)."""
        qlens, slens = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
        tables = np.zeros((len(block_tables), max((len(t) for t in block_tables), default=1) or 1), dtype=np.int32)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = table
        positions, rows = token_positions(qlens, slens)
        slots = slot_mapping(tables, rows, positions, block_size)
        qsl = np.zeros(len(qlens) + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1:])
        return cls(
            slot_mapping=torch.from_numpy(slots).to(device),
            query_start_loc=torch.from_numpy(qsl).to(device),
            seq_lens=torch.from_numpy(slens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(tables).to(device),
            query_lens_cpu=qlens,
            seq_lens_cpu=slens,
        )


def token_positions(query_lens: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each new token's position in its sequence and the batch row it belongs to (the new tokens of a row
    are the last ``query_len`` of its ``seq_len``)."""
    total = int(query_lens.sum())
    rows = np.repeat(np.arange(len(query_lens)), query_lens)
    starts = np.cumsum(query_lens) - query_lens  # where each row's tokens begin in the flat batch
    positions = np.arange(total) - np.repeat(starts - (seq_lens - query_lens), query_lens)
    return positions, rows


def slot_mapping(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slot of each token: ``tables[row, pos // block_size] * block_size + pos % block_size``."""
    return tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


MAX_SPLITS = 64
"""Most parts a decode sequence's context is split into (flash-decoding, the Triton decode kernel)."""
MIN_SPLIT_TOKENS = 128
"""Shortest context part worth a program of its own."""
PROGRAMS_PER_MULTIPROCESSOR = 4
"""Decode programs in flight per multiprocessor that a split aims for: on an H200, 4 reached 74-90% of copy
bandwidth at batch 1-8 and context 32k where 2 reached 52-69% (``benchmarks/results/README.md``, GPU)."""


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def decode_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many parts each decode sequence's context is split into on a GPU: the largest power of two that
    keeps the programs at most ``PROGRAMS_PER_MULTIPROCESSOR`` per multiprocessor when the batch alone has
    fewer, each part at least ``MIN_SPLIT_TOKENS`` long."""
    wanted = PROGRAMS_PER_MULTIPROCESSOR * _multiprocessors(device) // (batch * kv_heads)
    splits = 1 << max(0, wanted.bit_length() - 1)
    return max(1, min(splits, MAX_SPLITS, max_seq_len // MIN_SPLIT_TOKENS))
