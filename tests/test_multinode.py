"""Two real Ray nodes (network namespaces on this machine), ``kvmesh serve --address auto`` on its defaults
with the engine replicas forced onto the worker: the index works across nodes, a lost node fails only its
streams and its index entries, requests get a bounded 503 while no replica lives, the replicas return with
the node, and stopping leaves nothing on the cluster.

The tests run in file order on one cluster and one ``kvmesh serve`` (starting them costs most of the time).
Clients run inside the head's namespace, where ``kvmesh serve`` listens on loopback.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.bench.harness.netns_cluster import HEAD_IP, WORKER_IP, WORKER_RESOURCE, NetnsCluster, NetnsUnavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

READY_S = 300.0
URL = "http://127.0.0.1:8000"
"""Where ``kvmesh serve`` listens, in the head's namespace (its defaults)."""
KERNEL_CACHE = str(Path.home() / ".cache" / "torch_extensions")
"""The worker's HOME is its own (cold caches, as on a new machine) but its CPU kernels come from this
machine's build, so CI compiles them once, not once more for the worker."""
KVMESH = str(Path(sys.executable).with_name("kvmesh"))
ENGINE_SLOT = "kvmesh_engine_slot"
"""A custom resource each node has one of: replicas asking for it land one per node."""

CLIENT = """
import json, sys, time, httpx
url, model, prompt, max_tokens, stream = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
start = time.time()
try:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
        if resp.status_code != 200:
            resp.read()
            print(json.dumps({"status": resp.status_code, "retry_after": resp.headers.get("Retry-After"),
                              "body": resp.text, "seconds": time.time() - start}))
        elif not stream:
            print(json.dumps({"status": 200, "body": json.loads(resp.read())}))
        else:
            for line in resp.iter_lines():
                if line:
                    print(json.dumps({"t": time.time(), "line": line}), flush=True)
except httpx.HTTPError as exc:  # what OpenAI's client (httpx) raises on a response cut mid-body
    print(json.dumps({"exception": type(exc).__name__}), flush=True)
"""

WATCH_INDEX = """
import json, sys, time, urllib.request
deadline = time.time() + float(sys.argv[2])
while time.time() < deadline:
    with urllib.request.urlopen(sys.argv[1] + "/status", timeout=5) as resp:
        entries = json.loads(resp.read())["index"]["entries"]
    print(json.dumps({"t": time.time(), "entries": entries}), flush=True)
    if entries == 0:
        break
    time.sleep(0.1)
"""

GRPC_UNARY = """
import grpc, json, sys, time
from kvmesh.cluster.ingress.proto import kvmesh_pb2, kvmesh_pb2_grpc
request = kvmesh_pb2.GenerateRequest(prompt=sys.argv[2], max_tokens=4)
start = time.time()
with grpc.insecure_channel(sys.argv[1]) as channel:
    try:
        kvmesh_pb2_grpc.KVMeshStub(channel).Complete(request, timeout=60)
        print(json.dumps({"code": "OK", "seconds": time.time() - start}))
    except grpc.RpcError as exc:
        print(json.dumps({"code": exc.code().name, "details": exc.details(), "seconds": time.time() - start}))
"""

HEALTH = """
import json, os, urllib.error, urllib.request
try:
    with urllib.request.urlopen(os.environ["url"] + "/health", timeout=10) as resp:
        print(resp.status, json.loads(resp.read())["status"])
except urllib.error.HTTPError as exc:
    print(exc.code, json.loads(exc.read())["status"])
"""

LEFT_ON_CLUSTER = """
import json, ray
ray.init(logging_level="ERROR")
print(json.dumps(ray.util.list_named_actors(all_namespaces=True)))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # With Ray's token authentication on, as docs/multinode.md tells operators to run a cluster.
    nodes = NetnsCluster(tmp_path_factory.mktemp("netns"), auth_token=secrets.token_hex(16))
    try:
        nodes.create()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    try:
        nodes.start_head(resources={ENGINE_SLOT: 1}, TORCH_EXTENSIONS_DIR=KERNEL_CACHE)
        nodes.start_worker(TORCH_EXTENSIONS_DIR=KERNEL_CACHE)
        yield nodes
    finally:
        nodes.teardown()


class Served:
    """One ``kvmesh serve`` in the head's namespace: its process, its log, where its HTTP is."""

    def __init__(self, cluster: NetnsCluster, config: Path, log: Path, args: list[str]) -> None:
        self.cluster, self.log = cluster, log
        self.proc = cluster.popen("head", [KVMESH, "serve", "--address", "auto", "--config", str(config), *args], log)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while "kvmesh is ready" not in self.text():
            assert self.proc.poll() is None, f"kvmesh serve exited with {self.proc.returncode}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready in {READY_S:.0f} s:\n{self.text()[-4000:]}"
            time.sleep(0.5)

    def stop(self, timeout: float = 120) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def engine_config(path: Path, extra: str = "") -> Path:
    path.write_text(
        f"engine_actor_options: {{num_cpus: 0, resources: {{{WORKER_RESOURCE}: 1}}}}\n"
        "engine: {num_kv_blocks: 256, max_model_len: 1024, max_num_seqs: 8}\n" + extra
    )
    return path


@pytest.fixture(scope="module")
def served(cluster, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("served")
    server = Served(cluster, engine_config(tmp / "cluster.yaml"), tmp / "serve.log", ["--model", str(tiny_llama_dir)])
    try:
        server.wait_ready()
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


def complete(cluster: NetnsCluster, model: str, prompt: str, max_tokens: int = 4, node: str = "head", url=None):
    url = url or URL
    out = cluster.run(node, [sys.executable, "-c", CLIENT, url, model, prompt, str(max_tokens), "0"], timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_stream(cluster: NetnsCluster, url: str, model: str, log: Path) -> subprocess.Popen:
    """A long streamed completion from the head's namespace, returned once its first tokens arrived."""
    stream = cluster.popen("head", [sys.executable, "-c", CLIENT, url, model, "go on", "900", "1"], log)
    deadline = time.monotonic() + 60
    while log.read_text().count('"line"') < 3:
        assert time.monotonic() < deadline and stream.poll() is None, log.read_text()[-2000:]
        time.sleep(0.05)
    return stream


def status(cluster: NetnsCluster) -> dict:
    out = cluster.run("head", [KVMESH, "status", "--json"], timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def long_prompt(seed: int) -> str:
    return " ".join(f"word{seed}x{i}" for i in range(120))


def test_on_the_defaults_replicas_on_another_node_share_one_index(cluster, served, tiny_llama_dir, tmp_path):
    text = served.text()
    assert f"started embedded Redis at redis://:***@{HEAD_IP}:" in text  # the head's address, password hidden
    assert f"node {WORKER_IP} ready" in text  # the worker was prepared before its replicas started
    assert f"ingress      node {HEAD_IP}" in text  # the ingress (HTTP routes, gRPC) on the head by default
    model = str(tiny_llama_dir)
    first, again = complete(cluster, model, long_prompt(0)), complete(cluster, model, long_prompt(0))
    assert first["status"] == again["status"] == 200
    assert again["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10
    for burst in range(3):  # new prompts at once (idle replicas tie one by one), until both replicas hold some
        clients = []
        for seed in range(10 * burst + 1, 10 * burst + 7):
            args = [sys.executable, "-c", CLIENT, URL, model, long_prompt(seed), "4", "0"]
            clients.append(cluster.popen("head", args, tmp_path / f"burst{seed}.log"))
        assert all(c.wait(150) == 0 for c in clients)
        replicas = status(cluster)["replicas"]
        if len(replicas) == 2 and all(r["index_entries"] > 0 for r in replicas.values()):
            break
    report = status(cluster)
    assert {r["node"] for r in report["replicas"].values()} == {WORKER_IP}, report["replicas"]
    assert len(report["replicas"]) == 2 and all(r["index_entries"] > 0 for r in report["replicas"].values())
    assert report["redis"]["ok"] and report["index_unreachable"] == {} and report["live_replicas"] == 2
    shown = cluster.run("head", [KVMESH, "status"], timeout=60).stdout
    assert "NODE" in shown and shown.count(WORKER_IP) == 2


def test_a_lost_node_fails_its_streams_then_requests_get_503_until_it_returns(
    cluster, served, tiny_llama_dir, tmp_path
):
    model, url = str(tiny_llama_dir), URL
    stream_log = tmp_path / "stream.log"
    stream = start_stream(cluster, url, model, stream_log)
    watch_log = tmp_path / "watch.log"
    watch = cluster.popen("head", [sys.executable, "-c", WATCH_INDEX, url, "30"], watch_log)
    time.sleep(0.5)
    killed_at = time.time()
    cluster.kill_node("worker")

    stream.wait(60)
    lines = [json.loads(x)["line"] for x in stream_log.read_text().splitlines() if x.strip()]
    assert '"error"' in lines[-2] and "replica_failed" in lines[-2] and lines[-1] == "data: [DONE]", lines[-3:]

    watch.wait(60)
    seen = [json.loads(x) for x in watch_log.read_text().splitlines() if x.strip()]
    assert seen[-1]["entries"] == 0, seen[-3:]
    assert seen[-1]["t"] - killed_at <= 3.5, f"the dead replicas' entries lived {seen[-1]['t'] - killed_at:.1f} s"

    refused = complete(cluster, model, long_prompt(0))
    assert refused["status"] == 503 and refused["retry_after"] and refused["seconds"] <= 10.0, refused
    grpc = cluster.run("head", [sys.executable, "-c", GRPC_UNARY, "127.0.0.1:9000", long_prompt(0)], timeout=90)
    refused = json.loads(grpc.stdout.strip().splitlines()[-1])
    assert refused["code"] == "UNAVAILABLE" and refused["seconds"] <= 10.0, refused
    health = cluster.python("head", HEALTH, url=url)
    assert health.stdout.strip() == "503 degraded", health.stdout + health.stderr
    assert status(cluster)["live_replicas"] == 0

    cluster.start_worker(TORCH_EXTENSIONS_DIR=KERNEL_CACHE)
    deadline = time.monotonic() + 180
    while (answer := complete(cluster, model, long_prompt(0)))["status"] != 200:
        assert time.monotonic() < deadline, f"replicas did not return with the node: {answer}"
        time.sleep(2)
    again = complete(cluster, model, long_prompt(0))
    assert again["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10


def test_stop_leaves_nothing_and_a_second_start_honours_host_and_placement(cluster, served, tiny_llama_dir, tmp_path):
    assert served.stop() == 0
    after = served.text().split("shutting down", 1)[1]
    # Replicas stop before the index Redis: none fails to write to it, nothing of ours raises. (Ray's own
    # processes still forward what they logged about the lost node earlier: not ours to judge.)
    ours = [line for line in after.splitlines() if "ServeReplica:kvmesh" in line or "\x1b[" not in line[:8]]
    assert not [line for line in ours if "Error" in line or "Traceback" in line], "\n".join(ours)
    assert "index publisher" not in after and "could not remove index entries" not in after, after[-3000:]
    left = cluster.python("head", LEFT_ON_CLUSTER, timeout=120)
    assert left.returncode == 0 and json.loads(left.stdout.strip().splitlines()[-1]) == [], left.stdout + left.stderr

    config = engine_config(
        tmp_path / "cluster.yaml", f"ingress_actor_options: {{num_cpus: 0, resources: {{{WORKER_RESOURCE}: 0.5}}}}\n"
    )
    second = Served(cluster, config, tmp_path / "serve.log", ["--model", str(tiny_llama_dir), "--host", "0.0.0.0"])
    try:
        second.wait_ready()
        assert f"ingress      node {WORKER_IP}" in second.text()
        assert f"gRPC         {WORKER_IP}:9000" in second.text()
        assert f"OpenAI HTTP  http://{WORKER_IP}:8000/v1" in second.text()  # the proxy beside the ingress
        # HTTP on the head's address, reached from the other node: the new --host holds.
        answer = complete(cluster, str(tiny_llama_dir), long_prompt(1), node="worker", url=f"http://{HEAD_IP}:8000")
        assert answer["status"] == 200
        third = cluster.run("head", [KVMESH, "serve", "--address", "auto", "--model", str(tiny_llama_dir)], timeout=300)
        assert third.returncode != 0
        assert "Ray Serve already runs on this cluster with HTTP on 0.0.0.0:8000" in third.stdout + third.stderr
        assert (
            complete(cluster, str(tiny_llama_dir), long_prompt(1), node="worker", url=f"http://{HEAD_IP}:8000")[
                "status"
            ]
            == 200
        )
        # The ingress's node lost mid-stream: a client of the printed endpoint (the proxy on that node) sees
        # its response cut, an error in any HTTP client, never a stream that just ends.
        stream_log = tmp_path / "stream.log"
        stream = start_stream(cluster, f"http://{WORKER_IP}:8000", str(tiny_llama_dir), stream_log)
        cluster.kill_node("worker")
        stream.wait(120)
        ending = [json.loads(x) for x in stream_log.read_text().splitlines() if x.strip()][-1]
        assert "exception" in ending or '"error"' in ending.get("line", ""), ending
    finally:
        assert second.stop() == 0


def test_replicas_on_two_nodes_fetch_prefixes_from_each_other(cluster, tiny_llama_dir, tmp_path):
    """One replica on each node: requests the router moves off a busy holder pull its prefix over the network
    between the nodes (the holder's node address, not loopback) and are served from cache."""
    cluster.start_worker(resources={ENGINE_SLOT: 1}, TORCH_EXTENSIONS_DIR=KERNEL_CACHE)
    config = tmp_path / "cluster.yaml"
    config.write_text(
        f"engine_actor_options: {{num_cpus: 0, resources: {{{ENGINE_SLOT}: 1}}}}\n"
        "engine: {num_kv_blocks: 256, max_model_len: 1024, max_num_seqs: 2}\n"
    )
    model = str(tiny_llama_dir)
    server = Served(cluster, config, tmp_path / "serve.log", ["--model", model])
    try:
        server.wait_ready()
        prefix = long_prompt(7)
        assert complete(cluster, model, prefix)["status"] == 200
        time.sleep(1.0)  # the holder's KV events reach the index
        # More long generations on the prefix than the holder's batch (2) holds: the router spreads them.
        clients = [
            cluster.popen(
                "head",
                [sys.executable, "-c", CLIENT, URL, model, f"{prefix} go{i}", "120", "0"],
                tmp_path / f"b{i}.log",
            )
            for i in range(4)
        ]
        assert all(c.wait(150) == 0 for c in clients)
        answers = [json.loads((tmp_path / f"b{i}.log").read_text().strip().splitlines()[-1]) for i in range(4)]
        assert all(a["status"] == 200 for a in answers), answers
        cached = [a["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
        deadline = time.monotonic() + 30
        while True:
            r = status(cluster)["replicas"]
            if any(x["kv_fetched_blocks"] for x in r.values()):
                break
            assert time.monotonic() < deadline, f"no replica fetched a prefix: {r} (cached tokens {cached})"
            time.sleep(1.0)
        assert {x["node"] for x in r.values()} == {HEAD_IP, WORKER_IP}, r
        fetcher = next(x for x in r.values() if x["kv_fetched_blocks"])
        holder = next(x for x in r.values() if x is not fetcher)
        assert fetcher["kv_fetched_blocks"] == holder["kv_served_blocks"] >= 16, r
        assert not fetcher["kv_fetch_fallbacks"], fetcher
        assert holder["kv_address"].startswith(f"tcp://{holder['node']}:"), holder  # reached across the nodes
        assert min(cached) >= 16 * 8, cached  # every request of the burst found the prefix, fetched or local
    finally:
        assert server.stop() == 0
