"""The compiled CPU layers (``kernels/layers.py``) and prepacked linears
(``kernels/cpu_linear.py``) against their torch definitions: same values, on the strided views the
model hands them, in every float dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvmesh.kernels import layers
from kvmesh.kernels.cpu_extension import cpu_op
from kvmesh.kernels.cpu_linear import PANEL_MAX_ROWS, FastestWay, PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(cpu_op("rms_norm") is None, reason="the CPU kernels could not be built here")

BF16_PACKS = torch.ops.mkldnn._is_mkldnn_bf16_supported()
"""oneDNN packs bf16 weights only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere they stay."""
NO_BF16 = "oneDNN packs bf16 linear layers only on CPUs with AVX-512 or AVX-NE-CONVERT"
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = list(TOL)


AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(b.float().abs().max()) or 1.0
    err = float((a.float() - b.float()).abs().max()) / scale
    assert err <= TOL[dtype], f"relative error {err:.2e} in {dtype}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 37, 300])
def test_rms_norm_and_fused_residual_add(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    r = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    close(layers.rms_norm_cpu(x, w, 1e-5), layers.rms_norm_torch(x, w, 1e-5), dtype)
    want_x, want_r = layers.add_rms_norm_torch(x, r, w, 1e-5)
    got_x, got_r = layers.add_rms_norm_cpu(x.clone(), r.clone(), w, 1e-5)
    assert torch.equal(got_r, want_r)  # the residual stream is one rounding of x + r, as in torch
    close(got_x, want_x, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = (torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    close(layers.silu_and_mul_cpu(x), layers.silu_and_mul_torch(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_rotates_the_fused_qkv_views_in_place(dtype, head_dim):
    """q and k as the model passes them: strided views into one fused QKV output, rotated in place."""
    g = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads = 21, 9, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(512, head_dim // 2, generator=g) * 6.28
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    positions = torch.randint(0, 512, (tokens,), generator=g)
    want_q, want_k = layers.rotary_torch(q, k, cos, sin, positions)
    v_before = v.clone()
    got_q, got_k = layers.rotary_cpu(q, k, cos, sin, positions)
    assert got_q.data_ptr() == q.data_ptr() and torch.equal(v, v_before)
    close(got_q, want_q, dtype)
    close(got_k, want_k, dtype)


def test_rotary_refuses_a_position_beyond_its_table():
    q, k = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    table = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        layers.rotary_cpu(q, k, table, table, torch.tensor([3, 8]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_the_linear_it_replaces(dtype, bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 200, bias=bias), nn.Linear(200, 40, bias=bias)).to(dtype)
    x = torch.randn(3, 17, 96, dtype=dtype)  # leading dims are kept
    with torch.inference_mode():
        want = model(x)
        if dtype == torch.bfloat16 and not BF16_PACKS:  # oneDNN cannot pack bf16 here: the layers stay as they are
            assert pack_linears(model) == 0 and all(isinstance(m, nn.Linear) for m in model)
            close(model(x), want, dtype)
            return
        assert pack_linears(model) == 2
        assert all(isinstance(m, PackedLinear) for m in model)
        got = model(x)
        strided = model(torch.randn(5, 300, dtype=dtype)[:, :96])  # a non-contiguous input is accepted
    assert got.shape == want.shape and strided.shape == (5, 40)
    close(got, want, dtype)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not BF16_PACKS, reason=NO_BF16))],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 11, 12, 13, 31, 32, 33, 257])
def test_every_way_of_computing_a_packed_linear_computes_it(dtype, bias, rows):
    """oneDNN's own threads, the rows shared out between threads (odd splits included) and, in float32, the
    panel kernel (row tiles of 12, a last panel of 8 columns), inside and outside inference mode (worker
    threads do not inherit it), against ``F.linear``."""
    torch.manual_seed(rows)
    dense = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    want = dense(x).detach()
    layer = PackedLinear(dense)
    ways = layer.ways(max(rows, 32), 2, panel_cap=max(rows, 32))  # every way, even where another always serves
    assert ways == (["onednn", "rows", "panels"] if dtype == torch.float32 and AVX512 else ["onednn", "rows"])
    for way in ways:
        close(layer.run(x, way), want, dtype)
        with torch.inference_mode():
            close(layer.run(x, way), want, dtype)


@pytest.mark.skipif(not AVX512, reason="the panel kernel serves on CPUs with AVX-512")
def test_panels_are_a_float32_way_that_can_be_turned_off(monkeypatch):
    dense = nn.Linear(64, 48)
    assert PackedLinear(dense).ways(8, 2) == ["onednn", "panels"]
    assert PackedLinear(dense).ways(PANEL_MAX_ROWS, 1) == ["onednn", "panels"]
    assert PackedLinear(dense).ways(PANEL_MAX_ROWS + 1, 2) == ["onednn", "rows"]  # prefill sizes: oneDNN's
    monkeypatch.setenv("KVMESH_CPU_PANELS", "0")
    layer = PackedLinear(dense)
    assert layer.ways(64, 2) == ["onednn", "rows"] and layer.panels is None


def test_the_fastest_way_serves_each_shape_and_batch_size_once_measured():
    """Each way is timed ``trials`` times on the first calls of a key, in turn, every call served; then the
    fastest one serves alone, each key deciding for itself."""
    now = [0.0]
    fastest = FastestWay(trials=2, clock=lambda: now[0])
    cost = {("a", "x"): 2.0, ("a", "y"): 1.0, ("a", "z"): 3.0, ("b", "x"): 1.0, ("b", "y"): 3.0}
    ways = {"a": ["x", "y", "z"], "b": ["x", "y"]}
    calls = []

    def call(key):
        def run(way: str) -> str:
            calls.append((key, way))
            now[0] += cost[(key, way)]
            return f"{key}:{way}"

        return run

    for _ in range(6):
        assert fastest.run("a", ways["a"], call("a")) in ("a:x", "a:y", "a:z")
        fastest.run("b", ways["b"], call("b"))
    a_ways, b_ways = [w for _, w in calls[0::2]], [w for _, w in calls[1::2]]
    assert a_ways == ["x", "y", "z", "x", "y", "z"]  # each way in turn until each has its trials
    assert b_ways == ["x", "y", "x", "y", "x", "x"]  # decided after four calls: the faster serves alone
    assert fastest.chosen == {"a": "y", "b": "x"}
    calls.clear()
    assert fastest.run("a", ways["a"], call("a")) == "a:y" and fastest.run("b", ways["b"], call("b")) == "b:x"
    assert calls == [("a", "y"), ("b", "x")]


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KVMESH_CPU_PACKED_LINEAR", "0")
    model = nn.Sequential(nn.Linear(8, 8))
    assert pack_linears(model) == 0 and type(model[0]) is nn.Linear
