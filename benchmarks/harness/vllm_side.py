"""vLLM's half of ``kvmesh bench engine_overhead``: run by the python of a virtualenv holding vLLM's CPU
build (never a kvmesh dependency), so it imports nothing of kvmesh.

    VENV/bin/python benchmarks/harness/vllm_side.py MODEL_DIR WORK.json

WORK.json: ``prompts`` (token id lists), ``output_lens``, ``sampled`` (temperature 1, top_p 0.9, unseeded:
its CPU build fails requests that carry a seed; else greedy), ``threads``, ``dtype`` (default float32),
optionally ``loras`` (per prompt a PEFT directory, or null for the base model) with ``max_lora_rank``.
Prints one JSON line: output tokens per second of ``LLM.generate`` over the whole batch, after a short
warm-up (one request per adapter, so none is read in the measured run; its prefixes then dropped from the
cache), in the same dtype on the CPU as the kvmesh side.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model, work_file = sys.argv[1], sys.argv[2]
    with open(work_file) as f:
        work = json.load(f)
    threads = int(work["threads"])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    longest = max(len(p) for p in work["prompts"]) + max(work["output_lens"])
    loras = work.get("loras") or [None] * len(work["prompts"])
    dirs = sorted({d for d in loras if d})
    lora_args = {}
    if dirs:
        lora_args = {"enable_lora": True, "max_loras": len(dirs), "max_cpu_loras": len(dirs)}
        lora_args["max_lora_rank"] = int(work["max_lora_rank"])
    adapter = {d: LoRARequest(f"a{i}", i + 1, d) for i, d in enumerate(dirs)}
    llm = LLM(
        model=model,
        dtype=work.get("dtype", "float32"),
        max_num_seqs=256,
        max_model_len=max(longest, 256),
        seed=0,
        max_num_batched_tokens=max(2048, longest),
        **lora_args,
    )

    def params(i: int, n: int) -> SamplingParams:
        if work["sampled"]:
            return SamplingParams(max_tokens=n, min_tokens=n, temperature=1.0, top_p=0.9, ignore_eos=True)
        return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)

    prompts = [TokensPrompt(prompt_token_ids=p) for p in work["prompts"]]
    warm = [*adapter.values(), None, None, None, None]
    warm_prompts = [prompts[i % len(prompts)] for i in range(len(warm))]
    llm.generate(warm_prompts, [params(i, 4) for i in range(len(warm))], use_tqdm=False, lora_request=warm)
    llm.reset_prefix_cache()  # the measured run must not find the warm-up's prompts cached
    requests = [adapter[d] if d else None for d in loras]
    t0 = time.perf_counter()
    outs = llm.generate(
        prompts, [params(i, n) for i, n in enumerate(work["output_lens"])], use_tqdm=False, lora_request=requests
    )
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"tok_per_s": tokens / dt, "tokens": tokens, "seconds": dt}))


if __name__ == "__main__":
    main()
