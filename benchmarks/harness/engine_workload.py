"""The engine benchmarks' offline workload (``kvmesh bench engine_throughput``, ``api_overhead``, ``engine_overhead``,
``gpu_suite``): seeded prompts of 64-512 random token ids and 32-128 output tokens each."""

from __future__ import annotations

import numpy as np


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    plens = rng.integers(64, 513, n)
    olens = rng.integers(32, 129, n)
    prompts = [rng.integers(100, 40000, int(p)).tolist() for p in plens]
    return prompts, [int(o) for o in olens]
