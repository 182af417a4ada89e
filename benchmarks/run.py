"""Side by side on a real cluster: the same workload against ``kvmesh serve`` once per routing policy.

    kvmesh bench run --workload multi_turn --routers kv_aware,pow2,round_robin,session_hash,approx_tree \\
        --replicas 4 --rate 0.5 --json benchmarks/results/bench_run.json
    kvmesh bench run --workload multi_turn --routers kv_aware --kv-variants host_tier=false \\
        --kv-cache-gib 0.045 --host-cache-gib 0.5 --rate 1 --think-s 8   # tier-aware vs tier-blind

For each router in turn: start a fresh cluster with identical settings (same model, replicas, engine
limits; only ``--policy`` differs; every router starts from cold caches), warm it up with a few sessions
of a different seed (excluded), run the workload open loop (its own arrival times) or closed loop
(``--concurrency``), then read the replicas' own counters through ``/status`` before and after, so the
prefix hit rate by tokens and the requests per replica are what the engines saw. The pooled bound is the
hit rate one LRU cache as large as all replicas together would reach on the same requests (prompts and
replies as sent and received, in send order): no router can beat it.

``--adapters N``: every replica serves N LoRA adapters (random weights in PEFT's format, rank ``--lora-rank``)
and holds ``--max-cpu-loras`` of them ready; each session runs on one, drawn with Zipf popularity
(``--adapter-zipf``), and the table adds the adapters the replicas read per minute (their ``lora_reads``).
The pooled bound then ignores adapters (a prefix shared across adapters counts as shared): still a bound.

    kvmesh bench run --workload multi_turn --adapters 32 --routers kv_aware,round_robin \
        --kv-variants adapter_weight=0     # adapter-aware against adapter-blind against round robin
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from kvmesh.bench.harness.cache_bounds import pooled_bound
from kvmesh.bench.harness.load_client import Result, run_sessions
from kvmesh.bench.harness.lora_files import shapes_of, write_adapter, zipf_choices
from kvmesh.bench.harness.report import print_table, pyplot, save_figure, write_json
from kvmesh.bench.harness.serve_process import ServeProcess
from kvmesh.bench.harness.trace_workloads import WORKLOADS as TRACE_WORKLOADS
from kvmesh.bench.harness.workloads import Session, build_workload

ROUTERS = "kv_aware,pow2,round_robin,session_hash,approx_tree"


def _status(url: str) -> dict:
    return httpx.get(url + "/status", timeout=10).json()["replicas"]


def _delta(before: dict, after: dict, key: str) -> dict[str, int]:
    return {rid: r.get(key, 0) - before.get(rid, {}).get(key, 0) for rid, r in after.items()}


def sent_token_ids(model: str, sessions: list[Session], results: list[Result]) -> list[tuple[list[int], list[int]]]:
    """Rebuild what each request sent (chat: the template over the history) and received, in send order."""
    from kvmesh.core.model_files import apply_chat_template, load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(model))
    by_id = {s.session_id: s for s in sessions}
    histories: dict[str, list[dict]] = {}  # a session's steps are sent in order, each after the last reply
    out = []
    for r in sorted((r for r in results if r.error is None), key=lambda r: r.sent_at):
        session, step = by_id[r.session_id], by_id[r.session_id].steps[r.step]
        if session.chat:
            system = [{"role": "system", "content": session.system}] if session.system else []
            history = histories.setdefault(r.session_id, system)
            prompt = apply_chat_template(tok, [*history, {"role": "user", "content": step.text}])
            history += [{"role": "user", "content": step.text}, {"role": "assistant", "content": r.reply}]
        else:
            prompt = step.token_ids if step.token_ids is not None else tok.encode(step.text)
        out.append((prompt, tok.encode(r.reply, add_special_tokens=False)))
    return out


def summarize(results: list[Result], wall_s: float, before: dict, after: dict) -> dict:
    """Latency percentiles, throughput, the replicas' hit rate and adapter reads, and requests per replica."""
    ok = [r for r in results if r.error is None]
    ttft = np.array([r.ttft_s for r in ok if r.ttft_s is not None])
    itl = np.array([g for r in ok for g in r.itl_s])
    e2e = np.array([r.e2e_s for r in ok])
    admitted = _delta(before, after, "requests_admitted")
    prompt = sum(_delta(before, after, "prompt_tokens").values())
    cached = sum(_delta(before, after, "cached_prompt_tokens").values())
    counts = list(admitted.values())

    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q)) if a.size else None

    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_p99_s": pct(e2e, 99),
        "output_tok_s": sum(r.output_tokens for r in ok) / wall_s if wall_s else 0.0,
        "wall_s": wall_s,
        "hit_rate": cached / prompt if prompt else 0.0,
        "hit_rate_client": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "requests_per_replica": admitted,
        "adapter_reads_per_min": sum(_delta(before, after, "lora_reads").values()) * 60 / wall_s if wall_s else 0.0,
        "imbalance": max(counts) / statistics.mean(counts) if counts and statistics.mean(counts) else None,
        "ttft_all_s": ttft.tolist(),
    }


def run_router(
    args: argparse.Namespace,
    router: str,
    sessions: list[Session],
    warmup: list[Session],
    policy_kwargs: dict,
    adapters: dict[str, Path],
) -> dict:
    engine = ["--max-num-seqs", str(args.max_num_seqs)] + (["--threads", str(args.threads)] if args.threads else [])
    if adapters:
        engine += ["--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]
        engine += ["--max-cpu-loras", str(args.max_cpu_loras), "--max-lora-rank", str(args.lora_rank)]
    if args.kv_cache_gib:
        engine += ["--kv-cache-gib", str(args.kv_cache_gib)]
    if args.host_cache_gib is not None:
        engine += ["--host-cache-gib", str(args.host_cache_gib)]
    server_args = [
        "--model",
        args.model,
        "--replicas",
        str(args.replicas),
        "--policy",
        router,
        *engine,
        "--ingress-replicas",
        str(args.ingress_replicas),
    ]
    if policy_kwargs:
        config = Path(tempfile.mkstemp(prefix="kvmesh-bench-", suffix=".yaml")[1])
        config.write_text(yaml.safe_dump({"policy_kwargs": policy_kwargs}))
        server_args += ["--config", str(config)]
    print(f"[{router}{policy_kwargs or ''}] starting {args.replicas} replicas ...", file=sys.stderr, flush=True)
    with ServeProcess(server_args) as server:
        server.wait_ready()
        warm = asyncio.run(run_sessions(server.url, args.model, warmup, concurrency=args.replicas))[0] if warmup else []
        time.sleep(1.5)  # replicas report their counters with each heartbeat (1 s)
        before = _status(server.url)
        results, wall = asyncio.run(
            run_sessions(server.url, args.model, sessions, concurrency=args.concurrency, progress_label=router)
        )
        time.sleep(1.5)
        after = _status(server.url)
        capacity = sum(r.get("kv_total_blocks") or 0 for r in after.values())
    summary = summarize(results, wall, before, after)
    summary["capacity_blocks"] = capacity
    summary["results"], summary["warmup_results"] = results, warm
    return summary


def plot(path: Path, runs: dict[str, dict], bound: float | None) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, s in runs.items():
        xs = np.sort(np.array(s["ttft_all_s"]))
        if xs.size:
            a.plot(xs * 1000, np.arange(1, xs.size + 1) / xs.size, label=name)
    a.set_xscale("log")
    a.set_xlabel("time to first token (ms, log)")
    a.set_ylabel("share of requests")
    a.set_title("TTFT distribution per router")
    a.legend()
    names = list(runs)
    b.bar(names, [100 * runs[n]["hit_rate"] for n in names], color="tab:blue")
    if bound is not None:
        b.axhline(100 * bound, color="tab:red", linestyle="--", label="pooled LRU bound")
        b.legend()
    b.tick_params(axis="x", labelrotation=20)
    b.set_ylabel("prefix hit rate by tokens (%)")
    b.set_title("Prefix hit rate per router (replicas' counters)")
    save_figure(fig, path)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workload", choices=["multi_turn", "shared_prefix", "mooncake", *TRACE_WORKLOADS], default="multi_turn"
    )
    ap.add_argument("--routers", default=ROUTERS)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ingress-replicas", type=int, default=2, help="router processes (one per ingress replica)")
    ap.add_argument("--rate", type=float, default=0.5, help="session arrivals per second (Poisson)")
    ap.add_argument("--concurrency", type=int, default=None, help="closed loop: sessions at a time")
    ap.add_argument("--sessions", type=int, default=24, help="conversations / prompts per group / trace rows")
    ap.add_argument("--turns", type=int, default=4, help="multi_turn: user turns per conversation")
    ap.add_argument("--groups", type=int, default=8, help="shared_prefix: groups")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4, help="warm-up sessions (another seed), excluded")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", type=Path, default=None, help="mooncake: Mooncake-format trace file")
    ap.add_argument("--block-tokens", type=int, default=16, help="mooncake: tokens per 512-token trace block")
    ap.add_argument("--speed", type=float, default=1.0, help="mooncake: timestamp speed-up factor")
    ap.add_argument("--offset", type=int, default=0, help="mooncake: first trace row")
    ap.add_argument("--kv-variants", default="", help='extra kv_aware runs, e.g. "miss_weight=2;decode_weight=1"')
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--host-cache-gib", type=float, default=None, help="host prefix tier per replica (0: off)")
    ap.add_argument("--think-s", type=float, default=1.0, help="multi_turn: pause before each later turn")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per replica")
    ap.add_argument("--adapters", type=int, default=0, help="LoRA adapters served; each session runs on one")
    ap.add_argument("--adapter-zipf", type=float, default=1.0, help="Zipf exponent of the adapters' popularity")
    ap.add_argument("--max-cpu-loras", type=int, default=4, help="adapters a replica holds ready")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None, help="results file (default: benchmarks/results/)")
    ap.add_argument("--png", type=Path, default=None, help="plot path (default: beside the JSON)")
    return ap


def router_plan(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """``(label, policy, settings)`` per router of ``--routers``, then kv_aware once per ``--kv-variants`` entry."""
    plan = [(r, r, {}) for r in args.routers.split(",") if r]
    for variant in filter(None, args.kv_variants.split(";")):
        kwargs = {k: yaml.safe_load(v) for k, v in (kv.split("=") for kv in variant.split(","))}
        plan.append((f"kv_aware({variant})", "kv_aware", kwargs))
    return plan


def on_adapters(args: argparse.Namespace, root: Path, sessions: list[Session]) -> dict[str, Path]:
    """``--adapters`` written under ``root`` (name -> directory), each session given one by Zipf popularity."""
    if not args.adapters:
        return {}
    shapes = shapes_of(args.model)
    adapters = {f"lora{k}": root / f"lora{k}" for k in range(args.adapters)}
    for seed, path in enumerate(adapters.values()):
        write_adapter(path, shapes, args.lora_rank, seed)
    names, drawn = list(adapters), zipf_choices(len(sessions), args.adapters, args.adapter_zipf, args.seed)
    for session, k in zip(sessions, drawn, strict=True):
        session.model = names[k]
    return adapters


def print_runs(args: argparse.Namespace, sessions: list[Session], runs: dict[str, dict], bound: float) -> None:
    """The routers side by side: latency percentiles, throughput, hit rate, imbalance, errors."""

    def ms(x: float | None) -> float | str:
        return 1000 * x if x is not None else "-"

    rows = [
        [
            name,
            ms(s["ttft_p50_s"]),
            ms(s["ttft_p90_s"]),
            ms(s["ttft_p99_s"]),
            ms(s["itl_p50_s"]),
            ms(s["e2e_p50_s"]),
            s["output_tok_s"],
            f"{100 * s['hit_rate']:.1f}%",
            f"{s['imbalance']:.2f}" if s["imbalance"] else "-",
            s["errors"],
            *([s["adapter_reads_per_min"]] if args.adapters else []),
        ]
        for name, s in runs.items()
    ]
    print(
        f"\n{args.workload}, {args.replicas} x {args.model}, {len(sessions)} sessions; pooled bound {100 * bound:.1f}%"
    )
    print_table(
        [
            "router",
            "TTFT p50 ms",
            "p90",
            "p99",
            "ITL p50 ms",
            "E2E p50 ms",
            "out tok/s",
            "hit rate",
            "imbalance",
            "errors",
            *(["adapter reads/min"] if args.adapters else []),
        ],
        rows,
    )


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    sessions = build_workload(args, args.seed)
    warmup = build_workload(args, args.seed + 1000, warmup=True) if args.warmup else []
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-loras-") as tmp:
        adapters = on_adapters(args, Path(tmp), [*sessions, *warmup])
        for label, router, kwargs in router_plan(args):
            runs[label] = run_router(args, router, sessions, warmup, kwargs, adapters)
    first = next(iter(runs.values()))
    warm_sent = sent_token_ids(args.model, warmup, first["warmup_results"])
    sent = sent_token_ids(args.model, sessions, first["results"])
    bound = pooled_bound(sent, 16, first["capacity_blocks"], prefill=warm_sent)
    for s in runs.values():
        s["hit_rate_vs_pooled"] = s["hit_rate"] / bound if bound else None
        del s["results"], s["warmup_results"]
    print_runs(args, sessions, runs, bound)
    payload = {
        "workload": args.workload,
        "adapter_sessions": {s.session_id: s.model for s in sessions} if args.adapters else None,
        "args": {k: str(v) for k, v in vars(args).items()},
        "pooled_bound": bound,
        "routers": runs,
    }
    path = write_json(f"bench_run_{args.workload}", payload, args.json)
    plot(args.png or path.with_suffix(".png"), runs, bound)


if __name__ == "__main__":
    main()
