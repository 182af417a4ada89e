"""Preemption-heavy runs: throughput with the swap tier vs recompute, side by side.

Workload (fixed seed): ``--requests`` requests of ``--prompt`` random tokens + ``--output`` tokens
(``ignore_eos``), submitted at once to one engine whose KV pool holds ``--fit`` prompts but not their
outputs, so running sequences are preempted again and again as they grow. Each ``preemption_mode``
(recompute, swap, auto) runs on a fresh engine, in alternation, ``--repeats`` times; medians. Reports
output tokens/s, the preemptions, how many swapped, and the computed tokens thrown away (recomputed).

    kvmesh bench swap [--model smollm2-135m] [--prompt 512] [--output 256] [--requests 6] [--fit 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.replica import LLM, SamplingParams

MODES = ("recompute", "swap", "auto")


def run(model: str, mode: str, prompts: list[list[int]], output: int, blocks: int) -> dict:
    llm = LLM(model, num_kv_blocks=blocks, preemption_mode=mode, max_num_seqs=len(prompts))
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    llm.engine.check_integrity()
    s = llm.stats()
    return {
        "mode": mode,
        "seconds": seconds,
        "output_tok_s": sum(len(o.token_ids) for o in outs) / seconds,
        "preemptions": s.num_preemptions,
        "swapped": s.num_swapped_out,
        "recomputed_tokens": s.num_recomputed_tokens,
        "tokens": [o.token_ids for o in outs],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench swap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--fit", type=int, default=3, help="prompts the KV pool holds at once (not their outputs)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.prompt).tolist() for _ in range(args.requests)]
    blocks = args.fit * -(-(args.prompt + 1) // 16)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            runs[mode].append(run(args.model, mode, prompts, args.output, blocks))
            print(f"  repeat {r + 1}/{args.repeats} {mode}: {runs[mode][-1]['seconds']:.1f} s", flush=True)
    reference = runs["recompute"][0]["tokens"]
    rows = []
    for mode, results in runs.items():
        rows.append(
            {
                "mode": mode,
                "output_tok_s": median([x["output_tok_s"] for x in results]),
                "seconds": median([x["seconds"] for x in results]),
                "preemptions": results[0]["preemptions"],
                "swapped": results[0]["swapped"],
                "recomputed_tokens": results[0]["recomputed_tokens"],
                "same_tokens_as_recompute": all(x["tokens"] == reference for x in results),
            }
        )
    base = rows[0]["output_tok_s"]
    print_table(
        ["mode", "output tok/s", "vs recompute", "s", "preemptions", "swapped", "recomputed tokens", "same tokens"],
        [
            [
                r["mode"],
                r["output_tok_s"],
                f"{r['output_tok_s'] / base:.2f}x",
                r["seconds"],
                r["preemptions"],
                r["swapped"],
                r["recomputed_tokens"],
                r["same_tokens_as_recompute"],
            ]
            for r in rows
        ],
    )
    config = {k: getattr(args, k) for k in ("model", "prompt", "output", "requests", "fit", "repeats")}
    write_json(f"swap_p{args.prompt}", {"config": {**config, "kv_blocks": blocks}, "results": rows})


if __name__ == "__main__":
    main()
