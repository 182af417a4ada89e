"""The disk tier on multi-turn chat whose history outgrows the device pool and the host tier, and a restart.

    kvmesh bench disk_tier [--conversations 16] [--turns 6] [--device-blocks 64] [--repeats 3]

One SmolLM2 engine (fp32, the CPU default) with a device pool of ``--device-blocks`` 16-token blocks and a
host tier of a third of what the conversations' histories grow to (which is ~10x the pool): conversations
take turns round robin (each turn: the history, a new user message of ``--user`` token ids, ``--output``
greedy tokens), so by its next turn a conversation's history has been pushed out of the device and usually
out of the host tier. Requests run one at a time; TTFT is from ``add_request`` to the step that returns the
first token. Run with the host tier alone, then with the disk tier under it; then "restart": a new engine
on the same disk directory serves one more turn of every conversation (warm), against a new engine
without a disk tier (cold). Medians of ``--repeats`` (each repeat on a fresh directory). Prints a table,
writes ``benchmarks/results/disk_tier.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time

from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams

MODEL = "smollm2-135m"
BLOCK = 16


def engine(args: argparse.Namespace, disk_dir: str | None) -> LLMEngine:
    per_block = LLMEngine(EngineConfig(model=MODEL, num_kv_blocks=1, swap_space_bytes=0)).bytes_per_block
    return LLMEngine(
        EngineConfig(
            model=MODEL,
            num_kv_blocks=args.device_blocks,
            torch_threads=args.threads,
            host_cache_bytes=host_blocks(args) * per_block,
            disk_cache_dir=disk_dir,
        )
    )


def host_blocks(args: argparse.Namespace) -> int:
    """A third of what the conversations' histories grow to."""
    return args.conversations * args.turns * (args.user + args.output) // BLOCK // 3


def ask(eng: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """TTFT, the generated tokens and the cached prompt tokens of one request run alone."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    rid = eng.add_request(prompt, params)
    ttft, tokens, cached = None, [], 0
    while eng.has_unfinished:
        for out in eng.step():
            if out.request_id != rid:
                continue
            if ttft is None and out.delta_token_ids:
                ttft = time.perf_counter() - start
            tokens += out.delta_token_ids
            cached = out.num_cached_tokens
    return ttft, tokens, cached


def chat(eng: LLMEngine, histories: list[list[int]], turns: int, args: argparse.Namespace, rng) -> dict:
    """``turns`` round-robin turns of every conversation; each history grows by its turn."""
    ttfts, prompt_tokens, cached_tokens = [], 0, 0
    for _ in range(turns):
        for history in histories:
            history += [rng.randrange(1000, 40000) for _ in range(args.user)]
            ttft, tokens, cached = ask(eng, history, args.output)
            history += tokens
            ttfts.append(ttft)
            prompt_tokens += len(history) - len(tokens)
            cached_tokens += cached
    ttfts.sort()
    return {
        "requests": len(ttfts),
        "hit_rate": cached_tokens / prompt_tokens,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "ttft_mean_s": statistics.fmean(ttfts),
    }


def repeat(args: argparse.Namespace, seed: int) -> dict:
    out = {}
    for name in ("host tier only", "host + disk tier"):
        with tempfile.TemporaryDirectory(prefix="kvmesh-disk-") as d:
            print(f"[repeat {seed + 1}] {name} ...", file=sys.stderr, flush=True)
            rng = random.Random(seed)
            histories = [[] for _ in range(args.conversations)]
            eng = engine(args, d if "disk" in name else None)
            out[name] = chat(eng, histories, args.turns, args, rng)
            eng.close()
            if "disk" not in name:
                continue
            for label, disk_dir in (("after restart, cold (no disk tier)", None), ("after restart, warm (disk)", d)):
                eng = engine(args, disk_dir)
                out[label] = chat(eng, [list(h) for h in histories], 1, args, random.Random(seed + 1))
                out[label]["adopted_blocks"] = eng.swap.disk.adopted if eng.swap and eng.swap.disk else 0
                eng.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench disk_tier", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user", type=int, default=80, help="token ids per user message")
    ap.add_argument("--output", type=int, default=26, help="greedy tokens per answer")
    ap.add_argument("--device-blocks", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    runs = [repeat(args, seed) for seed in range(args.repeats)]
    rows, summary = [], {}
    for name in runs[0]:
        med = {k: statistics.median(r[name][k] for r in runs) for k in runs[0][name]}
        summary[name] = med
        rows.append(
            [
                name,
                med["requests"],
                f"{100 * med['hit_rate']:.1f}%",
                *(1000 * med[k] for k in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s")),
            ]
        )
    print(
        f"\n{MODEL} fp32, {args.device_blocks} device blocks, host tier {host_blocks(args)} blocks, "
        f"histories ~{3 * host_blocks(args)} blocks; medians of {args.repeats}"
    )
    print_table(["run", "requests", "hit rate", "TTFT p50 ms", "p99 ms", "mean ms"], rows)
    write_json("disk_tier", {"args": vars(args), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
