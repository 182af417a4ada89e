"""Writing keys into an int4 cache: whole blocks re-derived from exact keys (``kernels/quant.py``).

An int4 block's keys share per-channel ranges, so a key written into a block that already holds some moves
the ranges of all of them. Re-rounding the stored levels to the new ranges would compound rounding errors
(measured: perplexity +2.1% instead of +0.6%), so the keys of a block still being filled are kept in full
precision in a *tail* beside the cache, and every write re-derives the block from them, as KIVI keeps its
newest keys in full precision. A block written whole in one step needs no tail; one a step leaves partial
gets a tail slot until it is full. The slots are few (a step leaves at most one partial block per
sequence) and recycled least recently written first. A block written by anything but the store (a
fork's copy, a swap-in) has its tail forgotten; a partial block whose tail was lost is re-derived once from
its stored keys (one extra rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvmesh.kernels.quant import dequantize_int4_keys, quantize_int4_keys


@dataclass(frozen=True)
class TailPlan:
    """Where one step's key writes go, the same for every layer: the blocks they touch, how many slots each
    holds after the step, where each block's earlier keys come from and which blocks' keys are kept after.
    Rows are indices into ``blocks``; slots are tail slots."""

    blocks: torch.Tensor
    """[n] int64: the blocks the step writes keys into."""
    fill: torch.Tensor
    """[n] int64: slots of each holding keys after the step."""
    read_rows: torch.Tensor
    """Blocks continued from their tails (at ``read_slots``)."""
    read_slots: torch.Tensor
    rebuild: torch.Tensor
    """Blocks continued without a tail: re-derived from their stored keys."""
    save_rows: torch.Tensor
    """Blocks left partial: their keys are kept in ``save_slots``."""
    save_slots: torch.Tensor
    token_block: torch.Tensor
    """[tokens] int64: each written token's row (written tokens only, slot >= 0)."""
    token_offset: torch.Tensor
    """[tokens] int64: its slot within the block."""


class KeyTails:
    """Which block each tail slot serves (one table for every layer; the tails themselves are per layer)."""

    def __init__(self, num_blocks: int, slots: int, device: torch.device) -> None:
        self.slots = slots
        self.tail_of = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self.owner = torch.full((slots,), -1, dtype=torch.int64, device=device)
        self.stamp = torch.zeros(slots, dtype=torch.int64, device=device)
        self.step = 0

    def plan(self, slot_mapping: torch.Tensor, block_size: int) -> TailPlan:
        """The step's plan for the keys written at ``slot_mapping`` (-1: not written), tail slots assigned."""
        self.step += 1
        writes, continued = _writes(slot_mapping, block_size)
        held = self.tail_of[writes.blocks]
        partial = writes.fill < block_size
        save = torch.where(partial, held, -1)
        need = partial & (held < 0)
        if bool(need.any()):
            save[need] = self._assign(writes.blocks[need], protect=held[held >= 0])
        self.stamp[save[save >= 0]] = self.step
        self.forget(writes.blocks[~partial & (held >= 0)])  # full now: their tails go back to the pool
        read_rows = torch.nonzero(continued & (held >= 0)).flatten()
        save_rows = torch.nonzero(save >= 0).flatten()
        return replace(
            writes,
            read_rows=read_rows,
            read_slots=held[read_rows],
            rebuild=torch.nonzero(continued & (held < 0)).flatten(),
            save_rows=save_rows,
            save_slots=save[save_rows],
        )

    def _assign(self, blocks: torch.Tensor, protect: torch.Tensor) -> torch.Tensor:
        """Tail slots for ``blocks``: free ones first, then the least recently written, never ``protect``'s."""
        if blocks.numel() + protect.numel() > self.slots:
            raise RuntimeError(f"{blocks.numel() + protect.numel()} partial key blocks in a step, {self.slots} tails")
        age = self.stamp.clone()
        age[self.owner < 0] = -1
        age[protect] = self.step + 1
        chosen = torch.topk(age, blocks.numel(), largest=False).indices
        self.forget(self.owner[chosen])
        self.owner[chosen] = blocks
        self.tail_of[blocks] = chosen
        return chosen

    def forget(self, blocks: torch.Tensor) -> None:
        """Drop the tails of ``blocks`` (their contents were replaced, or they are full)."""
        blocks = blocks[blocks >= 0]
        held = self.tail_of[blocks]
        self.owner[held[held >= 0]] = -1
        self.tail_of[blocks] = -1


def plan_writes(slot_mapping: torch.Tensor, block_size: int) -> TailPlan:
    """The plan of a step that keeps no tails: every continued block is re-derived from its stored keys."""
    return _writes(slot_mapping, block_size)[0]


def _writes(slot_mapping: torch.Tensor, block_size: int) -> tuple[TailPlan, torch.Tensor]:
    """The tail-less plan, and which of its blocks continue one written before (their first write is past
    slot 0)."""
    slots = slot_mapping[slot_mapping >= 0].long()
    blocks, token_block = torch.unique(slots // block_size, return_inverse=True)
    offset = slots % block_size
    fill = torch.zeros_like(blocks).scatter_reduce_(0, token_block, offset + 1, "amax", include_self=False)
    first = torch.full_like(blocks, block_size).scatter_reduce_(0, token_block, offset, "amin")
    continued = first > 0
    none = blocks[:0]
    plan = TailPlan(blocks, fill, none, none, torch.nonzero(continued).flatten(), none, none, token_block, offset)
    return plan, continued


def store_int4_keys(
    key: torch.Tensor,
    k_cache: torch.Tensor,
    k_ranges: torch.Tensor,
    plan: TailPlan,
    tail: torch.Tensor | None,
) -> None:
    """Write ``key`` ([written tokens, kv_heads, head_dim]) into an int4 key cache as ``plan`` says, whole
    blocks re-derived from exact keys: the tail's (``tail``: [slots, block_size, kv_heads, head_dim]), else
    the block's stored ones (``plan.rebuild``)."""
    rows = torch.zeros((plan.blocks.numel(), k_cache.shape[1], *key.shape[1:]), dtype=torch.float32, device=key.device)
    if tail is not None and plan.read_rows.numel():
        rows[plan.read_rows] = tail[plan.read_slots].float()
    rebuild = plan.rebuild if tail is not None else torch.cat((plan.rebuild, plan.read_rows))
    if rebuild.numel():
        ids = plan.blocks[rebuild]
        rows[rebuild] = dequantize_int4_keys(k_cache[ids], k_ranges[ids])
    rows[plan.token_block, plan.token_offset] = key.float()
    packed, ranges = quantize_int4_keys(rows, plan.fill)
    k_cache[plan.blocks] = packed
    k_ranges[plan.blocks] = ranges
    if tail is not None and plan.save_rows.numel():
        tail[plan.save_slots] = rows[plan.save_rows].to(tail.dtype)
