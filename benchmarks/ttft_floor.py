"""Where an idle engine's time to first token goes, for short and long prompts none of which is cached.

The same prompt lengths (random token ids) three ways: through ``kvmesh engine``'s HTTP API (a streamed
``/v1/completions``, one token, back to back, and again after the engine sat idle ``--idle-s``), in-process
through the engine's step loop, and inside that the model's forward pass (synchronized on CUDA). So:
server = HTTP - in-process (HTTP, tokenizer-free request handling, the stream), host = in-process - forward
(scheduling, batch preparation, sampling, outputs), forward = the model. ``--profile DIR`` also writes
torch.profiler's table of one in-process request of the shortest length (ops by self CPU time, and the count
of device kernels it launched). Engines run alone: nothing else should use the machine.

    kvmesh bench ttft_floor [--model smollm2-135m] [--device cpu] [--threads 1] [--repeats 7]
    kvmesh bench ttft_floor --shape tiny --json ttft_floor_tiny       # the engine's own floor
    kvmesh bench ttft_floor --shape llama8b --tokenizer DIR --device cuda --kv-cache-gib 8 --profile OUT
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import httpx

from kvmesh.bench.harness.peer_fleet import Child
from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.cluster.launch.embedded_redis import free_port


def random_prompts(rng: random.Random, n: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``n`` random token ids (below SmolLM2's vocabulary): none shares a block."""
    return [[rng.randrange(1000, 40000) for _ in range(n)] for _ in range(count)]


def http_ttft(url: str, model: str, prompt: list[int], client: httpx.Client) -> float:
    """Seconds from sending a streamed one-token completion of ``prompt`` to its first chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        next(line for line in response.iter_lines() if line.startswith("data: "))
    return time.perf_counter() - t0


def over_http(args: argparse.Namespace, model: str, lengths: list[int]) -> dict[int, dict[str, float]]:
    """Per length, median HTTP TTFT (s) back to back and after ``--idle-s`` of idleness."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", model, "--port", str(port)]
    cmd += ["--device", args.device, "--threads", str(args.threads), *engine_flags(args)]
    child = Child("engine", cmd, f"http://127.0.0.1:{port}", "/health")
    rng, out = random.Random(1), {}
    try:
        child.wait_ready(args.ready_timeout_s)
        with httpx.Client(timeout=300) as client:
            for p in random_prompts(rng, lengths[-1], 2):  # the first requests of a fresh engine
                http_ttft(child.url, model, p, client)
            for n in lengths:
                busy = [http_ttft(child.url, model, p, client) for p in random_prompts(rng, n, args.repeats)]
                idle = []
                for p in random_prompts(rng, n, args.idle_repeats):
                    time.sleep(args.idle_s)
                    idle.append(http_ttft(child.url, model, p, client))
                out[n] = {"http_s": median(busy), "http_after_idle_s": median(idle)}
                print(f"http {n} tokens: {1000 * out[n]['http_s']:.1f} ms", file=sys.stderr, flush=True)
    finally:
        child.stop()
    return out


def engine_flags(args: argparse.Namespace) -> list[str]:
    return ["--kv-cache-gib", f"{args.kv_cache_gib:g}"] if args.kv_cache_gib else []


def in_process(args: argparse.Namespace, model: str, lengths: list[int]) -> dict[int, dict[str, float]]:
    """Per length, median in-process TTFT (s) and the forward passes' share of it (s)."""
    import torch

    from kvmesh.replica import LLM, SamplingParams

    kv = {"kv_cache_bytes": int(args.kv_cache_gib * (1 << 30))} if args.kv_cache_gib else {}
    engine = LLM(model, device=args.device, torch_threads=args.threads, **kv).engine
    cuda = args.device == "cuda"
    forward, inside = engine.runner.forward, [0.0]

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return forward(*a, **kw)
        finally:
            if cuda:
                torch.cuda.synchronize()
            inside[0] += time.perf_counter() - t

    engine.runner.forward = timed

    def first_token(prompt: list[int]) -> tuple[float, float]:
        inside[0] = 0.0
        t0 = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
        while not engine.step():
            pass
        while engine.has_unfinished:
            engine.step()
        return time.perf_counter() - t0, inside[0]

    rng, out = random.Random(2), {}
    try:
        for p in random_prompts(rng, lengths[-1], 2):
            first_token(p)
        for n in lengths:
            runs = [first_token(p) for p in random_prompts(rng, n, args.repeats)]
            out[n] = {"in_process_s": median([r[0] for r in runs]), "forward_s": median([r[1] for r in runs])}
            print(f"in-process {n} tokens: {1000 * out[n]['in_process_s']:.1f} ms", file=sys.stderr, flush=True)
        if args.profile:
            profile(first_token, random_prompts(rng, lengths[0], 1)[0], args.profile, cuda)
    finally:
        engine.close()
    return out


def profile(first_token, prompt: list[int], out_dir: Path, cuda: bool) -> None:
    """torch.profiler's op table of one first token, and the count of device kernels it launched."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch_profile(activities=activities) as prof:
        first_token(prompt)
    events = prof.key_averages()
    kernels = sum(e.count for e in events if getattr(e, "device_type", None) and "CUDA" in str(e.device_type))
    out_dir.mkdir(parents=True, exist_ok=True)
    table = events.table(sort_by="self_cpu_time_total", row_limit=40)
    (out_dir / "ttft_floor_profile.txt").write_text(f"device kernels: {kernels}\n{table}\n")
    prof.export_chrome_trace(str(out_dir / "ttft_floor_trace.json"))
    print(f"profile of one {len(prompt)}-token first token: {out_dir}", file=sys.stderr, flush=True)


def random_weights(shape: str, tokenizer: Path | None) -> str:
    """A model directory of random weights in ``shape`` (``benchmarks/harness/model_shapes.py``; ``tiny``: the
    1-layer model of ``kvmesh bench engine_overhead``, whose forward pass is nearly free), reused if present."""
    from kvmesh.bench.harness.model_shapes import (
        LLAMA3_8B_SHAPE,
        Scale,
        llama_shaped,
        random_model,
        smollm2_config,
        tiny_model,
    )

    if shape == "tiny":
        path = Path("/tmp/kvmesh-random-tiny")
        return str(path if (path / "model.safetensors").exists() else tiny_model(path, 49152))
    config = llama_shaped(LLAMA3_8B_SHAPE, tied=False, rope_theta=500000.0) if shape == "llama8b" else None
    return str(random_model(shape, config or smollm2_config(Scale()), tokenizer, "bfloat16"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench ttft_floor", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m", help="alias, directory or .gguf (or --shape)")
    ap.add_argument("--shape", choices=("llama8b", "smollm2", "tiny"), help="random weights in this shape instead")
    ap.add_argument("--tokenizer", type=Path, help="with --shape: a directory of SmolLM2's tokenizer files")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--kv-cache-gib", type=float, help="the engine's KV pool (default: the engine's)")
    ap.add_argument("--lengths", default="16,128,512,1024", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--idle-s", type=float, default=1.0, help="idleness before each 'after idle' request")
    ap.add_argument("--idle-repeats", type=int, default=3)
    ap.add_argument("--ready-timeout-s", type=float, default=600)
    ap.add_argument("--profile", type=Path, help="a directory for torch.profiler's table and trace")
    ap.add_argument("--json", default="ttft_floor", help="results file name under benchmarks/results")
    args = ap.parse_args(argv)
    if args.shape in ("llama8b", "smollm2") and not args.tokenizer:
        ap.error(f"--shape {args.shape} needs --tokenizer")
    lengths = sorted(int(n) for n in args.lengths.split(","))
    model = random_weights(args.shape, args.tokenizer) if args.shape else args.model
    inner = in_process(args, model, lengths)
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    outer = over_http(args, model, lengths)
    rows, table = [], []
    for n in lengths:
        row = {"tokens": n, **outer[n], **inner[n]}
        rows.append(row)
        ms = {k: 1000 * v for k, v in row.items() if k != "tokens"}
        server, host = ms["http_s"] - ms["in_process_s"], ms["in_process_s"] - ms["forward_s"]
        table.append([n, ms["http_s"], ms["http_after_idle_s"], ms["in_process_s"], ms["forward_s"], host, server])
    print_table(["tokens", "HTTP ms", "after idle", "in-process", "forward", "host", "server"], table)
    write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "model": model, "rows": rows})


if __name__ == "__main__":
    main()
