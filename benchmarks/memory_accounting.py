"""KV memory: paged blocks vs contiguous max-length reservation, through the engine's real accounting.

No model runs: requests go through the engine's own ``KVCacheManager`` / ``BlockPool`` (prefix lookup,
allocation, caching of computed blocks), so the figures are what a replica's pool would hold.

(a) 64 requests of ``default_rng(0).integers(20, 600, 64)`` tokens, max_seq_len 2048, block 16:
    utilisation of reserved slots, paged vs contiguous (every request reserves 2048).
(b) A 200,000-slot budget and an 80/17/3 % mix of short (20-200 tokens) / medium (200-1,000) / long
    (1,000-2,048) requests: how many are admitted, paged vs reserve-max.
(c) 40 requests on an 8-block system prompt, 30 of them also on a 6-block few-shot preamble, each with
    3-4 blocks of its own (142 in all): blocks stored with prefix sharing vs without.

    kvmesh bench memory_accounting
"""

from __future__ import annotations

import argparse

import numpy as np

from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.core.hashing import model_seed
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.replica.block_pool import BlockPool
from kvmesh.replica.kv_cache_manager import KVCacheManager
from kvmesh.replica.request import Request

BLOCK = 16
MAX_SEQ = 2048
SEED = model_seed("memory-accounting")


def make_request(i: int, tokens: list[int]) -> Request:
    # No detokenizer: these requests are admitted and computed, never sampled.
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=tokens,
        params=SamplingParams(max_tokens=1),
        max_total_tokens=MAX_SEQ + 1,
        eos_token_ids=set(),
        detokenizer=None,
        block_size=BLOCK,
        hash_seed=SEED,
    )


def admit(kv: KVCacheManager, req: Request) -> bool:
    """The scheduler's admission path: prefix hits, allocation, then (as if prefilled) caching."""
    hits = kv.computed_blocks(req)
    if not kv.allocate(req, req.num_tokens - len(hits) * BLOCK, hits):
        return False
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)
    return True


def distinct_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(100, 40000, n).tolist()


def case_a() -> dict:
    lens = np.random.default_rng(0).integers(20, 600, 64)
    rng = np.random.default_rng(1)
    pool = BlockPool(64 * MAX_SEQ // BLOCK)
    kv = KVCacheManager(pool, BLOCK)
    for i, n in enumerate(lens):
        assert admit(kv, make_request(i, distinct_tokens(rng, int(n))))
    pool.check_integrity()
    used = int(lens.sum())
    paged_slots = pool.num_used * BLOCK
    contiguous_slots = 64 * MAX_SEQ
    return {
        "tokens": used,
        "paged_utilization": used / paged_slots,
        "contiguous_utilization": used / contiguous_slots,
        "reserved_ratio": contiguous_slots / paged_slots,
    }


def case_b() -> dict:
    budget = 200_000
    rng = np.random.default_rng(2)
    kinds = rng.choice(3, size=5000, p=[0.80, 0.17, 0.03])
    ranges = [(20, 200), (200, 1000), (1000, MAX_SEQ)]
    lens = [int(rng.integers(*ranges[k], endpoint=True)) for k in kinds]
    pool = BlockPool(budget // BLOCK)
    kv = KVCacheManager(pool, BLOCK)
    paged = 0
    while admit(kv, make_request(paged, distinct_tokens(rng, lens[paged]))):
        paged += 1
    pool.check_integrity()
    reserve_max = budget // MAX_SEQ
    return {
        "budget_slots": budget,
        "paged_admitted": paged,
        "reserve_max_admitted": reserve_max,
        "admitted_ratio": paged / reserve_max,
        "mean_tokens": float(np.mean(lens[:paged])),
    }


def case_c(enable_prefix_caching: bool) -> int:
    rng = np.random.default_rng(3)
    system, fewshot = distinct_tokens(rng, 8 * BLOCK), distinct_tokens(rng, 6 * BLOCK)
    own = [4] * 22 + [3] * 18
    pool = BlockPool(1000, enable_prefix_caching)
    kv = KVCacheManager(pool, BLOCK)
    for i in range(40):
        prompt = system + (fewshot if i < 30 else []) + distinct_tokens(rng, own[i] * BLOCK)
        assert admit(kv, make_request(i, prompt))
    pool.check_integrity()
    return pool.num_used


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="kvmesh bench memory_accounting",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    a, b = case_a(), case_b()
    shared, unshared = case_c(True), case_c(False)
    rows = [
        [
            "(a) utilisation of reserved KV",
            f"{a['paged_utilization']:.1%}",
            f"{a['contiguous_utilization']:.1%}",
            f"{a['reserved_ratio']:.2f}x less reserved",
            ">= 97% vs 15.4%",
        ],
        [
            "(b) sequences admitted in 200k slots",
            b["paged_admitted"],
            b["reserve_max_admitted"],
            f"{b['admitted_ratio']:.2f}x more",
            ">= 7.5x",
        ],
        [
            "(c) blocks stored, 40 shared-prefix requests",
            shared,
            unshared,
            f"{unshared / shared:.2f}x fewer",
            "<= 156 vs 642",
        ],
    ]
    print_table(["case", "paged / shared", "contiguous / unshared", "ratio", "goal"], rows)
    write_json("memory_accounting", {"a": a, "b": b, "c": {"blocks_shared": shared, "blocks_unshared": unshared}})


if __name__ == "__main__":
    main()
