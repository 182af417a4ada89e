"""Autoscaling under a KV-pressure step: KV-pressure autoscaling vs Ray Serve's request-count default.

    kvmesh bench autoscale --policies kv_pressure,ongoing_requests:2 --repeats 2   # open loop, 0.4 req/s
    kvmesh bench autoscale --policies kv_pressure,ongoing_requests:2 --concurrency 2 --base-s 30 --repeats 2
    kvmesh bench autoscale --policies kv_pressure,ongoing_requests:2 --concurrency 2 --base-s 30 \
        --ramp-s 90 --step-s 150 --repeats 2   # prompts grow over 90 s instead of jumping

The same load runs against a fresh ``kvmesh serve`` per scaling policy (same model, engine limits, bounds,
metric intervals and delays; only the policy differs). Requests arrive open loop (Poisson, same seed) at
a steady rate; for ``--base-s`` their prompts are short, then for ``--step-s`` they are long: the request
rate hardly changes but each request needs many more KV blocks, the shift agent and long-context traffic
makes. ``--ramp-s R`` grows the prompts linearly from short to long over the first R seconds of the step
instead (context growing over an agent session, a shift of traffic that takes minutes): KV demand then
rises before the pool is full, which is when a KV signal can act and a queue-length signal cannot yet.
``--concurrency C`` runs it closed loop instead: C clients, each sending its next request when
the previous one is answered (agents), so the number of requests in flight stays C while their KV
demand steps up. ``ongoing_requests:T`` is Ray's default policy with ``target_ongoing_requests=T`` (Ray's default T
is 2). Measured per policy: time from the step to the first request served by a replica that did not
exist before it, TTFT p50/p99 of the requests sent during the step, failed requests, peak replicas and
replica-seconds (what the capacity cost). The replica count is read from ``/status`` twice a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from kvmesh.bench.harness.load_client import Result, run_closed_loop, run_sessions
from kvmesh.bench.harness.report import print_table, pyplot, save_figure, write_json
from kvmesh.bench.harness.serve_process import ServeProcess
from kvmesh.bench.harness.workloads import Session, Step, StepPrompts, step_workload

POLICIES = "kv_pressure,ongoing_requests:2,ongoing_requests:8"


async def _watch(url: str, t_start: list[float], stop: asyncio.Event, timeline: list) -> None:
    """Every 0.5 s: the replicas with a live heartbeat and how many requests each admitted so far."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while not stop.is_set():
            try:
                replicas = (await client.get("/status")).json()["replicas"]
                t = time.perf_counter() - t_start[0] if t_start else 0.0
                timeline.append((t, {rid: r.get("requests_admitted", 0) for rid, r in replicas.items()}))
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


async def _drive(url: str, model: str, args: argparse.Namespace) -> tuple[list[Result], list, list[Session]]:
    timeline: list = []
    stop, t_start = asyncio.Event(), [time.perf_counter()]
    watcher = asyncio.create_task(_watch(url, t_start, stop, timeline))
    try:
        if args.concurrency:
            prompts = StepPrompts(args.seed, args)
            results, _ = await run_closed_loop(url, model, prompts, args.concurrency, "load", args.timeout_s)
            sessions = prompts.sessions
        else:
            sessions = step_workload(args.seed, args)
            results, _ = await run_sessions(url, model, sessions, progress_label="load", timeout_s=args.timeout_s)
    finally:
        stop.set()
        await watcher
    return results, timeline, sessions


def summarise(results: list[Result], timeline: list, sessions: list[Session], base_s: float) -> dict:
    phase = {s.session_id: s.labels["phase"] for s in sessions}
    step = [r for r in results if phase[r.session_id] == "step"]
    ttft = [r.ttft_s for r in step if r.ttft_s is not None]
    base = [r.ttft_s for r in results if phase[r.session_id] == "base" and r.ttft_s is not None]
    before = {rid for t, reps in timeline if t <= base_s for rid in reps}
    new_serving = next(
        (t for t, reps in timeline if t > base_s and any(n > 0 for rid, n in reps.items() if rid not in before)), None
    )
    counts = [(t, len(reps)) for t, reps in timeline]

    def replica_s(lo: float, hi: float) -> float:
        spans = itertools.pairwise(counts)
        return sum(n * (min(t1, hi) - max(t0, lo)) for (t0, n), (t1, _) in spans if t1 > lo and t0 < hi)

    return {
        "requests": len(results),
        "errors": sum(r.error is not None for r in results),
        "step_requests": len(step),
        "ttft_step_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
        "ttft_step_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
        "ttft_base_p50_s": statistics.median(base) if base else None,
        "new_replica_serving_after_s": None if new_serving is None else new_serving - base_s,
        "replicas_before_step": len(before),
        "peak_replicas": max((n for _, n in counts), default=0),
        "replica_seconds_base": replica_s(0.0, base_s),
        "replica_seconds": replica_s(0.0, float("inf")),
        "replica_timeline": counts,
        "ttft_timeline": [(r.sent_at, r.ttft_s) for r in results if r.ttft_s is not None],
    }


def serve_config(args: argparse.Namespace, policy: str) -> dict:
    name, _, target = policy.partition(":")
    autoscaling = {
        "metrics_interval_s": args.metrics_interval_s,
        "look_back_period_s": args.look_back_s,
        "upscale_delay_s": args.upscale_delay_s,
        "downscale_delay_s": args.downscale_delay_s,
    }
    if name == "ongoing_requests":
        autoscaling["target_ongoing_requests"] = float(target or 2)
    return {
        "model": args.model,
        "replicas": 1,
        "min_replicas": 1,
        "max_replicas": args.max_replicas,
        "scaling_policy": name,
        "target_kv_util": args.target_kv_util,
        "autoscaling": autoscaling,
        "engine": {
            "num_kv_blocks": args.num_kv_blocks,
            "max_num_seqs": args.max_num_seqs,
            "torch_threads": 1,
            **({"device": args.device} if args.device else {}),
        },
    }


def run_policy(args: argparse.Namespace, policy: str, log_dir: Path) -> dict:
    config = log_dir / f"{policy.replace(':', '-')}.yaml"
    config.write_text(yaml.safe_dump(serve_config(args, policy)))
    print(f"\n== {policy}: starting kvmesh serve", file=sys.stderr, flush=True)
    with ServeProcess(["--config", str(config)], log=log_dir / f"{policy.replace(':', '-')}.log") as server:
        ready_s = server.wait_ready()
        warm = [
            Session(f"w{i}", 0.0, [Step(token_ids=[1000 + i] * args.short, max_tokens=4)], chat=False) for i in range(2)
        ]
        asyncio.run(run_sessions(server.url, args.model, warm, concurrency=1))
        results, timeline, sessions = asyncio.run(_drive(server.url, args.model, args))
    out = summarise(results, timeline, sessions, args.base_s)
    out["ready_s"] = ready_s
    return out


def plot(runs: dict[str, dict], base_s: float, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for policy, run in runs.items():
        t, n = zip(*run["replica_timeline"], strict=True) if run["replica_timeline"] else ((), ())
        top.step(t, n, where="post", label=policy)
        sent, ttft = zip(*run["ttft_timeline"], strict=True) if run["ttft_timeline"] else ((), ())
        bottom.scatter(sent, ttft, s=8, label=policy)
    for ax in (top, bottom):
        ax.axvline(base_s, color="grey", linestyle="--", linewidth=1)
    top.set_ylabel("replicas serving")
    bottom.set_ylabel("TTFT (s)")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds since the load started (dashed: prompts start growing)")
    top.legend()
    top.set_title("KV-pressure step: replicas and TTFT by scaling policy")
    save_figure(fig, path)


SUMMARY_KEYS = (
    "new_replica_serving_after_s",
    "ttft_step_p50_s",
    "ttft_step_p99_s",
    "ttft_base_p50_s",
    "errors",
    "peak_replicas",
    "replica_seconds_base",
    "replica_seconds",
)
"""What each policy's runs report, as medians over the repeats."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench autoscale", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--policies", default=POLICIES, help="kv_pressure and/or ongoing_requests:<target>")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rate", type=float, default=0.4, help="request arrivals per second (Poisson)")
    ap.add_argument("--concurrency", type=int, default=None, help="closed loop: this many clients instead")
    ap.add_argument("--base-s", type=float, default=40.0, help="seconds of short prompts before the step")
    ap.add_argument("--step-s", type=float, default=90.0, help="seconds of long prompts (the ramp included)")
    ap.add_argument(
        "--ramp-s",
        type=float,
        default=0.0,
        help="grow the prompts from --short to --long over this many seconds (0: a step)",
    )
    ap.add_argument("--short", type=int, default=100, help="prompt tokens before the step")
    ap.add_argument("--long", type=int, default=640, help="prompt tokens during the step")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--max-replicas",
        type=int,
        default=2,
        help="2 on a 2-core machine: one 1-thread replica per core, as one per GPU in a pool",
    )
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=48,
        help="KV pool per replica (16-token blocks); must hold 1.1 x --long + --max-tokens",
    )
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--device", default=None, help="replicas' device (default: cuda when present, else cpu)")
    ap.add_argument("--target-kv-util", type=float, default=0.7)
    ap.add_argument("--metrics-interval-s", type=float, default=1.0)
    ap.add_argument("--look-back-s", type=float, default=5.0)
    ap.add_argument("--upscale-delay-s", type=float, default=3.0)
    ap.add_argument("--downscale-delay-s", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy (alternating); medians reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    ap.add_argument("--json", type=Path, default=None, help="results file (default: benchmarks/results/)")
    ap.add_argument("--png", type=Path, default=None, help="plot path (default: beside the JSON)")
    return ap


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per policy, the median of each of ``SUMMARY_KEYS`` over its runs."""

    def med(policy: str, key: str):
        values = [r[key] for r in runs[policy] if r[key] is not None]
        return statistics.median(values) if values else None

    return {p: {k: med(p, k) for k in SUMMARY_KEYS} for p in runs}


def print_summary(summary: dict[str, dict]) -> None:
    """The policies side by side, the p99 TTFT of the step against the first policy's."""
    ref = next(iter(summary.values()))["ttft_step_p99_s"]
    print_table(
        [
            "policy",
            "new replica serving after (s)",
            "TTFT p50 step (s)",
            "TTFT p99 step (s)",
            "p99 vs first",
            "TTFT p50 base (s)",
            "errors",
            "peak replicas",
            "replica-s base",
            "replica-s",
        ],
        [
            [
                p,
                s["new_replica_serving_after_s"] if s["new_replica_serving_after_s"] is not None else "never",
                s["ttft_step_p50_s"],
                s["ttft_step_p99_s"],
                f"{s['ttft_step_p99_s'] / ref:.2f}x" if ref and s["ttft_step_p99_s"] else "-",
                s["ttft_base_p50_s"],
                s["errors"],
                s["peak_replicas"],
                s["replica_seconds_base"],
                s["replica_seconds"],
            ]
            for p, s in summary.items()
        ],
    )


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if not 0 <= args.ramp_s <= args.step_s:
        ap.error("--ramp-s must be between 0 and --step-s")
    if int(1.1 * args.long) + args.max_tokens > 16 * args.num_kv_blocks:
        ap.error("the longest prompt plus --max-tokens must fit one replica's KV pool (--num-kv-blocks)")
    log_dir = Path(tempfile.mkdtemp(prefix="kvmesh-autoscale-"))
    load = f"{args.concurrency} clients" if args.concurrency else f"{args.rate} req/s"
    print(f"{load} over {args.base_s + args.step_s:.0f} s; server logs in {log_dir}", file=sys.stderr)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for _ in range(args.repeats):
        for policy in policies:
            runs[policy].append(run_policy(args, policy, log_dir))
    summary = summarize(runs)
    print_summary(summary)
    path = write_json(
        "autoscale", {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "runs": runs}, args.json
    )
    plot({p: r[-1] for p, r in runs.items()}, args.base_s, args.png or path.with_suffix(".png"))


if __name__ == "__main__":
    main()
