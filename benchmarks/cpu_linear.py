"""CPU linear layers on SmolLM2-135M's projection shapes, for decode-sized (1-64 rows) and prefill-sized
(256-1,024 rows) inputs, with torch's default thread count; medians over repeats, timed side by side in one
run:

- ``F.linear`` (repacks its weight on every call) vs ``PackedLinear`` (weight packed once for oneDNN,
  ``kernels/cpu_linear.py``) as it serves;
- the packed layer's ways of computing (``PackedLinear.run``; it measures which is fastest per shape and batch
  size and keeps it): oneDNN's own threads, the rows shared out (one oneDNN call per thread, from 32 rows),
  and in float32 the panel kernel, as speed-ups over oneDNN's.

``--decode-step`` times instead what one decode step's linears cost, each way: SmolLM2's 30 layers, each with
its own weights, and the LM head, at 4-256 rows, against the same calls on one layer's weights reused 30 times.
A model's weights (538 MB in float32, 269 MB in bf16) pass through the caches once per step; reused, one
layer's stay in them. The gap is what streaming the weights from memory adds to a step.

    kvmesh bench cpu_linear [--repeats 30] [--dtype bfloat16] [--decode-step]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from torch import nn

from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.kernels.cpu_linear import PackedLinear

SHAPES = {
    "qkv 576->960": (576, 960),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (576, 3072),
    "down 1536->576": (1536, 576),
}
ROWS = (1, 16, 64, 256, 512, 1024)
LAYERS, HIDDEN, VOCAB = 30, 576, 49152
"""SmolLM2-135M's depth, width and vocabulary (its LM head)."""


def timeit(fn, x: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return median(times)


def decode_step(dtype: torch.dtype, repeats: int) -> list[dict]:
    """One decode step's linears at 4-256 rows, each way of computing them (``PackedLinear.run``): on every
    layer's own weights, then on one layer's reused."""
    layers = [[PackedLinear(nn.Linear(i, o, bias=False).to(dtype)) for i, o in SHAPES.values()] for _ in range(LAYERS)]
    head = PackedLinear(nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype))
    weight_bytes = sum(lin.packed.nbytes for layer in layers for lin in layer) + head.packed.nbytes
    out = []
    for n in (4, 16, 32, 64, 128, 256):
        xs = {i: torch.randn(n, i, dtype=dtype) for i, _ in SHAPES.values()}

        def step(way: str, reuse: bool, xs=xs) -> float:
            t0 = time.perf_counter()
            for layer in layers[:1] * LAYERS if reuse else layers:
                for lin in layer:
                    lin.run(xs[lin.in_features], way)
            head.run(xs[HIDDEN], way)
            return time.perf_counter() - t0

        flop = 2 * n * (LAYERS * sum(i * o for i, o in SHAPES.values()) + HIDDEN * VOCAB)
        ways = head.ways(n, torch.get_num_threads(), panel_cap=n)  # panels timed past the size they serve
        runs = [(way, reuse) for way in ways for reuse in (False, True)]
        times: dict[tuple[str, bool], list[float]] = {run: [] for run in runs}
        for run in runs:  # warm-up
            step(*run)
        for _ in range(repeats):  # alternated, so drift hits every way alike
            for run in runs:
                times[run].append(step(*run))
        for way in ways:
            own_s, reused_s = median(times[(way, False)]), median(times[(way, True)])
            out.append(
                {
                    "rows": n,
                    "way": way,
                    "weights_MB": weight_bytes / 1e6,
                    "own_weights_ms": 1e3 * own_s,
                    "reused_weights_ms": 1e3 * reused_s,
                    "own_GFLOPs": flop / own_s / 1e9,
                    "reused_GFLOPs": flop / reused_s / 1e9,
                    "own_weights_GBps": weight_bytes / own_s / 1e9,
                    "own_vs_onednn": median(times[("onednn", False)]) / own_s,
                }
            )
    return out


def report_decode_step(args: argparse.Namespace, dtype: torch.dtype) -> None:
    """``--decode-step``: a decode step's linears, each way, on own vs reused weights."""
    rows = decode_step(dtype, max(args.repeats // 2, 5))
    print_table(
        [
            "rows",
            "way",
            "own weights ms",
            "GFLOP/s",
            "weights GB/s",
            "one layer's reused ms",
            "GFLOP/s",
            "slow-down",
            "speed-up on own weights vs onednn",
        ],
        [
            [
                r["rows"],
                r["way"],
                r["own_weights_ms"],
                r["own_GFLOPs"],
                r["own_weights_GBps"],
                r["reused_weights_ms"],
                r["reused_GFLOPs"],
                r["own_weights_ms"] / r["reused_weights_ms"],
                r["own_vs_onednn"],
            ]
            for r in rows
        ],
    )
    write_json(
        f"cpu_linear_decode_step_{args.dtype}",
        {"dtype": args.dtype, "threads": torch.get_num_threads(), "layers": LAYERS, "decode_step": rows},
    )


def report_shapes(args: argparse.Namespace, dtype: torch.dtype) -> None:
    """F.linear vs the packed layer, and the packed layer's ways, on every shape and row count."""
    rows_out, table, split_table = [], [], []
    for name, (fan_in, fan_out) in SHAPES.items():
        dense = nn.Linear(fan_in, fan_out, bias=False).to(dtype)
        packed = PackedLinear(dense)
        for n in ROWS:
            x = torch.randn(n, fan_in, dtype=dtype)
            times = {
                "f_linear_ms": timeit(dense, x, args.repeats),
                "packed_ms": timeit(packed, x, args.repeats),
                **{
                    f"{way}_ms": timeit(functools.partial(packed.run, way=way), x, args.repeats)
                    for way in packed.ways(n, torch.get_num_threads(), panel_cap=n)
                },
            }
            ms = {k: 1e3 * v for k, v in times.items()}
            rows_out.append({"layer": name, "rows": n, **ms})
            table.append([name, n, ms["f_linear_ms"], ms["packed_ms"], ms["f_linear_ms"] / ms["packed_ms"]])
            split_table.append(
                [
                    name,
                    n,
                    ms["onednn_ms"],
                    *(ms["onednn_ms"] / ms[w] if w in ms else None for w in ("rows_ms", "panels_ms")),
                ]
            )
    print_table(["layer", "rows", "F.linear ms", "packed ms", "speed-up"], table)
    print()
    print_table(["layer", "rows", "onednn ms", "rows: speed-up", "panels: speed-up"], split_table)
    write_json(
        "cpu_linear" if dtype == torch.float32 else f"cpu_linear_{args.dtype}",
        {"dtype": args.dtype, "threads": torch.get_num_threads(), "repeats": args.repeats, "results": rows_out},
    )


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench cpu_linear", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--decode-step", action="store_true", help="a decode step's linears, own vs reused weights")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.decode_step:
        report_decode_step(args, dtype)
        return
    report_shapes(args, dtype)


if __name__ == "__main__":
    main()
