"""What the peer-router benchmarks share (``kvmesh bench peer_routers``, ``ray_llm_router``, ``router_overhead``,
``ttft_floor``): server processes on loopback ports (``Child``), ``kvmesh engine`` servers publishing vLLM-style KV
events, each router in front of them (kvmesh's, SGLang's ``smg``, ``vllm-router``), a process tree's CPU seconds,
the ``multi_turn`` and ``rag`` workloads with their options, and the TTFT summary of a timed run."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil

from kvmesh.bench.harness.serve_process import ServeProcess
from kvmesh.bench.harness.trace_workloads import agentic, rag
from kvmesh.bench.harness.workloads import multi_turn_chat, trace_sessions
from kvmesh.cluster.launch.embedded_redis import free_port
from kvmesh.core.processes import die_with_parent

MODEL = "smollm2-135m"
MOONCAKE_TRACE = Path(__file__).resolve().parents[1] / "workloads" / "mooncake" / "conversation_trace.jsonl"
MOONCAKE_WARMUP_ROW = 6000
MOONCAKE_BLOCK_TOKENS = 8
"""Tokens standing for each of the trace's 512-token blocks: its longest prompts (239 blocks) then fit one engine's
160-block cache of 16-token blocks. Its arrivals run twice as fast, so prompt tokens arrive as fast as at 16."""
"""The warm-up's rows start here, far from the timed rows' (the trace's first rows), so it caches none of their
conversations."""


class Child:
    """A server process on a loopback port: started, waited for, stopped by its own pid."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        url: str,
        ready_path: str,
        env: dict | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        self.name, self.url, self.ready_path = name, url, ready_path
        self.log = Path(tempfile.mkstemp(prefix=f"peer-{name}-", suffix=".log")[1])

        def prepare() -> None:  # in the child: its cores, and its end with this process
            if cpus:
                os.sched_setaffinity(0, cpus)
            die_with_parent()

        self.proc = subprocess.Popen(
            cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env or os.environ, preexec_fn=prepare
        )

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout_s} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def event_sockets(tmp: Path, name: str) -> tuple[dict, str]:
    """Local sockets for one engine's vLLM-style KV events (``kv_events`` and ``replay``, as a ``--worker``
    names them) and the ``--kv-events-config`` that makes it publish there (kvmesh's and vLLM's alike)."""
    events = {"kv_events": f"ipc://{tmp}/{name}.pub", "replay": f"ipc://{tmp}/{name}.replay"}
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events["kv_events"]}
    return events, json.dumps({**config, "replay_endpoint": events["replay"]})


def start_engines(
    n: int,
    tmp: Path,
    max_num_seqs: int,
    cpus: set[int] | None = None,
    model: str = MODEL,
    engine_args: Sequence[str] = (),
) -> list[tuple[Child, dict]]:
    """``n`` ``kvmesh engine`` servers of ``model`` (one torch thread each, then ``engine_args``), publishing
    vLLM-style KV events on local sockets."""
    engines = []
    for i in range(n):
        port = free_port()
        events, config = event_sockets(tmp, f"e{i}")
        cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", model, "--port", str(port)]
        cmd += ["--threads", "1", "--max-num-seqs", str(max_num_seqs), "--kv-events-config", config, *engine_args]
        env = {k: v for k, v in os.environ.items() if k != "KVMESH_REDIS_URL"}
        engines.append((Child(f"engine{i}", cmd, f"http://127.0.0.1:{port}", "/health", env, cpus), events))
    for child, _ in engines:
        child.wait_ready()
    return engines


def start_router(
    kind: str,
    args: argparse.Namespace,
    engines: list[tuple[Child, dict]],
    model: str = MODEL,
    router_args: tuple[str, ...] = (),
) -> Child | ServeProcess:
    """One router of ``kind`` over ``engines``, ready; ``router_args``: more options for ``kvmesh router``."""
    urls = [c.url for c, _ in engines]
    port, metrics = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    workers = []
    for child, ev in engines:
        workers += ["--worker", f"{child.url},kv_events={ev['kv_events']},replay={ev['replay']}"]
    if kind == "kvmesh_serve":
        server = ServeProcess(["--model", model, "--replicas", "0", *workers])
        server.wait_ready()
        return server
    if kind == "kvmesh_router":
        cmd = [
            sys.executable,
            "-m",
            "kvmesh.cluster.launch.cli",
            "router",
            "--model",
            model,
            "--port",
            str(port),
            *workers,
            *router_args,
        ]
        child = Child(kind, cmd, url, "/health")
    elif kind in ("smg_cache_aware", "round_robin"):
        policy = "cache_aware" if kind == "smg_cache_aware" else "round_robin"
        cmd = [args.smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
        cmd += ["--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
        cmd += ["--log-level", "warn", "--worker-startup-check-interval", "1"]
        child = Child(kind, cmd, url, "/readiness")
    else:
        cmd = [args.vllm_router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
        cmd += ["--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
        child = Child(kind, cmd, url, "/health")
    child.wait_ready(120)
    return child


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and every process under it (the router's whole footprint)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def workload(name: str, seed: int, warmup: bool, args: argparse.Namespace, model: str = MODEL):
    """``name``'s sessions: ``multi_turn`` chat, ``rag`` (documents by Zipf popularity), ``agentic`` (agent sessions
    on shared tool prompts whose steps fork sub-agents in bursts, ``trace_workloads.agentic``; its first requests)
    or ``mooncake`` (the real conversation trace's rows in order, each 512-token block as
    ``MOONCAKE_BLOCK_TOKENS``; the warm-up's from far into it)."""
    if name == "multi_turn":
        n = 3 if warmup else args.sessions
        return multi_turn_chat(seed, n, args.turns, args.rate, max_tokens=args.max_tokens, think_s=1.0)
    count, block, speed = 3 if warmup else args.requests, 16, args.speed
    if name == "rag":
        rows = rag(seed=seed, size=max(0.05, args.requests / 2000), documents=args.documents)[:count]  # 2,000 a size
    elif name == "agentic":  # ~1,000 requests a size: sessions of 3-12 steps, 30% of steps fanning out 3-8 ways
        rows = agentic(seed=seed, size=max(0.05, 2 * args.requests / 1000))[:count]
    elif name == "mooncake":
        start = MOONCAKE_WARMUP_ROW if warmup else 0
        rows = _mooncake_rows()[start : start + count]
        block, speed = MOONCAKE_BLOCK_TOKENS, speed * 16 / MOONCAKE_BLOCK_TOKENS
    else:
        raise ValueError(f"unknown workload {name!r}: multi_turn, rag, agentic or mooncake")
    sessions = trace_sessions(rows, block_tokens=block, speed=speed, max_output_tokens=args.max_tokens)
    for session in sessions:  # as text: SGLang's router takes no token-id prompts (its StringOrArray is strings)
        for step in session.steps:
            step.text, step.token_ids = _tokenizer(model).decode(step.token_ids), None
    return sessions


@functools.cache
def _mooncake_rows() -> list[dict]:
    with MOONCAKE_TRACE.open() as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.cache
def _tokenizer(model: str):
    from kvmesh.core.model_files import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir(model, weights=False))


def ttft_summary(results: list) -> dict:
    """Requests, errors and TTFT mean/p50/p99 (seconds) of one timed run's results."""
    ok = [r for r in results if r.error is None]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))] if ttft else None,
    }


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload and engine options ``kvmesh bench peer_routers`` and ``kvmesh bench ray_llm_router`` share."""
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="multi_turn,rag")
    ap.add_argument("--sessions", type=int, default=12, help="multi_turn: conversations")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.4, help="multi_turn: conversations started per second")
    ap.add_argument("--requests", type=int, default=60, help="rag, mooncake: requests")
    ap.add_argument("--documents", type=int, default=12, help="rag: documents (Zipf popularity)")
    ap.add_argument(
        "--speed", type=float, default=1.0, help="rag, mooncake: arrival speed-up (the traces: 2 and 3.4 requests/s)"
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
