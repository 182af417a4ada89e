"""Paged-attention kernel timings.

CPU (runs everywhere): paging overhead of the torch path, i.e. paged decode attention over SDPA on
contiguous KV of the same size, for both CPU decode routes side by side: the compiled kernel that reads the
paged cache in place (``kernels/cpu_extension.py``, the default) and the gather fallback (gather through
block tables + SDPA). Batch 32, context 1,024, SmolLM2 shapes (9 query heads, 3 KV heads, head_dim 64),
block 16, shuffled block tables, torch's default thread count. Goal <= 1.5x. Then the decode kernel alone in
float32 and bfloat16 on batches of mixed context lengths (ms and KV bytes read per second). Then causal
prefill / extend: the compiled prefill kernel against the gather + SDPA fallback, prompts of 64 to 1,024
tokens.

CUDA (when a GPU is present): Triton decode vs the torch path vs SDPA on pre-gathered contiguous KV, for
decode batch 1-256 and context 512-32k, with achieved bandwidth (KV bytes read / time) as a fraction of
the device's measured device-to-device copy bandwidth; and extend (1-4k new tokens on 0-16k cached).
Goal on H100/H200: decode >= 70% of copy bandwidth at batch >= 32, context >= 4k.

    kvmesh bench attention_kernels [--repeats 20]
    kvmesh bench attention_kernels --cuda-only   # the GPU sweep alone, to attention_kernels_cuda.json
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kvmesh.kernels.torch_attention
from kvmesh.bench.harness.attention_problem import problem
from kvmesh.bench.harness.report import median, print_table, write_json
from kvmesh.kernels.cpu_extension import cpu_op
from kvmesh.kernels.torch_attention import paged_attention_torch


def contiguous(meta, cache, ctx):
    """The same KV, gathered once into the [batch, kv_heads, ctx, head_dim] layout SDPA wants."""
    return cache[meta.block_tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()


def timeit(fn, repeats: int, sync=lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return median(times)


def cpu_overhead(repeats: int) -> dict:
    batch, ctx, heads, kvh, d = 32, 1024, 9, 3, 64
    meta, q, kc, vc = problem(batch, ctx, 1, heads, kvh, d, 16, torch.float32, "cpu")
    k, v = contiguous(meta, kc, ctx), contiguous(meta, vc, ctx)
    qs = q.view(batch, heads, 1, d)
    scale = d**-0.5
    if cpu_op("paged_decode") is None:
        raise SystemExit("the CPU decode kernel did not build (see the warning above)")

    def gather_route():
        kvmesh.kernels.torch_attention.cpu_op = lambda name: None  # what runs where no compiler is
        try:
            return paged_attention_torch(q, kc, vc, meta, scale)
        finally:
            kvmesh.kernels.torch_attention.cpu_op = cpu_op

    paged, gather, sdpa = [], [], []
    for _ in range(5):  # interleaved rounds: machine noise hits all three alike
        paged.append(timeit(lambda: paged_attention_torch(q, kc, vc, meta, scale), repeats))
        gather.append(timeit(gather_route, repeats))
        sdpa.append(timeit(lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True), repeats))
    paged, gather, sdpa = median(paged), median(gather), median(sdpa)
    return {
        "batch": batch,
        "context": ctx,
        "threads": torch.get_num_threads(),
        "paged_ms": 1000 * paged,
        "gather_ms": 1000 * gather,
        "sdpa_contiguous_ms": 1000 * sdpa,
        "overhead": paged / sdpa,
        "gather_overhead": gather / sdpa,
        "goal": 1.5,
    }


DECODE_SHAPES = [(1, 4096, 4096), (8, 64, 640), (32, 64, 640), (64, 64, 640), (64, 1024, 1024)]
"""(batch, shortest, longest context) of the CPU decode kernel's table: one long context, and batches of the
engine_throughput workload's lengths (prompts of 64-512 tokens and up to 128 generated)."""


def last_level_cache_bytes() -> int:
    """The CPU's last-level cache (Linux sysfs), or 64 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
    return max(sizes, default=64 * 2**20)


def cpu_decode(repeats: int) -> list[dict]:
    """The compiled decode kernel alone (``paged_decode``), median of 5 rounds, in both dtypes, twice: on one
    cache the rounds keep warm in the CPU's caches, and cold, cycling through copies that together hold twice
    the last-level cache, as an engine step does (every layer's KV and weights pass between two reads of
    one layer's KV)."""
    op = cpu_op("paged_decode")
    if op is None:
        raise SystemExit("the CPU decode kernel did not build (see the warning above)")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for batch, shortest, longest in DECODE_SHAPES:
            rng = random.Random(0)
            lens = [rng.randint(shortest, longest) for _ in range(batch)]  # mixed, as a running batch's
            meta, q, kc, vc = problem(batch, lens, 1, 9, 3, 64, 16, dtype, "cpu")
            keys = sum(lens)
            out, ids = torch.empty_like(q), torch.arange(batch)
            kv_bytes = 2 * keys * 3 * 64 * kc.element_size()
            copies = -(-2 * last_level_cache_bytes() // (2 * kc.nbytes))
            cold = [(torch.randn_like(kc), torch.randn_like(vc)) for _ in range(copies)]
            rest = (None, None, meta.block_tables, meta.seq_lens, meta.query_start_loc, ids, 0.125, 0)
            calls = {
                "warm": itertools.repeat((out, q, kc, vc, *rest)),
                "cold": ((out, q, k, v, *rest) for k, v in itertools.cycle(cold)),
            }
            ms = {
                n: 1000 * median([timeit(lambda c=c: op(*next(c)), repeats) for _ in range(5)])
                for n, c in calls.items()
            }
            del calls, cold
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "batch": batch,
                    "context": f"{shortest}-{longest}" if shortest != longest else str(shortest),
                    "warm_ms": ms["warm"],
                    "cold_ms": ms["cold"],
                    "warm_kv_GBps": kv_bytes / ms["warm"] / 1e6,
                    "cold_kv_GBps": kv_bytes / ms["cold"] / 1e6,
                }
            )
    return rows


PREFILL_SHAPES = [(8, 64, 64), (1, 128, 128), (4, 256, 256), (1, 512, 512), (1, 2048, 512), (2, 1024, 1024)]
"""(batch, context, new tokens) of the CPU prefill comparison: whole prompts of the engine_throughput
workload's sizes (64-512), an extend of 512 tokens on 1.5k cached, and long prompts."""


def _prefill(problem_args: tuple, head_dim: int, use_kernel: bool) -> None:
    meta, q, kc, vc = problem_args
    if not use_kernel:
        kvmesh.kernels.torch_attention.cpu_op = lambda name: None if name == "paged_prefill" else cpu_op(name)
    try:
        paged_attention_torch(q, kc, vc, meta, head_dim**-0.5)
    finally:
        kvmesh.kernels.torch_attention.cpu_op = cpu_op


def cpu_prefill(repeats: int) -> list[dict]:
    """Causal prefill / extend on SmolLM2 shapes: the compiled kernel reading the paged cache in place vs
    the fallback (gather each sequence's blocks, then torch's SDPA), in interleaved rounds."""
    if cpu_op("paged_prefill") is None:
        raise SystemExit("the CPU prefill kernel did not build (see the warning above)")
    heads, kvh, d = 9, 3, 64
    rows = []
    for batch, ctx, new in PREFILL_SHAPES:
        args = problem(batch, ctx, new, heads, kvh, d, 16, torch.float32, "cpu")
        kernel, fallback = [], []
        for _ in range(5):
            kernel.append(timeit(lambda a=args: _prefill(a, d, use_kernel=True), repeats))
            fallback.append(timeit(lambda a=args: _prefill(a, d, use_kernel=False), repeats))
        k_s, f_s = median(kernel), median(fallback)
        flops = batch * heads * d * 4 * sum(ctx - new + j + 1 for j in range(new))  # q.k and p.v, causal
        rows.append(
            {
                "batch": batch,
                "context": ctx,
                "new_tokens": new,
                "kernel_ms": 1000 * k_s,
                "gather_sdpa_ms": 1000 * f_s,
                "speedup": f_s / k_s,
                "kernel_gflops": flops / k_s / 1e9,
                "gather_sdpa_gflops": flops / f_s / 1e9,
            }
        )
    return rows


def copy_bandwidth(device) -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    t = timeit(lambda: y.copy_(x), 20, torch.cuda.synchronize)
    return 2 * x.numel() / t  # read + write


def time_kernels(meta, q, kc, vc, repeats: int, with_sdpa: bool) -> dict:
    """Median times (ms) of the Triton kernels, the torch path and (decode) SDPA on contiguous KV."""
    from kvmesh.kernels.triton_attention import paged_attention_triton

    sync = torch.cuda.synchronize
    scale = q.shape[-1] ** -0.5
    out = {
        "triton_ms": 1e3 * timeit(lambda: paged_attention_triton(q, kc, vc, meta, scale), repeats, sync),
        "torch_ms": 1e3 * timeit(lambda: paged_attention_torch(q, kc, vc, meta, scale), repeats, sync),
    }
    if with_sdpa:
        ctx = meta.seq_lens_cpu[0]
        k, v = contiguous(meta, kc, ctx), contiguous(meta, vc, ctx)
        qs = q.view(k.shape[0], q.shape[1], 1, q.shape[2])
        sdpa = timeit(lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True), repeats, sync)
        out["sdpa_contiguous_ms"] = 1e3 * sdpa
    return out


def cuda_sweep(repeats: int) -> dict:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    heads, kvh, d, bs = 32, 8, 128, 16  # Llama-3-8B attention shapes
    bw = copy_bandwidth(dev)
    decode = []
    for batch in (1, 8, 32, 64, 128, 256):
        for ctx in (512, 2048, 4096, 8192, 16384, 32768):
            if batch * ctx > 256 * 8192:  # keep the pool within memory
                continue
            row = {"batch": batch, "context": ctx}
            row.update(time_kernels(*problem(batch, ctx, 1, heads, kvh, d, bs, dtype, dev), repeats, True))
            kv_bytes = 2 * batch * ctx * kvh * d * dtype.itemsize
            row["triton_bw_fraction"] = kv_bytes / (row["triton_ms"] / 1e3) / bw
            decode.append(row)
    extend = []
    for new in (1024, 4096):
        for cached in (0, 4096, 16384):
            row = {"new": new, "cached": cached}
            row.update(time_kernels(*problem(1, cached + new, new, heads, kvh, d, bs, dtype, dev), repeats, False))
            extend.append(row)
    return {
        "device": torch.cuda.get_device_name(0),
        "copy_bandwidth_GBps": bw / 1e9,
        "decode": decode,
        "extend": extend,
    }


def print_cpu(out: dict) -> None:
    """The CPU tables: paging overhead, the decode kernel alone, prefill."""
    c = out.get("cpu")
    if c:
        print_table(
            [
                "CPU decode, batch 32 x 1k ctx",
                "SDPA contiguous ms",
                "paged (kernel) ms",
                "overhead",
                "paged (gather) ms",
                "overhead",
                "goal",
            ],
            [
                [
                    "SmolLM2 shapes",
                    c["sdpa_contiguous_ms"],
                    c["paged_ms"],
                    f"{c['overhead']:.2f}x",
                    c["gather_ms"],
                    f"{c['gather_overhead']:.2f}x",
                    "<= 1.5x",
                ]
            ],
        )
    if out.get("cpu_decode"):
        print()
        print_table(
            ["CPU decode kernel, SmolLM2 shapes", "warm ms", "KV GB/s", "cold ms", "KV GB/s"],
            [
                [f"{r['dtype']}, batch {r['batch']}, context {r['context']}"]
                + [r[k] for k in ("warm_ms", "warm_kv_GBps", "cold_ms", "cold_kv_GBps")]
                for r in out["cpu_decode"]
            ],
        )
    if out.get("cpu_prefill"):
        print()
        print_table(
            ["CPU prefill, SmolLM2 shapes", "kernel ms", "GFLOP/s", "gather + SDPA ms", "GFLOP/s", "speed-up"],
            [
                [
                    f"batch {r['batch']}, {r['new_tokens']} new of {r['context']}",
                    r["kernel_ms"],
                    r["kernel_gflops"],
                    r["gather_sdpa_ms"],
                    r["gather_sdpa_gflops"],
                    f"{r['speedup']:.2f}x",
                ]
                for r in out["cpu_prefill"]
            ],
        )


def print_cuda(g: dict) -> None:
    """The CUDA sweep's tables: decode and extend."""
    print(f"\n{g['device']}: copy bandwidth {g['copy_bandwidth_GBps']:.0f} GB/s")
    print_table(
        ["batch", "context", "triton ms", "torch ms", "SDPA contiguous ms", "triton % of copy BW"],
        [
            [
                r["batch"],
                r["context"],
                r["triton_ms"],
                r["torch_ms"],
                r["sdpa_contiguous_ms"],
                f"{100 * r['triton_bw_fraction']:.0f}%",
            ]
            for r in g["decode"]
        ],
    )
    print_table(
        ["new tokens", "cached", "triton ms", "torch ms"],
        [[r["new"], r["cached"], r["triton_ms"], r["torch_ms"]] for r in g["extend"]],
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench attention_kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cuda-only", action="store_true", help="skip the CPU overhead measurement")
    args = ap.parse_args(argv)
    if args.cuda_only and not torch.cuda.is_available():
        raise SystemExit("--cuda-only needs a CUDA device")
    out: dict = {}
    if not args.cuda_only:
        out = {"cpu": cpu_overhead(args.repeats), "cpu_decode": cpu_decode(args.repeats)}
        out["cpu_prefill"] = cpu_prefill(args.repeats)
    print_cpu(out)
    if torch.cuda.is_available():
        out["cuda"] = g = cuda_sweep(args.repeats)
        print_cuda(g)
    else:
        print("\nno CUDA device: the Triton timing sweep was not run")
    write_json("attention_kernels_cuda" if args.cuda_only else "attention_kernels", out)


if __name__ == "__main__":
    main()
