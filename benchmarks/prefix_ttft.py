"""Time to first token of a request whose 1,536-token prefix is cached, vs the same request cold.

The request is a 1,536-token shared prefix (think system prompt + documents) plus a 32-token question.
Cold: the prefix cache is reset before the request. Warm: right after it, a request with the same prefix
and a different question, so exactly the 96 prefix blocks are cached and only the 32-token question is
prefilled. Both are measured in one run, alternating; medians over repeats.

    kvmesh bench prefix_ttft [--repeats 7] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.replica import LLM, SamplingParams

PREFIX, SUFFIX = 1536, 32


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    engine = llm.engine
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished:
        outs = engine.step()
        if outs:
            return time.perf_counter() - t0, outs[0].num_cached_tokens
    raise RuntimeError("request produced no token")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench prefix_ttft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    llm = LLM(args.model)
    cold, warm, hits = [], [], []
    for r in range(args.repeats):
        prefix = rng.integers(100, 40000, PREFIX).tolist()
        question = rng.integers(100, 40000, SUFFIX).tolist()
        llm.engine.reset_prefix_cache()
        t, cached = ttft(llm, prefix + question)
        assert cached == 0
        cold.append(t)
        # Another user's question on the same prefix: only the prefix is cached for it.
        t, cached = ttft(llm, prefix + rng.integers(100, 40000, SUFFIX).tolist())
        warm.append(t)
        hits.append(cached)
        print(f"repeat {r + 1}: cold {1000 * cold[-1]:.0f} ms, warm {1000 * warm[-1]:.0f} ms, cached {cached} tokens")
    c, w = median(cold), median(warm)
    print()
    print_table(
        ["case", "TTFT ms (median)", "cached tokens"],
        [["cold", 1000 * c, 0], ["prefix cached", 1000 * w, hits[0]], ["speed-up", c / w, ""]],
    )
    write_json(
        "prefix_ttft",
        {
            "model": args.model,
            "prefix_tokens": PREFIX,
            "suffix_tokens": SUFFIX,
            "repeats": args.repeats,
            "cold_s": cold,
            "warm_s": warm,
            "cached_tokens": hits,
            "median_speedup": c / w,
            "goal": 8.0,
        },
    )


if __name__ == "__main__":
    main()
