"""How much of a router run's mean TTFT placement could still win, at the hit rate it reached.

A request whose prompt was mostly cached where it went (a conversation's next turn, a hot document) is
held by affinity: sending it elsewhere re-prefills what it reused, so at the same hit rate a router has no
freer choice for it. The rest (new conversations, first reads of a document) a router places freely; the
best it could do for one is an idle engine, whose TTFT for that many uncached tokens ``idle_ttft`` measures
on a freshly reset engine. ``estimate`` keeps every held request's measured TTFT and gives every placed one the
idle engine's: the mean a router would reach by placement alone (an estimate, not a bound: a better
placement could also spare a held request a neighbour's prefill, and idle engines still share the cores).
``floor`` gives every request the idle engine's TTFT for its uncached tokens: the mean at that hit rate if
no request ever waited for another (cached context is not priced, so no router could go below it), and
``held_wait`` is what the held requests took beyond that, on average: the queues they met where their
prefix was. The idle table times bare token ids; ``idle_chat`` times a chat's turns on the same idle engine,
one conversation at a time, to show what the floor leaves out (the chat template, the cached context's
attention). ``kvmesh bench peer_routers`` reports these; ``kvmesh bench placement_headroom`` recomputes them
from a saved result (``reanalyse``).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

IDLE_LENGTHS = (16, 64, 128, 256, 512, 1024)
"""Uncached prompt tokens the idle engine is timed at (the workloads' placed prompts fall within)."""


def idle_ttft(url: str, model: str, repeats: int = 3, seed: int = 0) -> dict[int, float]:
    """Median TTFT (s) on the idle engine at ``url`` of a never-seen prompt of each of ``IDLE_LENGTHS`` tokens
    (up to the longest its KV pool holds: the engine refuses a longer one with 400)."""
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
                    if response.status_code == 400:
                        return out
                    response.raise_for_status()
                    next(line for line in response.iter_lines() if line.startswith("data: "))
                times.append(time.perf_counter() - t0)
            out[n] = statistics.median(times)
    return out


def held(prompt_tokens: int, cached_tokens: int) -> bool:
    """Whether a request was held by affinity: at least half its prompt was cached where it went."""
    return 2 * cached_tokens >= prompt_tokens


def alone_s(uncached, idle: dict[int, float]) -> np.ndarray:
    """The idle engine's TTFT (s) for each count of ``uncached`` tokens, interpolated in its table (below the
    shortest length measured: that length's time)."""
    lengths = sorted(idle)
    return np.interp(np.asarray(uncached, dtype=float), np.array(lengths, dtype=float), [idle[n] for n in lengths])


def idle_chat(url: str, model: str, idle: dict[int, float], conversations: int = 6) -> dict[str, float]:
    """Mean TTFT (s) on the idle engine at ``url`` of ``multi_turn`` chats run one at a time: their held turns
    and their first turns, each beside the idle table's time for the same uncached tokens."""
    from kvmesh.bench.harness.load_client import run_sessions
    from kvmesh.bench.harness.workloads import multi_turn_chat

    sessions = multi_turn_chat(-7, conversations, 4, 1.0, max_tokens=16, think_s=0.0)  # a seed no timed run uses
    results, _ = asyncio.run(run_sessions(url, model, sessions, concurrency=1))
    out = {}
    for name, want in (("held", True), ("first", False)):
        rows = [r for r in results if r.error is None and held(r.prompt_tokens, r.cached_tokens) == want]
        table = alone_s([r.prompt_tokens - r.cached_tokens for r in rows], idle)
        out[f"{name}_s"] = statistics.fmean(r.ttft_s for r in rows)
        out[f"{name}_table_s"] = float(table.mean())
    return out


def estimate(requests: list[dict], idle: dict[int, float]) -> dict:
    """The share of ``requests`` (rows with ``prompt_tokens``, ``cached_tokens``, ``ttft_s``) held by affinity,
    the mean TTFT (s) if every other one had found an idle engine, the no-wait floor and the held requests'
    mean wait beyond an idle engine's time (module docstring)."""
    rows = [r for r in requests if r["ttft_s"] is not None]
    if not rows:
        return dict.fromkeys(("held_share", "estimate_s", "floor_s", "held_wait_s"))
    is_held = np.array([held(r["prompt_tokens"], r["cached_tokens"]) for r in rows])
    uncached = np.array([r["prompt_tokens"] - r["cached_tokens"] for r in rows], dtype=float)
    ttft = np.array([r["ttft_s"] for r in rows])
    alone = alone_s(uncached, idle)
    return {
        "held_share": float(is_held.mean()),
        "estimate_s": float(np.where(is_held, ttft, alone).mean()),
        "floor_s": float(alone.mean()),
        "held_wait_s": float((ttft - alone)[is_held].mean()) if is_held.any() else None,
    }


def placed_on_freest(requests: list[dict]) -> tuple[int, int] | None:
    """Of the requests a router placed freely (not held), how many it sent to an engine with the fewest
    earlier requests still before their first token when it was sent (what a router could know: prefills in
    flight), and how many it placed. None for rows without ``replica`` and ``sent_at_s``."""
    rows = [r for r in requests if r["ttft_s"] is not None]
    if not rows or any("replica" not in r or "sent_at_s" not in r for r in rows):
        return None
    engines = {r["replica"] for r in rows}
    freest = placed = 0
    for r in rows:
        if held(r["prompt_tokens"], r["cached_tokens"]):
            continue
        t = r["sent_at_s"]
        waiting = dict.fromkeys(engines, 0)
        for o in rows:
            if o["sent_at_s"] < t < o["sent_at_s"] + o["ttft_s"]:
                waiting[o["replica"]] += 1
        placed += 1
        freest += waiting[r["replica"]] == min(waiting.values())
    return freest, placed


def reanalyse(path: Path) -> list[list]:
    """Per workload, router and run of a saved ``peer_routers`` result: mean TTFT, held share, placement
    estimate, no-wait floor and held wait (ms), recomputed from its requests and its idle engine's times, and
    how many of its placed requests went where the fewest prefills were in flight."""
    saved = json.loads(path.read_text())
    idle = {int(n): s for n, s in saved["idle_ttft_s"].items()}
    rows = []
    for workload, routers in saved["runs"].items():
        for router, runs in routers.items():
            for i, run in enumerate(runs, 1):
                e = estimate(run["per_request"], idle)
                ms = [1000 * v if v is not None else "-" for v in (e["estimate_s"], e["floor_s"], e["held_wait_s"])]
                freest = placed_on_freest(run["per_request"])
                shown = f"{freest[0]}/{freest[1]}" if freest else "-"
                rows.append(
                    [workload, router, i, 1000 * run["ttft_mean_s"], f"{100 * e['held_share']:.0f}%", *ms, shown]
                )
    return rows
