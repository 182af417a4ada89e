"""The GPU proof in one run: correctness on CUDA, then the engine's figures, written as they are taken.

Built for a short lease on a GPU machine with no network: models are random weights in real models' shapes
(SmolLM2-135M, Qwen3-0.6B) with SmolLM2's tokenizer (``--tokenizer``, a directory carried along), and
every section appends to ``OUT/results.json`` as soon as it ends, so a run cut short keeps what it took.

1. ``ceilings``: device-to-device copy bandwidth and a bf16 matrix product, the two roofs of the rest;
2. ``attention``: Triton decode attention at batch 1-8 and context 8k-32k (Llama-3-8B heads, bf16), as a
   share of copy bandwidth (graphs of launches over rotating KV sets, so L2 and launch gaps are out);
3. ``smollm2``: a SmolLM2-shaped bf16 engine on 256 requests (prompts 64-512, outputs 32-128, ``ignore_eos``),
   output tok/s with CUDA graphs and with ``enforce_eager``; then a decode step at batch 256 against the
   replay of its CUDA graph alone;
4. ``qwen3``: a Qwen3-0.6B-shaped engine on 256 sequences, prompts and outputs 100-1024 tokens (nano-vllm's
   benchmark shape): output tok/s, the share of HBM bandwidth it reaches, and its decode step at batch 256;
5. ``pytest``: ``tests/test_gpu.py`` on a SmolLM2-shaped stand-in (``$KVMESH_TEST_SMOLLM_DIR``).

    kvmesh bench gpu_suite OUT --tokenizer DIR [--commit SHA] [--budget-s 420]
    kvmesh bench gpu_suite OUT --tokenizer DIR --smoke    # the same code on the CPU, tiny shapes

``--smoke`` (the default without CUDA) runs every section at toy sizes on the CPU, the attention through
Triton's interpreter, to check the script end to end before GPU time is spent on it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from kvmesh.bench.harness.model_shapes import (
    Scale,
    free_device_memory,
    qwen3_config,
    save_random_model,
    smollm2_config,
)

log = logging.getLogger("gpu_suite")

LLAMA3_8B_HEADS = (32, 8, 128)  # query heads, KV heads, head dim: the decode-attention problem


SMOKE = Scale(
    requests=12,
    smollm_repeats=1,
    qwen_repeats=1,
    attention_batches=(1, 2),
    attention_contexts=(256,),
    step_batch=8,
    timed_steps=3,
    layers={"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4},
)


class Suite:
    """Runs sections in order, each under the remaining time budget, saving results after each."""

    def __init__(self, out: Path, budget_s: float, scale: Scale, device: str) -> None:
        self.out, self.scale, self.device = out, scale, device
        self.deadline = time.monotonic() + budget_s
        self.results: dict = {}
        self.pytest_k: str | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, fn, *args) -> dict | None:
        if self.left() < 20:
            log.warning("skipping %s: %.0f s of budget left", name, self.left())
            self.results[name] = {"skipped": "time budget spent"}
            self.save()
            return None
        log.info("== %s (%.0f s left)", name, self.left())
        started = time.monotonic()
        try:
            result = fn(self, *args)
        except Exception as exc:  # one failed section must not cost the others' figures
            log.error("%s failed:\n%s", name, traceback.format_exc())
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.monotonic() - started, 1)
        self.results[name] = result
        self.save()
        free_device_memory()
        return result

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=float))


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def event_ms(fn, iters: int) -> float:
    """Milliseconds per call of ``fn`` over ``iters`` calls between two CUDA events (after one warm call)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


# ---------------------------------------------------------------- what a forward pass reads


def weight_bytes(path: Path) -> int:
    """Bytes a forward pass reads of the weights: every tensor once (a tied head is read as the head)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = f.get_slice(name)
            total += int(np.prod(t.get_shape())) * {"BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
    return total


# ---------------------------------------------------------------- sections


def ceilings(suite: Suite) -> dict:
    import torch

    if suite.device != "cuda":
        return {"skipped": "no CUDA"}
    x = torch.randn(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    copy_ms = event_ms(lambda: y.copy_(x), 20)
    n = 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm_ms = event_ms(lambda: a @ b, 10)
    props = torch.cuda.get_device_properties(0)
    return {
        "copy_bandwidth_GBps": 2 * x.numel() * 4 / copy_ms / 1e6,
        "bf16_matmul_TFLOPs": 2 * n**3 / mm_ms / 1e9,
        "multiprocessors": props.multi_processor_count,
        "memory_GiB": props.total_memory / 2**30,
    }


def attention(suite: Suite) -> dict:
    """Decode attention bandwidth: KV bytes read over kernel time, against the measured copy bandwidth, with
    the engine's context split and with others (``split_sweep``), to see what the split policy leaves."""
    import torch

    from kvmesh.bench.harness.attention_problem import problem
    from kvmesh.kernels.metadata import decode_splits

    heads, kvh, d = LLAMA3_8B_HEADS
    cuda = suite.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    copy = suite.results.get("ceilings", {}).get("copy_bandwidth_GBps")
    rows = []
    for batch in suite.scale.attention_batches:
        for ctx in suite.scale.attention_contexts:
            kv_bytes = 2 * batch * ctx * kvh * d * dtype.itemsize
            sets = max(1, min(16, -(-(1 << 30) // kv_bytes))) if cuda else 1  # >= 1 GiB in flight: not L2
            problems = [problem(batch, ctx, 1, heads, kvh, d, 16, dtype, suite.device) for _ in range(sets)]
            splits = decode_splits(batch, kvh, ctx, torch.device(suite.device))
            sweep = {}
            for s in sorted({splits, *((8, 16, 32, 64) if cuda else ())}):
                ms = _attention_ms(problems, s, d**-0.5, cuda) / sets
                sweep[s] = {"ms": ms, "GBps": kv_bytes / ms / 1e6}
            row = {"batch": batch, "context": ctx, "splits": splits, **sweep[splits], "split_sweep": sweep}
            if copy:
                row["share_of_copy"] = row["GBps"] / copy
                row["best_share_of_copy"] = max(v["GBps"] for v in sweep.values()) / copy
            log.info("attention %s", row)
            rows.append(row)
            del problems
            free_device_memory()
    return {"heads": LLAMA3_8B_HEADS, "dtype": str(dtype), "rows": rows}


def _attention_ms(problems, splits: int, scale: float, cuda: bool) -> float:
    """Milliseconds for one decode-attention launch over each problem, ``splits`` parts per context."""
    import torch

    from kvmesh.kernels.triton_attention import paged_attention_triton

    for meta, *_ in problems:
        meta.decode_splits = splits

    def launches():
        for meta, q, kc, vc in problems:
            paged_attention_triton(q, kc, vc, meta, scale)

    if not cuda:
        t0 = time.perf_counter()
        launches()
        return 1e3 * (time.perf_counter() - t0)
    launches()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    return event_ms(graph.replay, 10)


def nano_vllm_workload(n: int, seed: int = 0, low: int = 100, high: int = 1024):
    rng = np.random.default_rng(seed)
    plens, olens = rng.integers(low, high + 1, n), rng.integers(low, high + 1, n)
    return [rng.integers(100, 40000, int(p)).tolist() for p in plens], [int(o) for o in olens]


def engine_kwargs(suite: Suite, kv_gib: float, max_len: int) -> dict:
    cuda = suite.device == "cuda"
    return {
        "device": suite.device,
        "dtype": "bfloat16" if cuda else "float32",
        "max_num_seqs": suite.scale.step_batch,
        "max_num_batched_tokens": 8192,
        "max_model_len": max_len,
        "kv_cache_bytes": int(kv_gib * 2**30) if cuda else 64 << 20,
        "host_cache_bytes": 0,
        "swap_space_bytes": 0,
        "torch_threads": None if cuda else 2,
    }


def timed_generate(llm, prompts, olens) -> dict:
    """Output tok/s of one cold-cache ``generate`` and the engine steps it took."""
    from kvmesh.replica import SamplingParams

    llm.engine.reset_prefix_cache()
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in olens]
    steps, step = [0], llm.engine.step

    def counted():
        steps[0] += 1
        return step()

    llm.engine.step = counted
    try:
        sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync()
        seconds = time.perf_counter() - t0
    finally:
        del llm.engine.step
    assert [len(o.token_ids) for o in outs] == olens
    return {"tok_per_s": sum(olens) / seconds, "seconds": seconds, "steps": steps[0]}


def decode_step(suite: Suite, llm) -> dict:
    """Wall time of a decode step at ``step_batch`` running sequences against the graph replay alone."""

    from kvmesh.replica import SamplingParams

    engine, batch = llm.engine, suite.scale.step_batch
    engine.reset_prefix_cache()
    rng = np.random.default_rng(1)
    steps = suite.scale.timed_steps
    for p in rng.integers(100, 40000, (batch, 64)).tolist():
        engine.add_request(p, SamplingParams(max_tokens=steps + 40, temperature=0, ignore_eos=True))
    for _ in range(12):  # prefill all, then a few decodes
        engine.step()
    assert len(engine.scheduler.running) == batch, "every sequence must be decoding"
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_ms = 1e3 * (time.perf_counter() - t0) / steps
    result = {"batch": batch, "step_ms": step_ms}
    graphs = engine.runner.graphs
    if graphs is not None and batch in graphs.graphs:
        result["graph_replay_ms"] = event_ms(graphs.graphs[batch].replay, steps)
        result["step_over_replay"] = step_ms / result["graph_replay_ms"]
    while engine.has_unfinished:
        engine.step()
    sync()
    return result


def smollm2(suite: Suite, tokenizer: Path) -> dict:
    from kvmesh.bench.harness.engine_workload import workload
    from kvmesh.replica import LLM

    model = save_random_model(
        suite.out / "models" / "smollm2-shape", smollm2_config(suite.scale), tokenizer, "bfloat16"
    )
    prompts, olens = workload(suite.scale.requests)
    result: dict = {"workload": {"requests": len(prompts), "prompt_tokens": [64, 512], "output_tokens": [32, 128]}}
    for mode, eager in (("cuda_graphs", False), ("eager", True)):
        if suite.device != "cuda" and not eager:
            continue
        t0 = time.perf_counter()
        llm = LLM(str(model), enforce_eager=eager, **engine_kwargs(suite, 8, 1024))
        runs = {"start_s": time.perf_counter() - t0, "cold": timed_generate(llm, prompts, olens), "warm": []}
        repeats = suite.scale.smollm_repeats if not eager else max(1, suite.scale.smollm_repeats - 1)
        for _ in range(repeats):
            if suite.left() < 60:
                break
            runs["warm"].append(timed_generate(llm, prompts, olens))
        runs["median_tok_per_s"] = float(np.median([r["tok_per_s"] for r in runs["warm"] or [runs["cold"]]]))
        log.info("smollm2 %s: %.0f tok/s", mode, runs["median_tok_per_s"])
        if not eager or suite.device != "cuda":
            runs["decode_step"] = decode_step(suite, llm)
            log.info("smollm2 decode step %s", runs["decode_step"])
        result[mode] = runs
        del llm
        free_device_memory()
    return result


def qwen3(suite: Suite, tokenizer: Path) -> dict:
    from kvmesh.replica import LLM

    model = save_random_model(
        suite.out / "models" / "qwen3-0.6b-shape", qwen3_config(suite.scale), tokenizer, "bfloat16"
    )
    high = 1024 if suite.device == "cuda" else 48
    prompts, olens = nano_vllm_workload(suite.scale.requests, high=high, low=min(100, high // 2))
    t0 = time.perf_counter()
    llm = LLM(str(model), **engine_kwargs(suite, 48, 2 * high + 16))
    result: dict = {"start_s": time.perf_counter() - t0, "weight_bytes": weight_bytes(model)}
    timed_generate(llm, prompts[:16], [min(o, 32) for o in olens[:16]])  # compile the shapes first
    kv_per_token = llm.engine.bytes_per_block / llm.engine.config.block_size
    # KV a decode pass reads: each output token attends over its prompt and the outputs before it.
    kv_read = kv_per_token * sum(o * p + o * (o - 1) / 2 for p, o in zip(map(len, prompts), olens, strict=True))
    runs = []
    for _ in range(suite.scale.qwen_repeats):
        if runs and suite.left() < 120:
            break
        run = timed_generate(llm, prompts, olens)
        run["bytes"] = run["steps"] * result["weight_bytes"] + kv_read
        run["GBps"] = run["bytes"] / run["seconds"] / 1e9
        copy = suite.results.get("ceilings", {}).get("copy_bandwidth_GBps")
        if copy:
            run["share_of_copy"] = run["GBps"] / copy
        log.info("qwen3 %s", run)
        runs.append(run)
    result.update(
        runs=runs,
        median_tok_per_s=float(np.median([r["tok_per_s"] for r in runs])),
        preemptions=llm.engine.stats().num_preemptions,
        workload={"sequences": len(prompts), "prompt_tokens": [100, high], "output_tokens": [100, high]},
    )
    if suite.left() > 60:
        result["decode_step"] = decode_step(suite, llm)
        log.info("qwen3 decode step %s", result["decode_step"])
    return result


def pytest_gpu(suite: Suite, tokenizer: Path) -> dict:
    model = save_random_model(
        suite.out / "models" / "smollm2-test", smollm2_config(Scale(), tied=False), tokenizer, "float32", 20.0
    )
    env = {**os.environ, "KVMESH_TEST_SMOLLM_DIR": str(model)}
    cmd = [sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-rfEs", "-p", "no:cacheprovider"]
    cmd += ["--timeout", "150", f"--junitxml={suite.out / 'test_gpu.xml'}"]
    if suite.pytest_k:
        cmd += ["-k", suite.pytest_k]
    limit = max(30.0, suite.left() - 10)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, rc = f"{exc.stdout or ''}{exc.stderr or ''}\n[killed after {limit:.0f} s]", "timeout"
    (suite.out / "test_gpu.log").write_text(output if isinstance(output, str) else output.decode())
    summary = next(
        (
            ln
            for ln in reversed(str(output).splitlines())
            if any(w in ln for w in (" passed", " failed", " skipped", " error"))
        ),
        "",
    )
    return {"returncode": rc, "summary": summary.strip("= ")}


# ---------------------------------------------------------------- driver


def machine(commit: str | None) -> dict:
    import torch
    import triton

    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def summary_rows(results: dict) -> list[list[str]]:
    def get(*keys):
        value = results
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        return value

    def fmt(v, spec=".0f"):
        return "-" if v is None else format(v, spec)

    rows = [
        ["copy bandwidth GB/s", fmt(get("ceilings", "copy_bandwidth_GBps")), ""],
        ["bf16 matmul TFLOP/s", fmt(get("ceilings", "bf16_matmul_TFLOPs")), ""],
        ["SmolLM2 bf16 tok/s, CUDA graphs", fmt(get("smollm2", "cuda_graphs", "median_tok_per_s")), ">= 20,000"],
        ["SmolLM2 bf16 tok/s, eager", fmt(get("smollm2", "eager", "median_tok_per_s")), ""],
        [
            "SmolLM2 step / replay at 256",
            fmt(get("smollm2", "cuda_graphs", "decode_step", "step_over_replay"), ".2f"),
            "<= 1.3x",
        ],
        ["Qwen3-0.6B tok/s", fmt(get("qwen3", "median_tok_per_s")), ""],
        ["Qwen3 step / replay at 256", fmt(get("qwen3", "decode_step", "step_over_replay"), ".2f"), "<= 1.3x"],
    ]
    for row in get("attention", "rows") or []:
        share = row.get("share_of_copy")
        rows.append(
            [f"attention b{row['batch']} ctx{row['context']}", fmt(share and 100 * share, ".0f") + "%", ">= 70%"]
        )
    rows.append(["pytest tests/test_gpu.py", str(get("pytest", "summary")), "all pass"])
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench gpu_suite", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path, help="folder for results.json, suite.log, test_gpu.log")
    ap.add_argument("--tokenizer", type=Path, required=True, help="a folder with SmolLM2's tokenizer files")
    ap.add_argument("--commit", help="the commit under test (the GPU machine's copy has no git history)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting sections after this long")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the default without CUDA)")
    ap.add_argument("--sections", default="ceilings,attention,smollm2,qwen3,pytest")
    ap.add_argument("--pytest-k", help="run only the tests of tests/test_gpu.py that match (pytest -k)")
    args = ap.parse_args(argv)

    import torch

    smoke = args.smoke or not torch.cuda.is_available()
    if smoke and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on the CPU
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        handlers=[logging.StreamHandler(), logging.FileHandler(args.out / "suite.log")],
    )
    suite = Suite(args.out, args.budget_s, SMOKE if smoke else Scale(), "cpu" if smoke else "cuda")
    suite.pytest_k = args.pytest_k
    suite.results["machine"] = machine(args.commit)
    log.info("machine %s", suite.results["machine"])
    sections = {
        "ceilings": (ceilings,),
        "attention": (attention,),
        "smollm2": (smollm2, args.tokenizer),
        "qwen3": (qwen3, args.tokenizer),
        "pytest": (pytest_gpu, args.tokenizer),
    }
    for name in args.sections.split(","):
        fn, *rest = sections[name]
        suite.run(name, fn, *rest)
    shutil.rmtree(args.out / "models", ignore_errors=True)  # GBs of random weights: not worth carrying back
    from kvmesh.bench.harness.report import print_table

    print()
    print_table(["figure", "measured", "goal"], summary_rows(suite.results))


if __name__ == "__main__":
    main()
