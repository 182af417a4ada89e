"""int4 writes: a block filled token by token from its tail holds exactly what writing it whole would
(``kernels/int4_store.py``), the tails' bookkeeping survives recycling, copies and overflow, the
least-squares roundings of key ranges and value scales never lose to the plain ones, and the compiled
quantizers write the torch ones' bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.kernels.int4_store import KeyTails, plan_writes
from kvmesh.kernels.quant import dequantize_int4_keys, e4m3_bits, e4m3_values, int4_key_ranges
from kvmesh.kernels.torch_attention import store_kv_torch

BS, KVH, D = 16, 2, 64


def caches(blocks: int = 8):
    shape = (blocks, BS, KVH, D // 2)
    k, v = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
    ranges = torch.zeros((blocks, KVH, 2, D), dtype=torch.uint8)
    return k, v, ranges, torch.zeros((blocks, BS, KVH), dtype=torch.uint8)


def write(cache, keys, slots, tails=None, tail=None):
    k, v, ranges, v_scale = cache
    slots = torch.tensor(slots)
    plan = tails.plan(slots, BS) if tails is not None else None
    store_kv_torch(keys, keys.clone(), k, v, slots, ranges, v_scale, plan, tail)


def test_a_block_filled_token_by_token_holds_what_one_write_of_it_would():
    """Decode writes one key a step: with tails, each step re-derives the block from exact keys, so the
    stored bytes equal a single write of the same keys (a prefill), after every step."""
    keys = torch.randn(BS, KVH, D) * torch.linspace(0.1, 5, D)  # channels of very different ranges
    keys[:, :, 3] += 7.0  # and an offset that in-place re-rounding would smear
    one, steps = caches(), caches()
    tails = KeyTails(num_blocks=8, slots=4, device=torch.device("cpu"))
    tail = torch.zeros((4, BS, KVH, D))
    for i in range(BS):
        write(steps, keys[i : i + 1], [5 * BS + i], tails, tail)
        one = caches()
        write(one, keys[: i + 1], list(range(5 * BS, 5 * BS + i + 1)))
        assert torch.equal(steps[0][5], one[0][5]) and torch.equal(steps[2][5], one[2][5]), f"after key {i}"
    assert int(tails.tail_of[5]) == -1  # full: its tail went back to the pool


def test_without_a_tail_a_continued_block_is_rederived_from_its_stored_keys():
    """The fallback (a tail lost to a copy or a swap): the newest key within half a step (or clipped by an
    end of its range), the earlier ones re-rounded once per write, not the exact one-write result."""
    keys = torch.randn(BS, KVH, D) * 3
    cache = caches()
    for i in range(BS):
        write(cache, keys[i : i + 1], [2 * BS + i])  # no tails: plan_writes rebuilds every continued block
    lo, step = (t[0] for t in int4_key_ranges(cache[2][2:3]))
    err = (dequantize_int4_keys(cache[0][2:3], cache[2][2:3])[0] - keys).abs()
    beyond = (lo - keys[-1]).clamp_min(0) + (keys[-1] - (lo + 15 * step)).clamp_min(0)  # an end rounded inward
    assert bool((err[-1] <= 0.5001 * step + beyond + 1e-6).all())
    assert float(err.max()) <= BS * 0.5001 * float(step.max())


def test_tail_slots_are_recycled_least_recently_written_first_and_copies_forget_theirs():
    tails = KeyTails(num_blocks=16, slots=2, device=torch.device("cpu"))
    p = tails.plan(torch.tensor([0 * BS, 1 * BS]), BS)  # two new partial blocks take both slots
    assert p.read_rows.numel() == 0 and sorted(p.save_slots.tolist()) == [0, 1]
    p = tails.plan(torch.tensor([1 * BS + 1]), BS)  # block 1 continues from its tail
    assert p.read_slots.tolist() == [int(tails.tail_of[1])] and p.rebuild.numel() == 0
    p = tails.plan(torch.tensor([2 * BS]), BS)  # block 2 takes block 0's slot: written least recently
    assert int(tails.tail_of[0]) == -1 and int(tails.tail_of[2]) >= 0
    p = tails.plan(torch.tensor([0 * BS + 1]), BS)  # block 0 lost its tail: re-derived from the cache
    assert p.rebuild.tolist() == [0] and p.read_rows.numel() == 0
    tails.forget(torch.tensor([1]))  # a copy or a swap-in replaced block 1's keys
    p = tails.plan(torch.tensor([1 * BS + 2]), BS)
    assert p.rebuild.tolist() == [0]
    with pytest.raises(RuntimeError, match="3 partial key blocks in a step, 2 tails"):
        tails.plan(torch.tensor([5 * BS, 6 * BS, 7 * BS]), BS)


def test_a_whole_block_in_one_write_takes_no_tail():
    tails = KeyTails(num_blocks=4, slots=2, device=torch.device("cpu"))
    p = tails.plan(torch.arange(BS) + BS, BS)
    assert p.save_rows.numel() == 0 and p.fill.tolist() == [BS] and int(tails.owner.max()) == -1
    writes = plan_writes(torch.tensor([-1, 3 * BS + 4, 3 * BS + 5, -1]), BS)
    assert writes.blocks.tolist() == [3] and writes.fill.tolist() == [6] and writes.rebuild.tolist() == [0]


def test_the_decode_graphs_are_refused_for_int4(tiny_llama_dir):
    from kvmesh.replica import LLM

    engine = LLM(str(tiny_llama_dir), kv_cache_dtype="int4", num_kv_blocks=8).engine
    with pytest.raises(ValueError, match="int4 KV cache runs decode steps eagerly"):
        engine.runner.capture_decode_graphs([1, 2], capture=False)


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-500, max_value=500, allow_nan=False, width=32))
def test_e4m3_directed_rounding_takes_the_nearest_grid_point_that_way(x):
    """The candidates for a range's ends: rounded down and up to the next e4m3 grid point, never further, so
    the outward pair contains every key it was taken from."""
    t = torch.tensor([x])
    down, up = float(e4m3_values(e4m3_bits(t, up=False))), float(e4m3_values(e4m3_bits(t, up=True)))
    clamped = min(max(x, -448.0), 448.0)
    assert down <= clamped <= up
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    assert not bool(((grid > down) & (grid < clamped)).any()) and not bool(((grid < up) & (grid > clamped)).any())


def test_the_compiled_key_quantizer_matches_the_torch_one():
    """Same ranges to the byte; levels equal but where a key sits on a rounding tie (the compiled division
    may round its last bit differently)."""
    from kvmesh.kernels.cpu_extension import cpu_op
    from kvmesh.kernels.quant import quantize_int4_keys, quantize_int4_keys_torch, unpack_int4

    if cpu_op("quantize_int4_keys") is None:
        pytest.skip("no compiled CPU kernels here")
    g = torch.Generator().manual_seed(0)
    rows = torch.randn((40, BS, 3, D), generator=g) * torch.rand((1, 1, 3, D), generator=g) * 20
    rows[3] = 0.0  # a block of zeros: zero ranges, all levels 0
    rows[4, :, :, 5] = 500.0  # beyond e4m3: clips at 448
    fill = torch.randint(1, BS + 1, (40,), generator=g)
    packed, ranges = quantize_int4_keys(rows, fill)
    packed_t, ranges_t = quantize_int4_keys_torch(rows, fill)
    assert torch.equal(ranges, ranges_t)
    lo, step = int4_key_ranges(ranges_t)
    position = (rows - lo[:, None]) / torch.where(step > 0, step, 1)[:, None]
    tie = ((position - position.floor()) - 0.5).abs() < 1e-4
    assert bool(((unpack_int4(packed) == unpack_int4(packed_t)) | tie).all())


def test_int4_values_use_all_sixteen_levels_and_never_round_worse_than_absmax_over_seven():
    """Each value vector keeps the least-squares scale of its candidates (plain symmetric ``absmax / 7`` among
    them, so no vector is stored worse than by it), all 16 levels in use: on Gaussian-like (rotated) values
    the squared error falls by about a third."""
    from kvmesh.kernels.quant import dequantize, quantize_int4_values

    g = torch.Generator().manual_seed(1)
    x = torch.randn((512, 3, D), generator=g) * torch.rand((512, 3, 1), generator=g) * 4
    x[0] = 0.0  # zero vectors stay zero
    packed, scales = quantize_int4_values(x)
    y = dequantize(packed, scales, torch.float32)
    s7 = e4m3_values(e4m3_bits(x.abs().amax(-1) / 7, up=True))[..., None]
    plain = (x / torch.where(s7 > 0, s7, 1)).round().clamp(-7, 7) * s7
    err, err_plain = (y - x).square().sum(-1), (plain - x).square().sum(-1)
    assert bool((err <= err_plain * (1 + 1e-5) + 1e-12).all())
    assert float(err.sum()) < 0.8 * float(err_plain.sum())
    assert torch.equal(y[0], torch.zeros_like(y[0]))
    from kvmesh.kernels.quant import unpack_int4

    assert int(unpack_int4(packed).min()) == 0  # level -8 is used


def test_int4_key_ranges_round_each_block_at_least_as_well_as_the_outward_pair():
    """Channels far from zero, where e4m3's grid is coarse against their spread, take an inward end when it
    rounds the block better: never worse per channel than the outward range, better in total."""
    import kvmesh.kernels.quant as quant

    g = torch.Generator().manual_seed(2)
    rows = torch.randn((24, BS, KVH, D), generator=g) + torch.randn((1, 1, KVH, D), generator=g) * 40
    fill = torch.randint(1, BS + 1, (24,), generator=g)
    valid = (torch.arange(BS)[None] < fill[:, None])[:, :, None, None]

    def errors(ends):
        saved, quant.INT4_KEY_RANGE_ENDS = quant.INT4_KEY_RANGE_ENDS, ends
        try:
            packed, ranges = quant.quantize_int4_keys_torch(rows, fill)
        finally:
            quant.INT4_KEY_RANGE_ENDS = saved
        return ((dequantize_int4_keys(packed, ranges) - rows).double().square() * valid).sum(1)

    chosen, outward = errors(quant.INT4_KEY_RANGE_ENDS), errors(quant.INT4_KEY_RANGE_ENDS[:1])
    assert bool((chosen <= outward * (1 + 1e-6) + 1e-9).all())
    assert float(chosen.sum()) < 0.9 * float(outward.sum())


def test_the_compiled_value_quantizer_matches_the_torch_one():
    """Same scale bytes and nibbles, but where a value sits on a rounding tie."""
    from kvmesh.kernels.cpu_extension import cpu_op
    from kvmesh.kernels.quant import quantize_int4_values, quantize_int4_values_torch, unpack_int4

    if cpu_op("quantize_int4_values") is None:
        pytest.skip("no compiled CPU kernels here")
    g = torch.Generator().manual_seed(3)
    x = torch.randn((300, 3, D), generator=g) * torch.rand((300, 3, 1), generator=g) * 10
    x[0] = 0.0  # zero rows: scale 0, every nibble 8
    x[1, 0, :4] = torch.tensor([5.0, -5.0, 1.0, 0.5])  # equal magnitudes: the first one's sign decides
    packed, scales = quantize_int4_values(x)
    packed_t, scales_t = quantize_int4_values_torch(x)
    assert packed.shape == packed_t.shape and scales.shape == scales_t.shape == x.shape[:-1]
    assert torch.equal(scales, scales_t)
    position = x / e4m3_values(scales_t)[..., None].where(scales_t[..., None] % 128 != 0, torch.tensor(1.0))
    tie = ((position - position.floor()) - 0.5).abs() < 1e-4
    assert bool(((unpack_int4(packed) == unpack_int4(packed_t)) | tie).all())
