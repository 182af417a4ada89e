"""Faults and overload end to end: ``kvmesh serve`` (2 replicas of the tiny model, one running sequence each,
tight queue limits, a LoRA adapter) on a Redis this test owns, so it can stop and restart it; a replica
process is killed by its pid mid-stream. What users rely on: nothing but the requests that truly could not be
served is lost, each refused or failed request is told so clearly, and the cluster heals by itself, adapters
included."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from kvmesh.bench.harness.serve_process import ServeProcess
from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis
from kvmesh.router.index_schema import index_prefix
from tests.lora_helpers import ALL_MODULES, make_adapter, merged_greedy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LIMITS = [
    "--max-num-seqs",
    "1",
    "--max-ongoing-requests",
    "2",
    "--max-queued-requests",
    "3",
    "--max-inflight-requests",
    "8",
]


@pytest.fixture(scope="module")
def redis_for_faults():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def lora_root(tiny_llama_dir, tmp_path_factory):
    """``tone``, served from the start, and ``extra``, loaded at run time."""
    root = tmp_path_factory.mktemp("fault-loras")
    for seed, name in enumerate(("tone", "extra")):
        make_adapter(tiny_llama_dir, root / name, 8, ALL_MODULES, seed, scale=0.5)
    return root


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, redis_for_faults, lora_root):
    args = [
        "--model",
        str(tiny_llama_dir),
        "--replicas",
        "2",
        "--threads",
        "1",
        "--redis-url",
        redis_for_faults.url,
        *LIMITS,
        "--lora-modules",
        f"tone={lora_root / 'tone'}",
        "--lora-root",
        str(lora_root),
    ]
    with ServeProcess(args, tmp_path_factory.mktemp("faults") / "serve.log") as srv:
        srv.model = str(tiny_llama_dir)
        srv.wait_ready(timeout_s=180)
        srv.http_client = httpx.Client(base_url=srv.url, timeout=60)
        yield srv
        srv.http_client.close()


def complete(server, prompt: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return server.http_client.post("/v1/completions", json=body)


def stream(server, prompt: str, max_tokens: int, out: dict, started: threading.Event | None = None) -> None:
    """Stream a completion; ``out`` gets the replica header, the tokens seen and the error event, if any."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    out.update(chunks=0, error=None, finish=None, status=None)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as resp:
        out["status"], out["replica"] = resp.status_code, resp.headers.get("x-kvmesh-replica")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            out["chunks"] += 1
            out["finish"] = event["choices"][0]["finish_reason"] or out["finish"]
            if started is not None and out["chunks"] == 2:
                started.set()


def replica_pids(server) -> dict[str, int]:
    return {rid: r["pid"] for rid, r in server.http_client.get("/status").json()["replicas"].items()}


def wait_for(predicate, timeout_s: float, step_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step_s)
    return None


def test_redis_down_and_back_loses_no_request_and_the_index_is_rebuilt(server, redis_for_faults):
    prompts = [f"Redis outage drill number {i}: " + "keep serving. " * 30 for i in range(4)]
    for p in prompts:
        assert complete(server, p).status_code == 200
    redis_for_faults.stop()
    down = [complete(server, p) for p in prompts * 3]  # routing degrades to load only; nothing fails
    assert [r.status_code for r in down] == [200] * len(down), [r.text[:200] for r in down if r.status_code != 200]
    redis_for_faults.start()  # same port, no data: what a crashed non-persistent Redis comes back as
    t0 = time.monotonic()
    client = redis.Redis.from_url(redis_for_faults.url)
    prefix = index_prefix("kvmesh", server.model)

    def rebuilt() -> bool:
        return client.hlen(prefix + "reg") == 2 and any(True for _ in client.scan_iter(match=prefix + "b:*", count=100))

    assert wait_for(rebuilt, 10), "index not rebuilt within 10 s of Redis returning"
    rebuilt_s = time.monotonic() - t0
    # Status reports ride on the heartbeats: both replicas report again within a beat or two.
    assert wait_for(lambda: len(replica_pids(server)) == 2, 5), "replicas do not report after Redis returned"
    assert complete(server, prompts[0]).status_code == 200
    client.close()
    print(f"index rebuilt {rebuilt_s:.1f} s after Redis returned")


def test_killed_replica_fails_only_its_started_streams_and_is_replaced(server, redis_for_faults):
    pids = wait_for(lambda: (p := replica_pids(server)) and len(p) == 2 and p, 30)
    assert pids, "two replicas should report"
    # One long stream per replica (each replica runs one sequence at a time), then one queued behind each.
    # The three arrive together, and Serve counts a request as queued while it is being routed: the handle's
    # queue (3) holds them all, or the last would be refused as overload before any replica died.
    first, started = {}, threading.Event()
    pool = ThreadPoolExecutor(4)
    futures = [pool.submit(stream, server, "The first long story. " * 4, 900, first, started)]
    assert started.wait(30), "the first stream did not start"
    victim = first["replica"]
    assert victim in pids, f"x-kvmesh-replica {victim!r} is not one of {list(pids)}"
    others = [{} for _ in range(3)]
    futures += [pool.submit(stream, server, f"Story {i} waits its turn. " * 4, 40, out) for i, out in enumerate(others)]
    time.sleep(1.0)  # routed: running on the other replica, or waiting in a queue for a batch slot
    os.kill(pids[victim], signal.SIGKILL)
    t_kill = time.monotonic()
    for f in futures:
        f.result(timeout=120)
    pool.shutdown()
    # The stream that had started on the dead replica ends with an error event, not a hang or a cut-off.
    assert first["error"] is not None and first["finish"] is None, first
    assert "replica" in first["error"]["message"].lower()
    # Requests without a token yet were retried on the other replica: all of them completed.
    assert [o["finish"] for o in others] == ["length"] * 3, others
    assert all(o["error"] is None and o["chunks"] > 0 for o in others)
    # The index forgets the dead incarnation within 5 s; Serve starts a replacement that serves.
    client = redis.Redis.from_url(redis_for_faults.url)
    prefix = index_prefix("kvmesh", server.model)
    gone = wait_for(
        lambda: not client.hexists(prefix + "reg", victim) and not client.exists(prefix + "hb:" + victim), 10, 0.1
    )
    forgot_s = time.monotonic() - t_kill
    assert gone and forgot_s <= 5.5, f"dead replica still in the index after {forgot_s:.1f} s"
    retried = [
        ln
        for ln in server.http_client.get("/metrics").text.splitlines()
        if ln.startswith("kvmesh_request_retries_total")
    ]
    print(f"index forgot the killed replica {forgot_s:.1f} s after the kill; {retried}")
    replaced = wait_for(lambda: (p := replica_pids(server)) and len(p) == 2 and victim not in p and p, 120, 1.0)
    assert replaced, "Serve did not replace the killed replica"
    assert all(complete(server, f"After the crash {i}").status_code == 200 for i in range(4))
    client.close()


def test_overload_is_refused_with_retry_after_never_a_hang(server):
    """8 requests may be in the ingress at once; the engines take 2 x 2 and the handle queues 3 more. A burst
    of 24 long requests: each either completes or is refused at once (429 at the ingress, 503 when the
    engine queue is full), with Retry-After; then the cluster serves normally."""
    body = {"model": server.model, "prompt": "Overload " * 20, "max_tokens": 200, "ignore_eos": True}

    def send(_):
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        return r.status_code, r.headers.get("retry-after"), time.monotonic() - t0, r.json()

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(send, range(24)))
    codes = [c for c, _, _, _ in results]
    assert set(codes) <= {200, 429, 503}, codes
    assert codes.count(200) >= 4 and (codes.count(429) + codes.count(503)) >= 8, codes
    print(
        f"burst of 24: {codes.count(200)} completed, {codes.count(429)} x 429, {codes.count(503)} x 503, "
        f"slowest refusal {max((e for c, _, e, _ in results if c != 200), default=0):.3f} s"
    )
    for code, retry_after, elapsed, body_ in results:
        if code != 200:
            assert retry_after == "1" and body_["error"]["type"] in ("rate_limit_error", "service_unavailable")
            assert elapsed < 5, "a refusal must be immediate"
    assert complete(server, "Calm again").status_code == 200


def test_restarted_replicas_serve_the_adapters_they_served(server, lora_root, tiny_llama_dir):
    """An adapter served from the start (``--lora-modules``) and one loaded at run time: after every replica
    has been killed and replaced, both answer as PEFT's merged model (the new replicas load the first from
    their configuration and read the second from the directory each call names)."""
    body = {"lora_name": "extra", "lora_path": str(lora_root / "extra")}
    assert server.http_client.post("/v1/load_lora_adapter", json=body).status_code == 200
    prompts = [[200 + 41 * i + j for j in range(20)] for i in range(3)]
    expected = {name: merged_greedy(tiny_llama_dir, lora_root / name, prompts, 6) for name in ("tone", "extra")}

    def answers(name: str) -> list[str]:
        out = []
        for prompt in prompts:
            body = {"model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            reply = server.http_client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            out.append(reply.json()["choices"][0]["text"])
        return out

    def detokenized(name: str) -> list[str]:
        return [server.http_client.post("/detokenize", json={"tokens": t}).json()["prompt"] for t in expected[name]]

    assert answers("extra") == detokenized("extra")  # read by a replica before the restarts too
    before = wait_for(lambda: (p := replica_pids(server)) and len(p) == 2 and p, 30)
    assert before, "two replicas should report"
    for victim, pid in before.items():
        os.kill(pid, signal.SIGKILL)
        replaced = wait_for(lambda v=victim: (p := replica_pids(server)) and len(p) == 2 and v not in p and p, 120, 1.0)
        assert replaced, f"Serve did not replace {victim}"
    assert not set(replica_pids(server)) & set(before)  # every replica is a new one
    for name in ("tone", "extra"):
        assert answers(name) == detokenized(name), name
