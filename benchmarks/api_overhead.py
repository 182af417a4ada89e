"""What the agent-facing API options cost the engine: output tok/s with log-probabilities (top 5), with a
``logit_bias``, with a ``response_format`` JSON schema, with presence and frequency penalties and with
prompt log-probabilities (completions' ``echo``: logits at every prompt position, no prefix-cache hits),
against the same requests without them, side by side in one run; and the schema's grammar compile time,
cold and cached.

Workload: ``kvmesh bench engine_throughput``'s (``benchmarks/harness/engine_workload.py``: 64 requests, prompts
of 64-512 random token ids, 32-128 output tokens, greedy, ``ignore_eos``). Modes alternate within each
repeat; every run starts from an empty prefix cache. Medians over ``--repeats``. Constrained requests also
ignore EOS, so every mode generates the same tokens' count: once a JSON value is complete its grammar allows
only the stop tokens, and the mask is still computed every step.

    kvmesh bench api_overhead [--requests 64] [--repeats 3] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvmesh.bench.harness.engine_workload import workload
from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.replica import LLM, SamplingParams
from kvmesh.replica.structured import GrammarCompiler

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["title", "tags", "score"],
}
MODES = {
    "plain": {},
    "logprobs top 5": {"logprobs": 5},
    "logit_bias (10 tokens)": {"logit_bias": {100 + 7 * i: -5.0 for i in range(10)}},
    "response_format json_schema": {"json_schema": json.dumps(SCHEMA)},
    "presence + frequency penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "prompt logprobs (echo, top 1)": {"prompt_logprobs": 1},
}


def run(llm: LLM, prompts: list[list[int]], olens: list[int], extra: dict) -> float:
    llm.engine.reset_prefix_cache()
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True, **extra) for o in olens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == olens
    if "logprobs" in extra:
        assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
    if "prompt_logprobs" in extra:
        assert all(len(o.prompt_logprobs) == len(p) - 1 for o, p in zip(outs, prompts, strict=True))
    return sum(olens) / dt


def compile_times(llm: LLM) -> dict[str, float]:
    """Seconds to compile ``SCHEMA`` on a fresh compiler (its tokenizer tables included), then again."""
    engine = llm.engine
    fresh = GrammarCompiler(engine.tokenizer, engine.loaded.config.vocab_size, sorted(engine.eos_token_ids))
    t0 = time.perf_counter()
    fresh.matcher(json.dumps(SCHEMA))
    t1 = time.perf_counter()
    fresh.matcher(json.dumps(SCHEMA))
    return {"first_s": t1 - t0, "cached_s": time.perf_counter() - t1}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench api_overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    prompts, olens = workload(args.requests)
    llm = LLM(args.model)
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        for mode, extra in MODES.items():
            runs[mode].append(run(llm, prompts, olens, extra))
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{m} {v[-1]:.1f} tok/s" for m, v in runs.items()))
    med = {mode: median(v) for mode, v in runs.items()}
    compile_s = compile_times(llm)
    print(f"grammar compile: first {1000 * compile_s['first_s']:.0f} ms, cached {1000 * compile_s['cached_s']:.2f} ms")
    print_table(["mode", "output tok/s (median)", "vs plain"], [[m, v, v / med["plain"]] for m, v in med.items()])
    write_json(
        "api_overhead",
        {
            "model": args.model,
            "workload": {"requests": args.requests, "prompt_tokens": [64, 512], "output_tokens": [32, 128]},
            "repeats": args.repeats,
            "tok_per_s": runs,
            "median_tok_per_s": med,
            "vs_plain": {m: v / med["plain"] for m, v in med.items()},
            "grammar_compile": compile_s,
            "goal": {"logprobs top 5": 0.9, "response_format json_schema": 0.9},
        },
        args.json,
    )


if __name__ == "__main__":
    main()
