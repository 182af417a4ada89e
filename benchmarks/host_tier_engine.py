"""Multi-turn chat whose history outgrows the device pool, on one engine, with and without the host tier.

``--conversations`` conversations take turns (each turn: ``--user-tokens`` new tokens, ``--output-tokens``
generated, greedy); every conversation's turn t runs before any turn t+1, one request at a time, so each
history is pushed out of the device pool by the others before its next turn. The device pool holds a
third of the final histories (``--history-factor`` 3); the host tier, when on, holds all of them. Reported
per mode: prefix hit rate (tokens served from a cache / prompt tokens, turns after the first), the share
loaded from the host tier, and TTFT p50 / p99 (request added to first token).

    kvmesh bench host_tier_engine [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams


def run(engine: LLMEngine, conversations: int, turns: int, user: int, output: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    histories: list[list[int]] = [[] for _ in range(conversations)]
    ttfts, prompt_tokens, cached, from_host = [], 0, 0, 0
    host_before = engine.stats().cached_prompt_tokens_host
    for turn in range(turns):
        for c in range(conversations):
            prompt = histories[c] + rng.integers(100, 40000, user).tolist()
            params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
            host_at = engine.stats().cached_prompt_tokens_host
            t0 = time.perf_counter()
            rid = engine.add_request(prompt, params)
            first, tokens = None, []
            while engine.has_unfinished:
                for out in engine.step():
                    if out.request_id == rid and out.delta_token_ids:
                        if first is None:
                            first = time.perf_counter() - t0
                            hit = out.num_cached_tokens
                        tokens += out.delta_token_ids
            histories[c] = prompt + tokens
            if turn:  # first turns share nothing: they measure the model, not the cache
                ttfts.append(first)
                prompt_tokens += len(prompt)
                cached += hit
                from_host += engine.stats().cached_prompt_tokens_host - host_at
    assert engine.stats().cached_prompt_tokens_host - host_before == from_host
    ttfts.sort()
    return {
        "requests": len(ttfts),
        "prompt_tokens": prompt_tokens,
        "hit_rate": cached / prompt_tokens,
        "host_share": from_host / prompt_tokens,
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "final_history_tokens": sum(map(len, histories)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench host_tier_engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--history-factor", type=float, default=3.0, help="final histories / device pool")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if min(args.conversations, args.turns, args.user_tokens, args.output_tokens) < 1 or args.history_factor <= 0:
        ap.error("counts must be >= 1 and --history-factor > 0")
    history_tokens = args.conversations * args.turns * (args.user_tokens + args.output_tokens)
    history_blocks = -(-history_tokens // args.block_size)
    longest = -(-history_tokens // args.conversations // args.block_size)  # one conversation's last prompt
    pool = max(int(history_blocks / args.history_factor), longest + 8)
    base = {"model": args.model, "block_size": args.block_size, "num_kv_blocks": pool, "swap_space_bytes": 0}
    results, per_block = {}, None
    for mode in ("no_host_tier", "host_tier"):
        host = 0 if mode == "no_host_tier" else 2 * history_blocks * per_block
        engine = LLMEngine(EngineConfig(**base, host_cache_bytes=host))
        per_block = engine.bytes_per_block
        engine.warm_up()
        print(f"{mode}: {args.conversations} conversations x {args.turns} turns, pool {pool} blocks ...", flush=True)
        results[mode] = run(engine, args.conversations, args.turns, args.user_tokens, args.output_tokens)
        del engine
    table = [
        [
            mode,
            f"{r['hit_rate']:.1%}",
            f"{r['host_share']:.1%}",
            1000 * r["ttft_p50_s"],
            1000 * r["ttft_p99_s"],
            f"{r['ttft_p50_s'] / results['no_host_tier']['ttft_p50_s']:.2f}x",
        ]
        for mode, r in results.items()
    ]
    print(f"\nhistories {history_blocks} blocks = {history_blocks / pool:.1f}x the device pool of {pool} blocks")
    print_table(["mode", "hit rate", "from host", "TTFT p50 ms", "TTFT p99 ms", "p50 vs none"], table)
    write_json(
        "host_tier_engine",
        {
            "model": args.model,
            "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
            "threads": torch.get_num_threads(),
            "workload": {k: getattr(args, k) for k in ("conversations", "turns", "user_tokens", "output_tokens")},
            "device_pool_blocks": pool,
            "history_blocks": history_blocks,
            "modes": results,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
