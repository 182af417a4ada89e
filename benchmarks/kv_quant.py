"""Quantized KV cache: sequences admitted at a fixed KV budget, the speed of each format, and what it costs in quality.

1. Concurrency: the same byte budget per dtype (sized to hold ``--fit`` sequences in the model dtype),
   ``--requests`` requests of ``--prompt`` random tokens + ``--output`` tokens submitted at once, no prefix
   sharing; reports the pool's blocks and the most sequences running at once. Run for a bf16 model (the
   GPU case: ``auto`` = 2 bytes, goal fp8 exactly 2x) and the fp32 CPU default (``auto`` = 4 bytes).
2. Speed: ``--speed-requests`` requests of ``--prompt`` random tokens + ``--speed-output`` tokens served at
   once by an fp32 engine whose pool holds them all, per dtype (median of ``--repeats``): what quantized
   stores and attention cost per step, apart from admission.
3. Quality (fp32 SmolLM2, the CPU default): a fixed set of chat prompts, ``--max-tokens`` greedy tokens
   with the full-precision cache; then for each quantized dtype (a) free-running greedy agreement (the
   share of generated tokens before the first difference, and whole sequences identical) and (b) teacher
   forced on the full-precision continuation: mean |log p| difference of its tokens and top-1 agreement,
   from one forward over prompt + continuation through the paged (quantized) cache; and (c) perplexity of
   ``--ppl-chunks`` x ``--ppl-tokens`` tokens of Python's pydoc topics text, teacher forced the same way,
   and its text top-1: how often the top prediction at each of those positions is the full cache's (eight
   times the positions of (b), so a finer reading of the same agreement).

    kvmesh bench kv_quant [--model smollm2-135m] [--requests 24] [--fit 4] [--max-tokens 64]
        [--skip-concurrency] [--speed-requests 16] [--speed-output 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvmesh.bench.harness.kv_quality import PROMPTS, perplexity_text, teacher_forced_logprobs, text_scores
from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.core.kv_dtype import KV_CACHE_DTYPES
from kvmesh.replica import LLM, SamplingParams
from kvmesh.replica.model_runner import kv_bytes_per_block


def speed(model: str, requests: int, prompt: int, output: int, repeats: int) -> list[dict]:
    """Seconds to serve the same requests all at once with every KV dtype, the pool big enough for all (fp32
    model): what each dtype's store and attention cost, apart from how many sequences it admits."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, 40000, prompt).tolist() for _ in range(requests)]
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    rows = []
    for kv in KV_CACHE_DTYPES:
        llm = LLM(model, kv_cache_dtype=kv, max_num_seqs=requests, num_kv_blocks=requests * -(-(prompt + output) // 16))
        llm.generate(prompts[:2], params)  # warm-up
        times = []
        for _ in range(repeats):
            llm.engine.reset_prefix_cache()
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            times.append(time.perf_counter() - t0)
        rows.append({"kv_cache_dtype": kv, "seconds": float(np.median(times)), "runs": times})
        print(f"  speed {kv}: {np.median(times):.2f} s", flush=True)
    for r in rows:
        r["output_tok_s"] = requests * output / r["seconds"]
        r["vs_auto"] = rows[0]["seconds"] / r["seconds"]
    return rows


def concurrency(model: str, dtype: str, requests: int, prompt: int, output: int, fit: int) -> list[dict]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, prompt).tolist() for _ in range(requests)]
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    probe = LLM(model, num_kv_blocks=1, dtype=dtype).engine
    budget = fit * -(-(prompt + output) // 16) * kv_bytes_per_block(probe.loaded, 16, probe.runner.dtype)
    del probe
    rows = []
    for kv in KV_CACHE_DTYPES:
        llm = LLM(model, kv_cache_bytes=budget, dtype=dtype, kv_cache_dtype=kv, max_num_seqs=256)
        engine = llm.engine
        for p in prompts:
            engine.add_request(p, params)
        peak, t0, done = 0, time.perf_counter(), 0
        while engine.has_unfinished:
            done += sum(o.finished for o in engine.step())
            peak = max(peak, engine.stats().num_running)
        engine.check_integrity()
        rows.append(
            {
                "model_dtype": dtype,
                "kv_cache_dtype": kv,
                "budget_bytes": budget,
                "blocks": engine.num_blocks,
                "peak_running": peak,
                "completed": done,
                "preemptions": engine.stats().num_preemptions,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(f"  {dtype} {kv}: {engine.num_blocks} blocks, peak {peak} running", flush=True)
    auto = rows[0]["peak_running"]
    for r in rows:
        r["vs_auto"] = r["peak_running"] / auto
    return rows


def quality(model: str, max_tokens: int, ppl_chunks: int, ppl_tokens: int) -> list[dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results, ref_outs, ref_lps, ref_top = [], [], [], None
    for kv in KV_CACHE_DTYPES:  # "auto" first: the reference
        llm = LLM(model, kv_cache_dtype=kv)
        if kv == "auto":
            ids = llm.engine.tokenizer.encode(perplexity_text())
            chunks = [ids[i * ppl_tokens : (i + 1) * ppl_tokens] for i in range(ppl_chunks)]
        chats = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        outs = [o.token_ids for o in llm.generate(chats, params)]
        if kv == "auto":
            ref_outs = outs
            ref_lps = [teacher_forced_logprobs(llm, c + o, len(c)) for c, o in zip(chats, outs, strict=True)]
        prefix_share, identical, dlogp, top1 = [], 0, [], []
        for chat, out, ref_out, ref_lp in zip(chats, outs, ref_outs, ref_lps, strict=True):
            same = next((i for i, (a, b) in enumerate(zip(out, ref_out, strict=True)) if a != b), len(ref_out))
            prefix_share.append(same / len(ref_out))
            identical += same == len(ref_out)
            lp = ref_lp if kv == "auto" else teacher_forced_logprobs(llm, chat + ref_out, len(chat))
            target = torch.tensor(ref_out)[:, None]
            dlogp.append(float((lp.gather(1, target) - ref_lp.gather(1, target)).abs().mean()))
            top1.append(float((lp.argmax(-1) == target[:, 0]).float().mean()))
        ppl, top = text_scores(llm, chunks)
        ref_top = top if ref_top is None else ref_top
        results.append(
            {
                "kv_cache_dtype": kv,
                "prompts": len(chats),
                "tokens_each": max_tokens,
                "greedy_prefix_agreement": float(np.mean(prefix_share)),
                "identical_sequences": identical,
                "mean_abs_logprob_diff": float(np.mean(dlogp)),
                "teacher_forced_top1": float(np.mean(top1)),
                "perplexity": ppl,
                "perplexity_tokens": ppl_chunks * (ppl_tokens - 1),
                "text_top1": float((top == ref_top).float().mean()),
            }
        )
        print(f"  quality {kv}: done", flush=True)
    return results


def print_quality(rows: list[dict]) -> None:
    """Per KV dtype: greedy agreement, teacher-forced differences and perplexity against the full cache's."""
    ppl0 = rows[0]["perplexity"]
    print_table(
        [
            "KV dtype",
            "greedy prefix agreement",
            "identical seqs",
            "mean |dlogp|",
            "teacher-forced top-1",
            "text top-1",
            "perplexity",
        ],
        [
            [
                r["kv_cache_dtype"],
                f"{100 * r['greedy_prefix_agreement']:.1f}%",
                f"{r['identical_sequences']}/{r['prompts']}",
                f"{r['mean_abs_logprob_diff']:.4f}",
                f"{100 * r['teacher_forced_top1']:.1f}%",
                f"{100 * r['text_top1']:.2f}%",
                f"{r['perplexity']:.3f} ({100 * (r['perplexity'] / ppl0 - 1):+.2f}%)",
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench kv_quant", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=244, help="with --output 8: 252 tokens = 16 blocks, no growth")
    ap.add_argument("--output", type=int, default=8)
    ap.add_argument("--fit", type=int, default=4, help="sequences the budget holds in the model dtype")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ppl-chunks", type=int, default=8, help="perplexity: chunks of the pydoc topics text")
    ap.add_argument("--ppl-tokens", type=int, default=1024, help="perplexity: tokens per chunk")
    ap.add_argument("--skip-concurrency", action="store_true")
    ap.add_argument("--speed-requests", type=int, default=16, help="speed: requests served at once")
    ap.add_argument("--speed-output", type=int, default=64, help="speed: output tokens each")
    ap.add_argument("--repeats", type=int, default=3, help="speed: runs per dtype (median)")
    args = ap.parse_args(argv)
    out: dict = {"concurrency": [], "quality": [], "speed": []}
    for dtype in () if args.skip_concurrency else ("bfloat16", "float32"):
        out["concurrency"] += concurrency(args.model, dtype, args.requests, args.prompt, args.output, args.fit)
    print_table(
        ["model dtype", "KV dtype", "budget MiB", "blocks", "peak running", "vs auto", "preemptions", "s"],
        [
            [
                r["model_dtype"],
                r["kv_cache_dtype"],
                r["budget_bytes"] / 2**20,
                r["blocks"],
                r["peak_running"],
                f"{r['vs_auto']:.2f}x",
                r["preemptions"],
                r["seconds"],
            ]
            for r in out["concurrency"]
        ],
    )
    out["speed"] = speed(args.model, args.speed_requests, args.prompt, args.speed_output, args.repeats)
    print_table(
        ["KV dtype (fp32 model)", "median s", "output tok/s", "vs auto"],
        [[r["kv_cache_dtype"], r["seconds"], r["output_tok_s"], f"{r['vs_auto']:.2f}x"] for r in out["speed"]],
    )
    out["quality"] = quality(args.model, args.max_tokens, args.ppl_chunks, args.ppl_tokens)
    print_quality(out["quality"])
    write_json("kv_quant", out)


if __name__ == "__main__":
    main()
