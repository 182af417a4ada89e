"""The batch description every attention backend reads: where each sequence's queries and KV live.

A step's batch is flattened: the new tokens of all sequences are concatenated (``query_start_loc`` marks
where each sequence starts), and each sequence's full context (cached prefix + new tokens) is found in the
paged cache through its row of ``block_tables``. Decode sequences simply have a query length of 1.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """[batch, max_blocks] int32: physical block ids of each sequence, padded with 0."""
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for sequences whose new tokens sit at the end of their contexts (the engine's case)."""
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.zeros((len(block_tables), max(width, 1)), dtype=torch.int32)
        slots = []
        for row, (table, q, s) in enumerate(zip(block_tables, query_lens, seq_lens, strict=True)):
            ids = torch.tensor(table, dtype=torch.int64)
            tables[row, : len(table)] = ids.to(torch.int32)
            pos = torch.arange(s - q, s)
            slots.append(ids[pos // block_size] * block_size + pos % block_size)
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        return cls(
            slot_mapping=(torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)).to(device),
            query_start_loc=qsl.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
