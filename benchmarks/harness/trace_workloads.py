"""A family of seeded workloads in the Mooncake trace format, for the simulator and the trace replayer.

Each row is one request: ``timestamp`` (ms), ``input_length`` (tokens, 512 per block as in Mooncake),
``output_length`` (tokens) and ``hash_ids``: the prompt's blocks, prefix-chained (two requests share an id
at position k only if they share everything up to it). Shared content keeps its ids; new content gets
fresh ones, so the prefix structure of each shape is exact and cheap to generate.

- ``chat``: multi-turn conversations on a few shared system prompts; each turn re-sends the history.
- ``agentic``: sessions on a few long shared tool prompts whose context grows with every tool result, and
  bursts of parallel sub-agents (3-8) forking from the parent's whole context within ``burst_ms``.
- ``rag``: a pool of long documents with Zipf popularity, each request one document plus a short question.
- ``few_shot``: groups of requests sharing a system prompt with examples (Zipf over groups).
- ``tenants``: the few-shot shape for several tenants whose caches are salted apart: the same prompt
  hashes to different blocks per tenant, so nothing is shared across tenants.
- ``long_single``: long single-shot prompts, no reuse at all.
- ``mooncake``: conversations shaped like the Mooncake conversation trace's (measured on
  ``benchmarks/workloads/mooncake``): one shared system block, a heavy-tailed first prompt, 69% single-turn,
  each later turn resending all but the last (partial) block of the one before, minutes between turns. Its
  size scales to a million requests and more (``size=83`` is about 1M) for fleet-scale simulation.

Arrivals (``arrival=``): ``poisson``; ``bursty`` (clusters of 5 requests on average, each inside half a
mean gap); ``diurnal`` (the rate follows one sine period over the trace, 0.2x to 1.8x). The simulator
rescales time to its target load, so only the shape of the arrivals matters, not the rate.

    python -m kvmesh.bench.harness.trace_workloads agentic --out agentic.jsonl [--seed 0] [--size 1.0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from collections.abc import Callable
from pathlib import Path

BLOCK_TOKENS = 512
"""Tokens per hash id, as in the Mooncake traces."""
ARRIVALS = ("poisson", "bursty", "diurnal")


class Ids:
    """Fresh block ids; a shared piece of content is one list of ids reused as is. Each seed draws from a
    range of its own, so traces of different seeds (a warm-up and a measured run) share no block."""

    def __init__(self, seed: int) -> None:
        self._next = itertools.count(seed * 1_000_000_000 + 1)

    def fresh(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def arrival_times(rng: random.Random, n: int, shape: str = "poisson", rate: float = 1.0) -> list[float]:
    """``n`` arrival times (seconds, sorted) of a process with mean ``rate`` per second and ``shape``."""
    if shape not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {shape!r}")
    times, t = [], 0.0
    span = n / rate
    while len(times) < n:
        if shape == "bursty":  # clusters of 5 on average inside half a mean gap, starting at rate / 5
            t += rng.expovariate(rate / 5)
            size = 1 + min(int(rng.expovariate(1 / 4)), 4 * 5)
            times.extend(sorted(t + rng.uniform(0, 0.5 / rate) for _ in range(size)))
            continue
        if shape == "diurnal":  # thinning of a rate-1.8x process down to rate * (1 + 0.8 sin)
            t += rng.expovariate(1.8 * rate)
            if rng.random() > (1 + 0.8 * math.sin(2 * math.pi * t / span)) / 1.8:
                continue
        else:
            t += rng.expovariate(rate)
        times.append(t)
    return sorted(times)[:n]


def _row(t: float, hash_ids: list[int], output_tokens: int) -> dict:
    return {
        "timestamp": int(t * 1000),
        "input_length": len(hash_ids) * BLOCK_TOKENS,
        "output_length": output_tokens,
        "hash_ids": hash_ids,
    }


def _zipf(rng: random.Random, n: int, s: float) -> int:
    """An index in [0, n) with probability proportional to 1 / (rank + 1) ** s."""
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def _sorted(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: r["timestamp"])


def chat(seed: int = 0, size: float = 1.0, arrival: str = "poisson", systems: int = 4) -> list[dict]:
    """Conversations of 2-8 turns on ``systems`` shared system prompts (2 blocks) plus a 1-4 block document
    of their own; each turn adds a 1-block user message and a 1-block reply; 5-60 s between turns."""
    rng, ids = random.Random(seed), Ids(seed)
    prompts = [ids.fresh(2) for _ in range(systems)]
    starts = arrival_times(rng, max(1, int(200 * size)), arrival, rate=0.5)
    rows = []
    for start in starts:
        history = prompts[_zipf(rng, systems, 1.0)] + ids.fresh(rng.randint(1, 4))
        t = start
        for _ in range(rng.randint(2, 8)):
            history = history + ids.fresh(1)
            rows.append(_row(t, history, 256))
            history = history + ids.fresh(1)  # the reply, re-sent with the next turn
            t += rng.uniform(5, 60)
    return _sorted(rows)


def agentic(
    seed: int = 0,
    size: float = 1.0,
    arrival: str = "poisson",
    tools: int = 4,
    fanout_p: float = 0.3,
    burst_ms: float = 100.0,
) -> list[dict]:
    """Agent sessions of 3-12 steps on ``tools`` shared tool prompts (8-24 blocks); each step appends a 1-6
    block tool result to the context; with probability ``fanout_p`` a step forks 3-8 sub-agents, each the
    parent's whole context plus a 1-block task, all arriving within ``burst_ms``."""
    rng, ids = random.Random(seed), Ids(seed)
    prompts = [ids.fresh(rng.randint(8, 24)) for _ in range(tools)]
    starts = arrival_times(rng, max(1, int(120 * size)), arrival, rate=0.2)
    rows = []
    for start in starts:
        context = prompts[_zipf(rng, tools, 1.0)] + ids.fresh(1)
        t = start
        for _ in range(rng.randint(3, 12)):
            rows.append(_row(t, context, 128))
            if rng.random() < fanout_p:
                for _ in range(rng.randint(3, 8)):
                    rows.append(_row(t + 0.5 + rng.uniform(0, burst_ms / 1000), context + ids.fresh(1), 128))
                t += 0.5 + burst_ms / 1000
            context = context + ids.fresh(rng.randint(1, 6))
            t += rng.uniform(1, 10)
    return _sorted(rows)


def rag(
    seed: int = 0, size: float = 1.0, arrival: str = "poisson", documents: int = 200, zipf_s: float = 1.1
) -> list[dict]:
    """Requests on one of ``documents`` documents (8-32 blocks, Zipf popularity ``zipf_s``) after a shared
    1-block instruction, each with a fresh 1-block question."""
    rng, ids = random.Random(seed), Ids(seed)
    instruction = ids.fresh(1)
    docs = [ids.fresh(rng.randint(8, 32)) for _ in range(documents)]
    weights = [1 / (k + 1) ** zipf_s for k in range(documents)]
    times = arrival_times(rng, max(1, int(2000 * size)), arrival, rate=2.0)
    picks = rng.choices(range(documents), weights, k=len(times))
    return [_row(t, instruction + docs[d] + ids.fresh(1), 128) for t, d in zip(times, picks, strict=True)]


def few_shot(seed: int = 0, size: float = 1.0, arrival: str = "poisson", groups: int = 16) -> list[dict]:
    """Requests in ``groups`` groups (Zipf popularity), each group a 4-16 block system prompt with examples,
    each request a fresh 1-2 block question."""
    rng, ids = random.Random(seed), Ids(seed)
    prompts = [ids.fresh(rng.randint(4, 16)) for _ in range(groups)]
    times = arrival_times(rng, max(1, int(2000 * size)), arrival, rate=2.0)
    return [_row(t, prompts[_zipf(rng, groups, 1.0)] + ids.fresh(rng.randint(1, 2)), 128) for t in times]


def tenants(seed: int = 0, size: float = 1.0, arrival: str = "poisson", count: int = 6, groups: int = 8) -> list[dict]:
    """``count`` tenants sending the few-shot shape on the same ``groups`` prompts, each tenant's copy salted
    (its own block ids); tenants' traffic is Zipf-skewed too."""
    rng, ids = random.Random(seed), Ids(seed)
    sizes = [rng.randint(4, 16) for _ in range(groups)]
    salted = [[ids.fresh(n) for n in sizes] for _ in range(count)]
    times = arrival_times(rng, max(1, int(2000 * size)), arrival, rate=2.0)
    rows = []
    for t in times:
        tenant = _zipf(rng, count, 0.8)
        rows.append(_row(t, salted[tenant][_zipf(rng, groups, 1.0)] + ids.fresh(rng.randint(1, 2)), 128))
    return rows


def long_single(seed: int = 0, size: float = 1.0, arrival: str = "poisson") -> list[dict]:
    """Single-shot prompts of 16-64 blocks that share nothing."""
    rng, ids = random.Random(seed), Ids(seed)
    times = arrival_times(rng, max(1, int(500 * size)), arrival, rate=0.5)
    return [_row(t, ids.fresh(rng.randint(16, 64)), 256) for t in times]


MOONCAKE_OUTPUT_DECILES = (1, 24, 100, 213, 291, 350, 399, 447, 504, 597, 1024)
"""Output tokens at the 0th, 10th, ..., 100th percentiles (the trace's deciles; ends chosen here)."""


def mooncake(seed: int = 0, size: float = 1.0, arrival: str = "poisson") -> list[dict]:
    """About ``12,000 x size`` requests in ``7,400 x size`` conversations on one shared 1-block system prompt.

    Fitted to the Mooncake conversation trace: first prompts log-normal (median 11 blocks, 90th percentile
    50, 2 to 256); a conversation goes on to a second turn with probability 0.31 and to each further one
    with 0.45; a later turn resends the previous prompt less its last block (a partial block whose hash
    changes) plus a log-normal number of new blocks (median 2, 90th percentile 20); log-normal gaps between
    turns (median 123 s, 90th percentile 480 s); output lengths from the trace's deciles. Conversations
    start at 2.08 per second; turns after the last start are cut, so the load is steady to the end (the trace
    is such a window of a longer stream).
    """
    rng, ids = random.Random(seed), Ids(seed)
    system = ids.fresh(1)
    starts = arrival_times(rng, max(1, int(7373 * size)), arrival, rate=2.08)
    rows = []
    for t in starts:
        prompt = system + ids.fresh(min(256, max(2, round(rng.lognormvariate(math.log(11), 1.18)))) - 1)
        turns = 1
        while rng.random() < (0.31 if turns == 1 else 0.45):
            turns += 1
        for _ in range(turns):
            rows.append(_row(t, prompt, _from_deciles(rng, MOONCAKE_OUTPUT_DECILES)))
            added = max(1, round(rng.lognormvariate(math.log(2), 1.8)))
            prompt = prompt[:-1] + ids.fresh(min(added, 256)) if len(prompt) > 1 else prompt + ids.fresh(added)
            t += rng.lognormvariate(math.log(123), 1.06)
    return _sorted([r for r in rows if r["timestamp"] <= starts[-1] * 1000])  # a window, as the trace is


def _from_deciles(rng: random.Random, deciles: tuple[int, ...]) -> int:
    """A value drawn from a distribution given by its deciles, linear between them."""
    u = rng.random() * (len(deciles) - 1)
    k = int(u)
    return round(deciles[k] + (u - k) * (deciles[k + 1] - deciles[k]))


WORKLOADS: dict[str, Callable[..., list[dict]]] = {
    "chat": chat,
    "agentic": agentic,
    "rag": rag,
    "few_shot": few_shot,
    "tenants": tenants,
    "long_single": long_single,
    "mooncake": mooncake,
}


def write_trace(rows: list[dict], path: Path) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=float, default=1.0, help="scales the number of sessions / requests")
    ap.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    args = ap.parse_args(argv)
    rows = WORKLOADS[args.workload](seed=args.seed, size=args.size, arrival=args.arrival)
    write_trace(rows, args.out)
    print(f"wrote {len(rows)} requests to {args.out}")


if __name__ == "__main__":
    main()
