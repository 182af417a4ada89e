"""Measure the cost constants of our real engine that the fleet simulator runs on.

    kvmesh bench calibrate [--model smollm2-135m] [--threads 2]

Prefill: uncached prompts of 256 / 512 / 1024 tokens, each prefilled in one step -> tokens per second
(median over lengths and repeats). Decode: batches of 1, 4, 16 and 32 running sequences, ten steps each ->
a least-squares fit ``step_s = base_s + per_seq_s * running``. Written to
``benchmarks/results/calibration.json``; ``kvmesh bench simulate --calibration FILE --speedup F`` then
models a replica that runs F times faster than the measured one (prefill rate x F, step times / F).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from kvmesh.bench.harness.report import print_table, write_json


def measure(model: str, threads: int | None, repeats: int = 3) -> dict:
    from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(model=model, torch_threads=threads, enable_prefix_caching=False, max_num_batched_tokens=1024)
    )
    rng = np.random.default_rng(0)
    rates = []
    engine.add_request(rng.integers(1000, 40000, 64).tolist(), SamplingParams(max_tokens=1))  # warm-up
    while engine.has_unfinished:
        engine.step()
    for n in (256, 512, 1024):
        for _ in range(repeats):
            engine.add_request(rng.integers(1000, 40000, n - 1).tolist(), SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            engine.step()  # the whole prompt in one step: max_num_batched_tokens >= n
            rates.append(n / (time.perf_counter() - t0))
            while engine.has_unfinished:
                engine.step()
    points = []
    for batch in (1, 4, 16, 32):
        for _ in range(batch):
            engine.add_request(rng.integers(1000, 40000, 16).tolist(), SamplingParams(max_tokens=64, ignore_eos=True))
        engine.step()  # admits and prefills them all
        for _ in range(10):
            t0 = time.perf_counter()
            engine.step()
            points.append((batch, time.perf_counter() - t0))
        for rid in list(engine.requests):
            engine.abort_request(rid)
    per_seq, base = np.polyfit([b for b, _ in points], [s for _, s in points], 1)
    return {
        "prefill_tok_s": statistics.median(rates),
        "step_base_s": float(max(base, 1e-4)),
        "decode_s_per_seq": float(max(per_seq, 1e-6)),
        "decode_points": [{"running": b, "step_s": s} for b, s in points],
        "torch_threads": threads,
        "model": model,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", type=Path, default=None, help="where to write (default: the results' calibration.json)")
    args = ap.parse_args(argv)
    result = measure(args.model, args.threads)
    print_table(
        ["constant", "measured"],
        [
            ["prefill tokens/s", result["prefill_tok_s"]],
            ["decode step base (ms)", 1000 * result["step_base_s"]],
            ["per running sequence (ms)", 1000 * result["decode_s_per_seq"]],
        ],
    )
    write_json("calibration", {**result, "command": "kvmesh bench calibrate"}, args.json)


if __name__ == "__main__":
    main()
