"""The segmented LoRA update (``kernels/lora.py``) in Triton, for GPUs: S-LoRA's SGMV, vLLM's punica.

The step's adapters are stacked per layer and projection (``stack_pairs``): A as [adapters, parts * R, in]
and B as [adapters, R, out], ranks zero-padded to the step's largest R (padding adds zeros to the sums). The
batch's tokens, sorted by adapter, are cut into tiles of at most ``BLOCK_T`` tokens of one adapter
(``lora_tiles``). Two kernels, one program per (tile, block of columns):

- shrink: ``s[t, q] = x[rows[t]] . A[adapter, q]`` for a tile's tokens, float32 out, ``tl.dot`` over blocks of
  the input width;
- expand, once per part (q, k, v; gate, up): ``y[rows[t], lo:hi] += s[t, part's R rows] @ B[adapter, :, lo:hi]``,
  each output row read and written by one program only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
"""Tokens of one adapter per tile (``tl.dot`` needs 16 rows or more)."""


@triton.jit
def _shrink(
    x_ptr, a_ptr, s_ptr, rows_ptr, tiles_ptr,
    stride_x, stride_an, stride_aq, stride_s, width_in, width_s,
    BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tile, qb = tl.program_id(0), tl.program_id(1)
    adapter = tl.load(tiles_ptr + tile * 3)
    start, end = tl.load(tiles_ptr + tile * 3 + 1), tl.load(tiles_ptr + tile * 3 + 2)
    t = start + tl.arange(0, BLOCK_T)
    t_ok = t < end
    rows = tl.load(rows_ptr + t, mask=t_ok, other=0)
    q = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = q < width_s
    acc = tl.zeros((BLOCK_T, BLOCK_Q), dtype=tl.float32)
    for k0 in range(0, width_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < width_in
        xs = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        a_at = a_ptr + adapter * stride_an + q[None, :] * stride_aq + k[:, None]
        a = tl.load(a_at, mask=k_ok[:, None] & q_ok[None, :], other=0.0)
        acc += tl.dot(xs.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(s_ptr + t[:, None] * stride_s + q[None, :], acc, mask=t_ok[:, None] & q_ok[None, :])


@triton.jit
def _expand(
    s_ptr, b_ptr, y_ptr, rows_ptr, tiles_ptr,
    stride_s, stride_bn, stride_br, stride_y, col0, cols, s_col0, rank,
    BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    tile, ob = tl.program_id(0), tl.program_id(1)
    adapter = tl.load(tiles_ptr + tile * 3)
    start, end = tl.load(tiles_ptr + tile * 3 + 1), tl.load(tiles_ptr + tile * 3 + 2)
    t = start + tl.arange(0, BLOCK_T)
    t_ok = t < end
    rows = tl.load(rows_ptr + t, mask=t_ok, other=0)
    within = ob * BLOCK_O + tl.arange(0, BLOCK_O)
    o = col0 + within
    o_ok = within < cols
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    s = tl.load(s_ptr + t[:, None] * stride_s + s_col0 + r[None, :], mask=t_ok[:, None] & r_ok[None, :], other=0.0)
    b_at = b_ptr + adapter * stride_bn + r[:, None] * stride_br + o[None, :]
    b = tl.load(b_at, mask=r_ok[:, None] & o_ok[None, :], other=0.0)
    update = tl.dot(s, b.to(tl.float32), input_precision="ieee")
    y_at = y_ptr + rows[:, None] * stride_y + o[None, :]
    mask = t_ok[:, None] & o_ok[None, :]
    y = tl.load(y_at, mask=mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + update).to(y.dtype), mask=mask)


def stack_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor] | None], parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Several adapters' ``(A [parts * r, in], B [r, out])`` (None: no such projection) as A [adapters, parts *
    R, in] and B [adapters, R, out], each part's rows at ``p * R`` and the ranks zero-padded to the largest R."""
    some_a, some_b = next((a, b) for a, b in (p for p in pairs if p is not None))
    rank = max(b.shape[0] for _, b in (p for p in pairs if p is not None))
    a_out = some_a.new_zeros(len(pairs), parts * rank, some_a.shape[1])
    b_out = some_b.new_zeros(len(pairs), rank, some_b.shape[1])
    for i, pair in enumerate(pairs):
        if pair is None:
            continue
        a, b = pair
        r = b.shape[0]
        for p in range(parts):
            a_out[i, p * rank : p * rank + r] = a[p * r : (p + 1) * r]
        b_out[i, :r] = b
    return a_out, b_out


def lora_tiles(seg: list[int], device: torch.device) -> torch.Tensor:
    """``[tiles, 3]`` int64 (adapter, first, end) over the sorted rows: at most ``BLOCK_T`` of one adapter each."""
    tiles = [
        (i, t, min(t + BLOCK_T, seg[i + 1])) for i in range(len(seg) - 1) for t in range(seg[i], seg[i + 1], BLOCK_T)
    ]
    return torch.tensor(tiles, dtype=torch.int64).view(-1, 3).to(device)


def lora_update_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rows: torch.Tensor,
    tiles: torch.Tensor,
    bounds: list[int],
) -> None:
    """``lora_update`` on stacked pairs (``stack_pairs``) and tiles (``lora_tiles``): adds to ``y`` in place."""
    if not len(tiles):
        return
    parts, rank = len(bounds) - 1, b.shape[1]
    s = torch.empty(len(rows), parts * rank, dtype=torch.float32, device=x.device)
    block_q = min(64, max(16, triton.next_power_of_2(parts * rank)))
    grid = (len(tiles), triton.cdiv(parts * rank, block_q))
    _shrink[grid](
        x, a, s, rows, tiles, x.stride(0), a.stride(0), a.stride(1), s.stride(0), x.shape[1], parts * rank,
        BLOCK_T=BLOCK_T, BLOCK_Q=block_q, BLOCK_K=64,
    )  # fmt: skip
    block_r = max(16, triton.next_power_of_2(rank))
    for part in range(parts):
        lo, hi = bounds[part], bounds[part + 1]
        grid = (len(tiles), triton.cdiv(hi - lo, 64))
        _expand[grid](
            s, b, y, rows, tiles, s.stride(0), b.stride(0), b.stride(1), y.stride(0), lo, hi - lo, part * rank, rank,
            BLOCK_T=BLOCK_T, BLOCK_O=64, BLOCK_R=block_r,
        )  # fmt: skip
