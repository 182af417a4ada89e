"""Parallel sampling: one request with ``n=8`` (forked after one prefill, its sequences sharing the prompt's
KV blocks copy-on-write) vs 8 independent requests for the same prompt, submitted together.

SmolLM2-135M, a 1,000-token prompt of random token ids (not a multiple of the 16-token block, so every fork
but the last copies the partly filled last block), 64 sampled tokens per sequence (temperature 1, EOS
ignored; sequence i is seeded ``seed + i`` in both shapes), default engine settings (1,024-token step
budget). Also with 32 tokens per sequence: the sequences' own blocks dominate a fork's memory, so the ratio
depends on the output length.

- Peak KV blocks: the pool's high-water mark of blocks pinned by requests during a run (the same in every
  repeat).
- Wall time: from submitting to the last token; the fastest of ``--repeats`` runs, fork and independent
  alternating (other work on a shared machine only ever slows a run down).
- Prefilled tokens: prompt tokens computed rather than found in the prefix cache.

Independent requests with prefix caching on reuse what is cached when each is admitted: the first prompt's
blocks are cached only once its prefill step ends, so a request admitted in that same step (with the step
budget's leftover) holds a private copy.

    kvmesh bench parallel_sampling [--n 8] [--prompt-tokens 1000] [--max-tokens 64 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.replica import LLM, SamplingParams

SEED = 1234
GOAL = 1 / 6
"""The fork should pin at most this share of the blocks the independent requests pin."""


def run(llm: LLM, prompt: list[int], n: int, max_tokens: int, fork: bool) -> dict:
    """One request with ``n`` sequences, or ``n`` requests of one, from a clean cache; what it cost."""
    engine = llm.engine
    assert engine.reset_prefix_cache()
    engine.scheduler.reset_counters()
    engine.pool.reset_peak()

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=seed, n=n)

    t0 = time.perf_counter()
    if fork:
        engine.add_request(prompt, params(n, SEED))
    else:
        for i in range(n):
            engine.add_request(prompt, params(1, SEED + i))
    output_tokens = 0
    while engine.has_unfinished:
        output_tokens += sum(len(out.delta_token_ids) for out in engine.step())
    wall_s = time.perf_counter() - t0
    stats = engine.stats()
    assert output_tokens == n * max_tokens and stats.num_free_blocks == stats.num_blocks
    return {
        "peak_blocks": engine.pool.peak_used,
        "wall_s": wall_s,
        "prefilled_tokens": stats.prompt_tokens - stats.cached_prompt_tokens,
        "output_tokens": output_tokens,
        "preemptions": stats.num_preemptions,
    }


def measure(model: str, caching: bool, prompt: list[int], n: int, lengths: list[int], repeats: int) -> dict:
    """Fork and independent runs on one engine (prefix caching on or off), for each output length."""
    llm = LLM(model, enable_prefix_caching=caching)
    llm.generate(prompt[:64], SamplingParams(max_tokens=4))  # warm-up: first-call costs stay out of the timings
    suffix = "on" if caching else "off"
    results = {}
    for max_tokens in lengths:
        runs: dict[str, list[dict]] = {}
        for _ in range(repeats):
            for fork in (True, False):
                name = f"{max_tokens}/{'fork' if fork else 'independent'}, caching {suffix}"
                r = run(llm, prompt, n, max_tokens, fork)
                runs.setdefault(name, []).append(r)
                print(f"{name}: peak {r['peak_blocks']} blocks, {r['wall_s']:.1f} s", flush=True)
        for name, rs in runs.items():
            assert len({(r["peak_blocks"], r["prefilled_tokens"]) for r in rs}) == 1, f"{name} varied: {rs}"
            results[name] = {**rs[0], "wall_s": min(r["wall_s"] for r in rs), "wall_s_runs": [r["wall_s"] for r in rs]}
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench parallel_sampling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    prompt = np.random.default_rng(0).integers(100, 40000, args.prompt_tokens).tolist()
    results = {}
    for caching in (True, False):
        results |= measure(args.model, caching, prompt, args.n, args.max_tokens, args.repeats)
    rows = []
    for max_tokens in args.max_tokens:
        fork = results[f"{max_tokens}/fork, caching on"]
        for key, r in results.items():
            length, name = key.split("/")
            if int(length) != max_tokens:
                continue
            share = fork["peak_blocks"] / r["peak_blocks"]
            goal = f"<= {GOAL:.3f}" if name.startswith("independent") else ""
            rows.append([max_tokens, name, r["peak_blocks"], f"{share:.3f}", r["prefilled_tokens"], r["wall_s"], goal])
    print()
    print_table(
        ["tokens/seq", f"n={args.n}", "peak KV blocks", "fork / this", "prefilled tokens", "wall s (best)", "goal"],
        rows,
    )
    write_json(
        "parallel_sampling",
        {
            "model": args.model,
            "n": args.n,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "seed": SEED,
            "repeats": args.repeats,
            "goal_fork_share": GOAL,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
