"""kvmesh's router against the peer routers, on the same ``kvmesh engine`` servers, side by side in one run.

    kvmesh bench peer_routers --smg /work/peers/smg-venv/bin/smg \\
        --vllm-router /work/peers/vllm-router-venv/bin/vllm-router [--engines 3] [--repeats 2]

Starts ``--engines`` ``kvmesh engine`` servers of SmolLM2 (one torch thread each, vLLM-style KV events on
local sockets) once, then for each repeat and each router, in rotating order: empties every engine's prefix
cache (``POST /reset_prefix_cache``), starts the router in front of all engines, sends a few warm-up
sessions of another seed, runs the workload open loop, reads the engines' own counters before and after
(hit rate by tokens as the engines saw it) and stops the router. Routers: kvmesh's KV-aware policy on the
engines' events as one process (``kvmesh router``) and inside a Ray cluster (``kvmesh serve --worker``),
SGLang's ``smg --policy cache_aware``, ``vllm-router --policy cache_aware``, and round robin (``smg --policy
round_robin``). The peers run from their own virtualenvs
(never kvmesh dependencies); a router whose binary is not given is left out. Workloads: ``multi_turn`` (chat
sessions) and ``rag`` (long shared documents, as text completions) of ``kvmesh bench run``.
Prints a table of medians over the repeats (with each router's CPU seconds: the router process and
everything under it), then how much of each mean placement alone could still win (an idle engine timed first;
``benchmarks/harness/placement_estimate.py``), and writes ``benchmarks/results/peer_routers.json``. ``--pin`` puts
the engines on the last core and the routers and the load client on the others, as a router runs on other
cores than GPU engines; unpinned, on a 2-core machine, a router's own CPU comes out of the engines' time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from kvmesh.bench.harness import engine_occupancy
from kvmesh.bench.harness.load_client import run_sessions
from kvmesh.bench.harness.peer_fleet import (
    MODEL,
    Child,
    add_workload_args,
    cpu_seconds,
    event_sockets,
    start_engines,
    start_router,
    ttft_summary,
    workload,
)
from kvmesh.bench.harness.placement_estimate import estimate, idle_chat, idle_ttft
from kvmesh.bench.harness.report import print_table, results_dir, write_json
from kvmesh.cluster.launch.embedded_redis import free_port

SUMMARY_KEYS = (
    *("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "hit_rate", "router_cpu_s"),
    *("held_share", "estimate_s", "floor_s", "held_wait_s"),
)
"""What each router's run reports, as medians over the repeats."""


def start_vllm_engines(n: int, tmp: Path, args: argparse.Namespace) -> list[tuple[Child, dict]]:
    """``n`` vLLM CPU servers (``--vllm-python``, their own virtualenv), each bound to its own core in turn,
    publishing KV events as ``kvmesh engine`` does; dev mode for ``/reset_prefix_cache``."""
    from kvmesh.core.model_files import resolve_model_dir

    engines, cores = [], sorted(os.sched_getaffinity(0))
    for i in range(n):
        port = free_port()
        events, config = event_sockets(tmp, f"v{i}")
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(resolve_model_dir(MODEL, weights=True)), "--served-model-name", MODEL]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048"]
        cmd += ["--max-num-seqs", str(args.max_num_seqs), "--seed", "0", "--enable-prompt-tokens-details"]
        cmd += ["--kv-events-config", config]
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[i % len(cores)])
        engines.append((Child(f"vllm{i}", cmd, f"http://127.0.0.1:{port}", "/health", env), events))
    for child, _ in engines:
        child.wait_ready(600)
    return engines


def engine_counters(engines: list[tuple[Child, dict]]) -> tuple[int, int, list[int]]:
    """Prompt tokens and cached prompt tokens every engine has served so far, and the requests each admitted
    (their own ``/status``, or vLLM's Prometheus counters)."""
    if engines[0][0].name.startswith("vllm"):
        return vllm_counters(engines)
    prompt = cached = 0
    admitted = []
    for child, _ in engines:
        for replica in httpx.get(child.url + "/status", timeout=10).json()["replicas"].values():
            prompt += replica["prompt_tokens"]
            cached += replica["cached_prompt_tokens"]
            admitted.append(replica["requests_admitted"])
    return prompt, cached, admitted


def vllm_counters(engines: list[tuple[Child, dict]]) -> tuple[int, int, list[int]]:
    """The same from vLLM's ``/metrics``: prefix-cache queries and hits (tokens), requests finished."""
    from prometheus_client.parser import text_string_to_metric_families

    prompt = cached = 0
    done = []
    for child, _ in engines:
        samples: Counter[str] = Counter()
        for family in text_string_to_metric_families(httpx.get(child.url + "/metrics", timeout=10).text):
            for sample in family.samples:
                samples[sample.name] += sample.value
        prompt += int(samples.get("vllm:prefix_cache_queries_total", 0))
        cached += int(samples.get("vllm:prefix_cache_hits_total", 0))
        done.append(int(samples.get("vllm:request_success_total", 0)))
    return prompt, cached, done


def reset_caches(engines: list[tuple[Child, dict]]) -> None:
    """Empty every engine's prefix cache (vLLM's and ``kvmesh engine``'s ``POST /reset_prefix_cache``)."""
    for child, _ in engines:
        httpx.post(child.url + "/reset_prefix_cache", timeout=30).raise_for_status()


def run_once(kind: str, name: str, args: argparse.Namespace, engines) -> dict:
    reset_caches(engines)
    router = start_router(kind, args, engines, args.model)
    try:
        warmup = workload(name, args.seed + 1000, True, args, args.model)
        asyncio.run(run_sessions(router.url, args.model, warmup, concurrency=3))
        time.sleep(1.0)
        prompt0, cached0, admitted0 = engine_counters(engines)
        cpu0 = cpu_seconds(router.proc.pid)
        probe = engine_occupancy.probe([c.url for c, _ in engines]) if args.probe_load else contextlib.nullcontext([])
        with probe as samples:
            sessions = workload(name, args.seed, False, args, args.model)
            results, wall = asyncio.run(run_sessions(router.url, args.model, sessions))
        cpu1 = cpu_seconds(router.proc.pid)
        prompt1, cached1, admitted1 = engine_counters(engines)
    finally:
        router.stop()
    return {
        **ttft_summary(results),
        "hit_rate": (cached1 - cached0) / (prompt1 - prompt0) if prompt1 > prompt0 else 0.0,
        "wall_s": wall,
        "router_cpu_s": cpu1 - cpu0,
        "requests_per_engine": [b - a for a, b in zip(admitted0, admitted1, strict=True)],
        "first_error": next((r.error for r in results if r.error is not None), None),
        "occupancy": engine_occupancy.summarize(samples),
        "per_request": [
            {"prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, "ttft_s": r.ttft_s}
            | {"session": r.session_id, "step": r.step, "sent_at_s": r.sent_at, "replica": r.replica}
            for r in results
            if r.error is None
        ],
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench peer_routers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smg", help="SGLang's router command (its own virtualenv's bin/smg)")
    ap.add_argument("--vllm-router", help="vllm-router command (its own virtualenv's bin/vllm-router)")
    ap.add_argument("--vllm-python", help="route vLLM CPU servers (this python, vllm-cpu's own virtualenv) instead")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--model", default=MODEL, help="the kvmesh engines' model (alias, directory or .gguf)")
    ap.add_argument("--engine-args", default="", help="more `kvmesh engine` options, e.g. '--device cuda'")
    add_workload_args(ap)
    ap.add_argument(
        "--pin",
        action="store_true",
        help="engines on the last core, routers and this client on the others (as routers run beside GPU engines)",
    )
    ap.add_argument("--routers", help="only these of the routers above (comma-separated names, as in the table)")
    ap.add_argument(
        "--probe-load",
        action="store_true",
        help="sample the kvmesh engines' /load during each run: how many were busy, whether requests queued",
    )
    ap.add_argument(
        "--warmup-pass",
        action="store_true",
        help="run each workload once before the idle probe and the timed runs (GPU engines stall on first shapes)",
    )
    ap.add_argument("--json", type=Path, default=None)
    return ap


def router_kinds(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The routers this run compares: kvmesh's, and each peer whose command was given (``--routers``: a subset)."""
    kinds = ["kvmesh_router"] + ([] if args.vllm_python else ["kvmesh_serve"])  # Ray's stack: kvmesh engines only
    kinds += ["smg_cache_aware", "round_robin"] if args.smg else []
    kinds += ["vllm_router_cache_aware"] if args.vllm_router else []
    if args.routers:
        unknown = set(args.routers.split(",")) - set(kinds)
        if unknown:
            ap.error(f"--routers: {', '.join(sorted(unknown))} not among {', '.join(kinds)} (give their commands)")
        kinds = [k for k in kinds if k in args.routers.split(",")]
    return kinds


def run_all(args: argparse.Namespace, kinds: list[str], names: list[str], engine_cpus: set[int] | None, partial: Path):
    """Start the engines, time the idle engine, then every router on every workload, ``--repeats`` times in
    rotating order. Every finished run is rewritten to ``partial`` after each: what a run cut short (a device's
    time limit) keeps. Returns the runs, the idle engine's TTFT table and its chats' times."""
    runs: dict[str, dict[str, list[dict]]] = {n: {k: [] for k in kinds} for n in names}
    with tempfile.TemporaryDirectory(prefix="peer-routers-") as tmp:
        if args.vllm_python:
            engines = start_vllm_engines(args.engines, Path(tmp), args)
        else:
            extra = shlex.split(args.engine_args)
            engines = start_engines(args.engines, Path(tmp), args.max_num_seqs, engine_cpus, args.model, extra)
        try:
            for name in names if args.warmup_pass else ():
                print(f"[{name} warm-up pass, not timed] {kinds[0]} ...", file=sys.stderr, flush=True)
                run_once(kinds[0], name, args, engines)
            reset_caches(engines[:1])
            idle = idle_ttft(engines[0][0].url, args.model)
            chat = {} if args.vllm_python else idle_chat(engines[0][0].url, args.model, idle)
            for repeat in range(args.repeats):
                for name in names:
                    order = kinds[repeat % len(kinds) :] + kinds[: repeat % len(kinds)]
                    for kind in order:
                        print(f"[{name} #{repeat + 1}] {kind} ...", file=sys.stderr, flush=True)
                        runs[name][kind].append(run_once(kind, name, args, engines))
                        partial.write_text(json.dumps({"args": vars(args), "runs": runs}, default=str))
        finally:
            for child, _ in engines:
                child.stop()
    return runs, idle, chat


def summarize(runs: dict, names: list[str], kinds: list[str], idle: dict[int, float]) -> tuple[list[list], dict]:
    """Per workload and router: medians over the repeats of ``SUMMARY_KEYS`` (each run given its placement
    estimate first), and the table's rows."""
    rows, summary = [], {}
    for name in names:
        for kind in kinds:
            reps = runs[name][kind]
            for r in reps:
                r.update(estimate(r["per_request"], idle))

            def med(key: str, reps=reps) -> float | None:
                values = [r[key] for r in reps if r[key] is not None]
                return statistics.median(values) if values else None

            summary.setdefault(name, {})[kind] = {k: med(k) for k in SUMMARY_KEYS}
            s = summary[name][kind]
            ms = [1000 * s[k] if s[k] is not None else "-" for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s")]
            errors = sum(r["errors"] for r in reps)
            spread = "/".join(str(n) for n in reps[-1]["requests_per_engine"])
            rows.append([name, kind, *ms, f"{100 * s['hit_rate']:.1f}%", s["router_cpu_s"], spread, errors])
            if errors:
                print(f"{name}/{kind}: {errors} errors, e.g. {reps[0]['first_error']}", file=sys.stderr)
    return rows, summary


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    if args.probe_load and args.vllm_python:
        ap.error("--probe-load reads kvmesh engines' /load; vLLM servers have none")
    if args.vllm_python and (args.model != MODEL or args.engine_args):
        ap.error("--model and --engine-args set kvmesh engines; the vLLM servers serve the default model")
    engine_cpus = None
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        engine_cpus = {cores[-1]}
        os.sched_setaffinity(0, set(cores[:-1]))  # routers started from here inherit it
    kinds = router_kinds(ap, args)
    names = args.workloads.split(",")
    result_name = "peer_routers_vllm" if args.vllm_python else "peer_routers"
    partial = (args.json or results_dir() / f"{result_name}.json").with_suffix(".partial.json")
    runs, idle, chat = run_all(args, kinds, names, engine_cpus, partial)
    rows, summary = summarize(runs, names, kinds, idle)
    engine = "vLLM CPU server" if args.vllm_python else "kvmesh engine"
    setting = f"{args.model}, 1 thread each" + (f", {args.engine_args}" if args.engine_args else "")
    print(f"\n{args.engines} x {engine} ({setting}), medians of {args.repeats} repeats")
    header = ["workload", "router", "TTFT mean ms", "p50", "p99", "hit rate", "router CPU s", "requests", "errors"]
    print_table(header, rows)
    print_headroom(summary, idle)
    if chat:
        print(
            "idle engine, chats one at a time: held turns {:.0f} ms (table {:.0f}), first turns {:.0f} ms (table"
            " {:.0f})".format(*(1000 * chat[k] for k in ("held_s", "held_table_s", "first_s", "first_table_s")))
        )
    if args.probe_load:
        print_occupancy(runs)
    write_json(
        result_name,
        {
            "args": {k: str(v) for k, v in vars(args).items()},
            "idle_ttft_s": idle,
            "idle_chat": chat,
            "summary": summary,
            "runs": runs,
        },
        args.json,
    )
    partial.unlink(missing_ok=True)


def print_headroom(summary: dict, idle: dict[int, float]) -> None:
    """Per workload and router: the share of requests held by affinity, the mean TTFT placement alone could
    reach, the no-wait floor and the held requests' wait (``benchmarks/harness/placement_estimate.py``), against the
    best peer router's measured mean."""
    print("\nidle engine TTFT ms by uncached tokens: " + ", ".join(f"{n}: {1000 * s:.0f}" for n, s in idle.items()))
    rows = []
    for name, routers in summary.items():
        peers = [s["ttft_mean_s"] for k, s in routers.items() if not k.startswith("kvmesh") and s["ttft_mean_s"]]
        best = min(peers) if peers else None
        for kind, s in routers.items():
            if not s["estimate_s"]:
                continue
            mean, est = s["ttft_mean_s"], s["estimate_s"]
            ratios = [est / mean, est / best if best else "-"]
            ms = [1000 * v if v is not None else "-" for v in (s["floor_s"], s["held_wait_s"])]
            rows.append([name, kind, 1000 * mean, f"{100 * s['held_share']:.0f}%", 1000 * est, *ratios, *ms])
    header = ["workload", "router", "TTFT mean ms", "held by affinity", "placement estimate ms", "/ own mean"]
    print_table([*header, "/ best peer", "no-wait floor ms", "held wait ms"], rows)


def print_occupancy(runs: dict) -> None:
    """Per workload and router (each repeat): the share of the run with 0, 1, 2, ... engines busy and with a
    request waiting in an engine's queue (``benchmarks/harness/engine_occupancy.py``)."""
    rows = []
    for name, routers in runs.items():
        for kind, reps in routers.items():
            for i, rep in enumerate(reps, 1):
                occ = rep["occupancy"]
                busy = "/".join(f"{100 * share:.0f}%" for share in occ["busy_engines_share"])
                waiting = f"{100 * occ['waiting_share']:.1f}%" if occ["waiting_share"] is not None else "-"
                rows.append([name, kind, i, occ["samples"], busy, waiting])
    print_table(["workload", "router", "run", "samples", "engines busy 0/1/2/...", "a request queued"], rows)


if __name__ == "__main__":
    main()
