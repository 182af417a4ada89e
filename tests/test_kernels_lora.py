"""The compiled segmented LoRA op (``csrc/lora_cpu.cpp``) against its torch definition (``kernels/lora.py``):
every token through its own adapter, in every float dtype, whatever the number of tokens per adapter; bad
shapes refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from kvmesh.kernels.cpu_extension import cpu_op
from kvmesh.kernels.lora import lora_update, lora_update_torch

pytestmark = pytest.mark.skipif(cpu_op("lora_update") is None, reason="the CPU kernels could not be built here")

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
BOUNDS = [0, 64, 83, 99]  # three parts (q, k, v-like), widths off the kernel's 8-column blocks
IN = 69


def adapters(ranks: list[int | None], dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random pairs per rank; None: an adapter without this projection (empty tensors)."""
    parts = len(BOUNDS) - 1
    a = [torch.randn(parts * r, IN).to(dtype) if r else torch.empty(0, dtype=dtype) for r in ranks]
    b = [torch.randn(r, BOUNDS[-1]).to(dtype) if r else torch.empty(0, dtype=dtype) for r in ranks]
    return a, b


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("per_adapter", [[1, 2, 3, 8], [17, 1, 40], [64]], ids=["few", "mixed", "one"])
def test_each_token_gets_its_own_adapters_update(dtype, per_adapter):
    torch.manual_seed(0)
    ranks = [(4, 8, 16, 3)[i % 4] for i in range(len(per_adapter))] + [None]
    counts = [*per_adapter, 5]
    tokens = sum(counts) + 7  # some rows use no adapter and must stay as they are
    x, y = torch.randn(tokens, IN).to(dtype), torch.randn(tokens, BOUNDS[-1]).to(dtype)
    a, b = adapters(ranks, dtype)
    rows = torch.randperm(tokens)[: sum(counts)]
    seg = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    got = y.clone()
    lora_update(got, x, a, b, rows, seg, BOUNDS)
    want = y.double()
    lora_update_torch(want, x.double(), [t.double() for t in a], [t.double() for t in b], rows, seg.tolist(), BOUNDS)
    scale = float(want.abs().max())
    assert float((got.double() - want).abs().max()) / scale <= TOL[dtype]
    untouched = torch.ones(tokens, dtype=torch.bool)
    untouched[rows[: sum(per_adapter)]] = False
    assert torch.equal(got[untouched], y[untouched])  # the base model's rows and the adapter without it
    assert not torch.equal(got[~untouched], y[~untouched])


def test_bad_shapes_are_refused_before_anything_is_written():
    a, b = adapters([4], torch.float32)
    x, y = torch.randn(6, IN), torch.randn(6, BOUNDS[-1])
    before = y.clone()
    op = cpu_op("lora_update")
    with pytest.raises(RuntimeError, match=r"a must be \[slices \* r, in\]"):
        op(y, x, [a[0][:-1]], b, torch.arange(6), torch.tensor([0, 6]), BOUNDS)
    with pytest.raises(RuntimeError, match="outside the batch"):
        op(y, x, a, b, torch.tensor([0, 9]), torch.tensor([0, 2]), BOUNDS)
    with pytest.raises(RuntimeError, match="bounds from 0 to y's width"):
        op(y, x, a, b, torch.arange(6), torch.tensor([0, 6]), [0, 64])
    assert torch.equal(y, before)
