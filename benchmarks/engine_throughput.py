"""Output tokens/s of our engine vs Hugging Face ``generate``, side by side in one run.

Workload (fixed seed): 64 requests, prompts of 64-512 random token ids, 32-128 output tokens each
(``ignore_eos`` so every system produces exactly the requested tokens). Baselines on the same model and
weights, device and dtype (fp32 on the CPU, bf16 on a GPU unless ``--dtype``): HF ``generate`` one request
at a time, and HF ``generate`` in static left-padded batches of 16 (each batch runs until its longest
request is done; only requested tokens are counted).

    kvmesh bench engine_throughput [--requests 64] [--repeats 3] [--model smollm2-135m]
    kvmesh bench engine_throughput --device cuda --requests 256 --skip-sequential   # writes *_cuda.json
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from kvmesh.bench.harness.engine_workload import workload
from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.core.model_files import resolve_model_dir
from kvmesh.replica import LLM, SamplingParams


def run_ours(llm: LLM, prompts, olens) -> float:
    llm.engine.reset_prefix_cache()  # every repeat starts cold, like the baselines
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in olens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == olens
    return sum(olens) / dt


def _sync(hf) -> None:
    if hf.device.type == "cuda":
        torch.cuda.synchronize(hf.device)


@torch.inference_mode()
def run_hf_sequential(hf, prompts, olens) -> float:
    t0 = time.perf_counter()
    for p, o in zip(prompts, olens, strict=True):
        ids = torch.tensor([p], device=hf.device)
        hf.generate(ids, max_new_tokens=o, min_new_tokens=o, do_sample=False, pad_token_id=0)
    _sync(hf)
    return sum(olens) / (time.perf_counter() - t0)


@torch.inference_mode()
def run_hf_static(hf, prompts, olens, batch: int = 16, pad: int = 0) -> float:
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch):
        chunk, outs = prompts[s : s + batch], olens[s : s + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=hf.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=hf.device)
        m = max(outs)
        hf.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=pad)
    _sync(hf)
    return sum(olens) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench engine_throughput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-sequential", action="store_true", help="skip the slowest baseline")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--dtype", default=None, help="model dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    args = ap.parse_args(argv)

    prompts, olens = workload(args.requests)
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    device, dtype = llm.engine.runner.device, llm.engine.runner.dtype
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=dtype).to(device).eval()
    runs: dict[str, list[float]] = {"kvmesh engine": [], "HF static batch 16": [], "HF sequential": []}
    for r in range(args.repeats):
        runs["kvmesh engine"].append(run_ours(llm, prompts, olens))
        runs["HF static batch 16"].append(run_hf_static(hf, prompts, olens))
        if not args.skip_sequential:
            runs["HF sequential"].append(run_hf_sequential(hf, prompts, olens))
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in runs.items() if v))
    med = {k: median(v) for k, v in runs.items() if v}
    ours = med["kvmesh engine"]
    rows = [[k, med[k], ours / med[k]] for k in med]
    print()
    print_table(["system", "output tok/s (median)", "kvmesh speed-up"], rows)
    write_json(
        "engine_throughput" if device.type == "cpu" else f"engine_throughput_{device.type}",
        {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."),
            "workload": {"requests": args.requests, "prompt_tokens": [64, 512], "output_tokens": [32, 128], "seed": 0},
            "model": args.model,
            "repeats": args.repeats,
            "tok_per_s": runs,
            "median_tok_per_s": med,
            "speedup": {k: ours / v for k, v in med.items()},
            "goal": {"vs HF sequential": 4.0, "vs HF static batch 16": 1.5},
        },
    )


if __name__ == "__main__":
    main()
