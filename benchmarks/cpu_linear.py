"""CPU linear layers: ``F.linear`` (repacks its weight on every call) vs ``PackedLinear`` (weight packed
once for oneDNN, ``kernels/cpu_linear.py``), on SmolLM2-135M's projection shapes in fp32, for decode-sized
(1-64 rows) and prefill-sized (256-1,024 rows) inputs, with torch's default thread count. Median over
repeats, both timed side by side in one run.

    python -m benchmarks.cpu_linear [--repeats 30]
"""

from __future__ import annotations

import argparse
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
ROWS = (1, 16, 64, 256, 1024)


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
    args = ap.parse_args()
    torch.manual_seed(0)
    rows_out, table = [], []
    for name, (fan_in, fan_out) in SHAPES.items():
        dense = nn.Linear(fan_in, fan_out, bias=False)
        packed = PackedLinear(dense)
        for n in ROWS:
            x = torch.randn(n, fan_in)
            f_ms = 1e3 * timeit(dense, x, args.repeats)
            p_ms = 1e3 * timeit(packed, x, args.repeats)
            rows_out.append({"layer": name, "rows": n, "f_linear_ms": f_ms, "packed_ms": p_ms})
            table.append([name, n, f_ms, p_ms, f_ms / p_ms])
    print_table(["layer", "rows", "F.linear ms", "packed ms", "speed-up"], table)
    write_json(
        "cpu_linear",
        {"dtype": "float32", "threads": torch.get_num_threads(), "repeats": args.repeats, "results": rows_out},
    )


if __name__ == "__main__":
    main()
