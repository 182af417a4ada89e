"""How much of a router run's mean TTFT placement could still win, at the hit rate it reached.

A request whose prompt was mostly cached where it went (a conversation's next turn, a hot document) is
held by affinity: sending it elsewhere re-prefills what it reused, so at the same hit rate a router has no
freer choice for it. The rest (new conversations, first reads of a document) a router places freely; the
best it could do for one is an idle engine, whose TTFT for that many uncached tokens is measured here on a
freshly reset engine. ``estimate`` keeps every held request's measured TTFT and gives every placed one the
idle engine's: the mean a router would reach by placement alone (an estimate, not a bound: a better
placement could also spare a held request a neighbour's prefill, and idle engines still share the cores).
"""

from __future__ import annotations

import random
import statistics
import time

import httpx
import numpy as np

IDLE_LENGTHS = (16, 64, 128, 256, 512, 1024)
"""Uncached prompt tokens the idle engine is timed at (the workloads' placed prompts fall within)."""


def idle_ttft(url: str, model: str, repeats: int = 3, seed: int = 0) -> dict[int, float]:
    """Median TTFT (s) on the idle engine at ``url`` of a never-seen prompt of each of ``IDLE_LENGTHS`` tokens."""
    rng = random.Random(seed)
    out = {}
    with httpx.Client(timeout=120) as client:
        for n in IDLE_LENGTHS:
            times = []
            for _ in range(repeats):
                prompt = [rng.randrange(1000, 40000) for _ in range(n)]  # random ids: nothing of it cached
                body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True}
                t0 = time.perf_counter()
                with client.stream("POST", url + "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    next(line for line in response.iter_lines() if line.startswith("data: "))
                times.append(time.perf_counter() - t0)
            out[n] = statistics.median(times)
    return out


def estimate(requests: list[dict], idle: dict[int, float]) -> dict:
    """The share of ``requests`` (rows with ``prompt_tokens``, ``cached_tokens``, ``ttft_s``) held by affinity
    and the mean TTFT (s) if every other one had found an idle engine."""
    rows = [r for r in requests if r["ttft_s"] is not None]
    if not rows:
        return {"held_share": None, "estimate_s": None}
    lengths = np.array(sorted(idle), dtype=float)
    idle_s = np.array([idle[n] for n in sorted(idle)])
    held = [2 * r["cached_tokens"] >= r["prompt_tokens"] for r in rows]
    uncached = np.array([r["prompt_tokens"] - r["cached_tokens"] for r in rows], dtype=float)
    best = np.where(held, [r["ttft_s"] for r in rows], np.interp(uncached, lengths, idle_s))
    return {"held_share": sum(held) / len(rows), "estimate_s": float(best.mean())}
