"""Decode throughput of a batch that mixes LoRA adapters against the same batch on the base model alone.

One engine with ``enable_lora`` serves ``--seqs`` sequences at once (default 64), each a short random prompt
with ``--max-tokens`` generated tokens (EOS ignored): once all on the base model, once spread round-robin over
``--adapters`` adapters (default 8, rank 16, every projection PEFT targets; random weights written in PEFT's
format). Settings alternate their order pair by pair; the figure is the median over pairs of each pair's
ratio of decode rates (tokens per second over the steps after every sequence has its first token). Goal:
mixed adapters >= 0.8x base-only.

    kvmesh bench lora_decode [--pairs 5] [--seqs 64] [--adapters 8] [--rank 16] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from kvmesh.bench.harness.lora_files import write_adapter
from kvmesh.bench.harness.report import print_table, spread, spread_text, write_json
from kvmesh.replica import LLM, SamplingParams

GOAL = 0.8
PROMPT_TOKENS = 32


def run(llm: LLM, prompts: list[list[int]], loras: list[str | None], max_tokens: int) -> dict:
    """Generate for every prompt at once; the decode rate after all have their first token."""
    engine = llm.engine
    assert engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for prompt, lora in zip(prompts, loras, strict=True):
        engine.add_request(prompt, params, lora_name=lora)
    started, decode_from, tokens_then, total = time.perf_counter(), None, 0, 0
    while engine.has_unfinished:
        total += sum(len(out.delta_token_ids) for out in engine.step())
        if decode_from is None and total >= len(prompts):
            decode_from, tokens_then = time.perf_counter(), total
    end = time.perf_counter()
    assert total == len(prompts) * max_tokens
    return {"wall_s": end - started, "decode_tok_s": (total - tokens_then) / (end - decode_from)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench lora_decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, PROMPT_TOKENS).tolist() for _ in range(args.seqs)]
    settings = {"base": [None] * args.seqs, "mixed": [f"a{i % args.adapters}" for i in range(args.seqs)]}
    with tempfile.TemporaryDirectory() as tmp, LLM(args.model, enable_lora=True, max_lora_rank=args.rank) as llm:
        shapes = llm.engine.loaded.model.lora_shapes()
        for i in range(args.adapters):
            write_adapter(Path(tmp) / f"a{i}", shapes, args.rank, seed=i)
            llm.engine.load_lora(f"a{i}", str(Path(tmp) / f"a{i}"))
        llm.generate(prompts[0], SamplingParams(max_tokens=4), lora="a0")  # warm-up
        rows, ratios = [], []
        for pair in range(args.pairs):
            order = ["base", "mixed"] if pair % 2 == 0 else ["mixed", "base"]
            got = {name: run(llm, prompts, settings[name], args.max_tokens) for name in order}
            ratio = got["mixed"]["decode_tok_s"] / got["base"]["decode_tok_s"]
            ratios.append(ratio)
            rows.append({"pair": pair, "order": order, **{f"{k}_{n}": v for n in got for k, v in got[n].items()}})
    print_table(
        ["pair", "first", "base tok/s", "mixed tok/s", "mixed / base"],
        [
            [r["pair"], r["order"][0], r["decode_tok_s_base"], r["decode_tok_s_mixed"], f"{x:.3f}"]
            for r, x in zip(rows, ratios, strict=True)
        ],
    )
    print(f"mixed / base decode rate: {spread_text(ratios)}; goal >= {GOAL}")
    settings_out = {k: getattr(args, k) for k in ("model", "pairs", "seqs", "adapters", "rank", "max_tokens")}
    write_json("lora_decode", {**settings_out, "rows": rows, "ratio": spread(ratios), "goal": GOAL})


if __name__ == "__main__":
    main()
