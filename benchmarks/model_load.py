"""Start-up time of the default model: first load (GGUF dequantized and cached) vs later loads.

Each load runs in a fresh Python process against an empty temporary cache directory, as a new machine
would; ``engine`` is the time to build the engine (weights, tokenizer, KV pool), ``process`` adds the
interpreter and library imports.

    kvmesh bench model_load [--warm-repeats 3] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from kvmesh.bench.harness.report import median, print_table, write_json

CHILD = (
    "import time; t0 = time.perf_counter(); from kvmesh.replica import LLM; t1 = time.perf_counter(); "
    "LLM({model!r}); print('ENGINE', time.perf_counter() - t1)"
)


def load_once(model: str, cache_dir: str) -> tuple[float, float]:
    env = {**os.environ, "KVMESH_CACHE_DIR": cache_dir}
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", CHILD.format(model=model)], env=env, capture_output=True, text=True, check=True
    )
    total = time.perf_counter() - t0
    engine = float(next(line for line in res.stdout.splitlines() if line.startswith("ENGINE")).split()[1])
    return engine, total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench model_load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--warm-repeats", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvmesh-cache-") as cache:
        cold = load_once(args.model, cache)
        warm = [load_once(args.model, cache) for _ in range(args.warm_repeats)]
    warm_engine, warm_total = median([w[0] for w in warm]), median([w[1] for w in warm])
    print_table(
        ["load", "engine s", "process s"],
        [["first (dequantize + cache)", cold[0], cold[1]], ["later (cached, median)", warm_engine, warm_total]],
    )
    write_json(
        "model_load",
        {
            "model": args.model,
            "cold": {"engine_s": cold[0], "process_s": cold[1]},
            "warm": [{"engine_s": e, "process_s": t} for e, t in warm],
            "warm_engine_median_s": warm_engine,
            "goal_warm_s": 5.0,
        },
    )


if __name__ == "__main__":
    main()
