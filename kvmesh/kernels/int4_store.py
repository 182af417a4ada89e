"""Writing keys into an int4 cache: whole blocks re-derived from exact keys (``kvmesh/kernels/quant.py``).

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
    """Where one step's key writes go, the same for every layer: the blocks they touch, in order, and for
    each its tail slot (-1: none), how many slots it holds after the step, and where its earlier keys come
    from."""

    blocks: torch.Tensor
    """[n] int64: the blocks the step writes keys into."""
    fill: torch.Tensor
    """[n] int64: slots of each holding keys after the step."""
    read_tail: torch.Tensor
    """[n] int64: the tail slot holding the block's earlier keys, -1 where it has none (new, or whole)."""
    rebuild: torch.Tensor
    """int64 indices into ``blocks``: blocks continued without a tail, re-derived from their stored keys."""
    save_tail: torch.Tensor
    """[n] int64: the tail slot the block's keys are kept in after the step, -1 for a block now full."""
    token_block: torch.Tensor
    """[tokens] int64: each written token's index into ``blocks`` (written tokens only, slot >= 0)."""
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
        writes = plan_writes(slot_mapping, block_size)
        held = self.tail_of[writes.blocks]
        continued = writes.read_tail == 0  # plan_writes marks continued blocks with 0
        partial = writes.fill < block_size
        save_tail = torch.where(partial, held, -1)
        need = partial & (held < 0)
        if bool(need.any()):
            save_tail[need] = self._assign(writes.blocks[need], protect=held[held >= 0])
        self.stamp[save_tail[save_tail >= 0]] = self.step
        self.forget(writes.blocks[~partial & (held >= 0)])  # full now: their tails go back to the pool
        return replace(
            writes,
            read_tail=torch.where(continued, held, -1),
            rebuild=torch.nonzero(continued & (held < 0)).flatten(),
            save_tail=save_tail,
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
    """The plan of a step that keeps no tails: every continued block is re-derived from its stored keys.
    (``read_tail`` is 0 for a continued block here, -1 otherwise; ``KeyTails.plan`` replaces it.)"""
    slots = slot_mapping[slot_mapping >= 0].long()
    blocks, token_block = torch.unique(slots // block_size, return_inverse=True)
    offset = slots % block_size
    fill = torch.zeros_like(blocks).scatter_reduce_(0, token_block, offset + 1, "amax", include_self=False)
    first = torch.full_like(blocks, block_size).scatter_reduce_(0, token_block, offset, "amin")
    continued = first > 0
    return TailPlan(
        blocks=blocks,
        fill=fill,
        read_tail=torch.where(continued, 0, -1),
        rebuild=torch.nonzero(continued).flatten(),
        save_tail=torch.full_like(blocks, -1),
        token_block=token_block,
        token_offset=offset,
    )


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
    has = torch.nonzero(plan.read_tail >= 0).flatten() if tail is not None else plan.read_tail[:0]
    if has.numel():
        rows[has] = tail[plan.read_tail[has]].float()
    if plan.rebuild.numel():
        ids = plan.blocks[plan.rebuild]
        rows[plan.rebuild] = dequantize_int4_keys(k_cache[ids], k_ranges[ids])
    rows[plan.token_block, plan.token_offset] = key.float()
    packed, ranges = quantize_int4_keys(rows, plan.fill)
    k_cache[plan.blocks] = packed
    k_ranges[plan.blocks] = ranges
    keep = torch.nonzero(plan.save_tail >= 0).flatten()
    if tail is not None and keep.numel():
        tail[plan.save_tail[keep]] = rows[keep].to(tail.dtype)
