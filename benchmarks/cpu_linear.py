"""CPU linear layers on SmolLM2-135M's projection shapes, for decode-sized (1-64 rows) and prefill-sized
(256-1,024 rows) inputs, with torch's default thread count; medians over repeats, timed side by side in one
run:

- ``F.linear`` (repacks its weight on every call) vs ``PackedLinear`` (weight packed once for oneDNN,
  ``kernels/cpu_linear.py``) as it serves;
- the packed layer's two ways to use the threads: oneDNN's own, or the rows shared out, one oneDNN call per
  thread (``PackedLinear`` measures which is faster per shape and batch size and keeps it).

    python -m benchmarks.cpu_linear [--repeats 30] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from torch import nn

from benchmarks.report import median, print_table, write_json
from kernels.cpu_linear import PackedLinear

SHAPES = {
    "qkv 576->960": (576, 960),
    "o 576->576": (576, 576),
    "gate_up 576->3072": (576, 3072),
    "down 1536->576": (1536, 576),
}
ROWS = (1, 16, 64, 256, 512, 1024)


def timeit(fn, x: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return median(times)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rows_out, table, split_table = [], [], []
    for name, (fan_in, fan_out) in SHAPES.items():
        dense = nn.Linear(fan_in, fan_out, bias=False).to(dtype)
        packed = PackedLinear(dense)
        for n in ROWS:
            x = torch.randn(n, fan_in, dtype=dtype)
            times = {
                "f_linear_ms": timeit(dense, x, args.repeats),
                "packed_ms": timeit(packed, x, args.repeats),
                "onednn_threads_ms": timeit(functools.partial(packed.run, split=False), x, args.repeats),
                "rows_per_thread_ms": timeit(functools.partial(packed.run, split=True), x, args.repeats),
            }
            ms = {k: 1e3 * v for k, v in times.items()}
            rows_out.append({"layer": name, "rows": n, **ms})
            table.append([name, n, ms["f_linear_ms"], ms["packed_ms"], ms["f_linear_ms"] / ms["packed_ms"]])
            split_table.append(
                [
                    name,
                    n,
                    ms["onednn_threads_ms"],
                    ms["rows_per_thread_ms"],
                    ms["onednn_threads_ms"] / ms["rows_per_thread_ms"],
                ]
            )
    print_table(["layer", "rows", "F.linear ms", "packed ms", "speed-up"], table)
    print()
    print_table(["layer", "rows", "oneDNN threads ms", "rows per thread ms", "rows / oneDNN speed-up"], split_table)
    write_json(
        "cpu_linear" if dtype == torch.float32 else f"cpu_linear_{args.dtype}",
        {"dtype": args.dtype, "threads": torch.get_num_threads(), "repeats": args.repeats, "results": rows_out},
    )


if __name__ == "__main__":
    main()
