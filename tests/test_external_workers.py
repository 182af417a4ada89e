"""Integration: kvmesh routes engines it did not start. Two ``kvmesh engine`` servers (real processes, their KV
events on vLLM's wire) stand behind the engine deployment's router as external workers; the index follows their
events, a repeated prompt goes to the worker holding it, and a killed worker's entries leave the index."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cluster.engines.router_config import RoutingSettings
from kvmesh.cluster.launch.config import ClusterConfig
from kvmesh.cluster.workers.mixed_deployment import OwnedEngines, mixed_deployment
from kvmesh.cluster.workers.worker_proxy import worker_deployment
from kvmesh.cluster.workers.worker_spec import WorkerSpec
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.messages import LoadReport
from kvmesh.router.prefix_index import PrefixIndex
from tests.serve_helpers import ENGINE_SLOT, greedy_call

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WIDE_TIES = {"tie_margin": 4}
"""The routers' policy settings here: the two identical workers' measured prefill rates differ with what each
ran before and with a busy machine, and a worker measured faster by more than one prefill would take every new
prompt sent one at a time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model: str, port: int, events: Path, log: Path) -> subprocess.Popen:
    config = f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{events}.pub", "replay_endpoint": "ipc://{events}.replay"}}'
    args = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", model, "--port", str(port)]
    args += ["--threads", "1", "--num-kv-blocks", "160", "--max-num-seqs", "8", "--kv-events-config", config]
    return subprocess.Popen(
        args, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "KVMESH_REDIS_URL": ""}
    )


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kvmesh engine exited"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def loads_ray(pid: int) -> bool:
    """Whether process ``pid`` has Ray's core library mapped (importing ``ray`` loads it)."""
    return "_raylet" in Path(f"/proc/{pid}/maps").read_text()


def until(ready, timeout: float = 10.0) -> None:
    """Wait for ``ready()`` (at most ``timeout``; the assertion after it says what was expected)."""
    deadline = time.monotonic() + timeout
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.05)


def indexed_at_least(url: str, entries: int):
    """A check that ``kvmesh router`` at ``url`` holds ``entries`` blocks of its workers."""
    return lambda: httpx.get(url + "/status").json()["index"]["entries"] >= entries


@pytest.fixture(scope="module")
def workers(ray_serve, redis_server, tiny_llama_dir, tmp_path_factory):
    model, tmp = str(tiny_llama_dir), tmp_path_factory.mktemp("workers")
    procs, specs = [], []
    for i in range(2):
        port = free_port()
        procs.append(start_engine(model, port, tmp / f"w{i}", tmp / f"w{i}.log"))
        specs.append(
            {
                "url": f"http://127.0.0.1:{port}",
                "kv_events": f"ipc://{tmp}/w{i}.pub",
                "replay": f"ipc://{tmp}/w{i}.replay",
            }
        )
    try:
        for proc, spec in zip(procs, specs, strict=True):
            wait_healthy(spec["url"], proc)
        routing = RoutingSettings(
            redis_url=redis_server.url, deployment="ext", policy_kwargs=WIDE_TIES, stats_period_s=0.5
        )
        app = worker_deployment([WorkerSpec(**spec) for spec in specs], model, model, 16, routing)
        handle = ray_serve.run(app, name="external-workers", route_prefix=None)
        time.sleep(1.5)  # first load reports reach the router
        yield handle.options(method_name="generate", stream=True), model, redis_server.url, procs
    finally:
        ray_serve.delete("external-workers")
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)


async def call(handle, model, tokens, max_tokens=4):
    text, cached, replica, usage = "", 0, None, None
    async for chunk in handle.remote(greedy_call(model, tokens, max_tokens)):
        text += chunk.text
        cached, replica, usage = chunk.num_cached_tokens, chunk.replica, chunk.usage or usage
    return text, cached, replica, usage


def test_kvmesh_engine_serves_openai_clients(workers):
    """``kvmesh engine`` as any router or client sees it: chat (whole and streamed) through the official client,
    tokenize, metrics, its load report, a prefix-cache reset that its KV events announce."""
    import openai

    _, model, _, procs = workers
    url = f"http://127.0.0.1:{procs[1].args[procs[1].args.index('--port') + 1]}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    reply = client.chat.completions.create(**chat)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 5
    stream = client.chat.completions.create(**chat, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
    assert httpx.post(url + "/tokenize", json={"model": model, "prompt": "hello world"}).json()["count"] >= 2
    metrics = httpx.get(url + "/metrics").text
    assert "kvmesh_replica_requests_running" in metrics
    # Under vLLM's names too, for routers and gateways that read vLLM's (llm-d's scorers, SGLang's router).
    samples = {
        s.name: s for f in text_string_to_metric_families(metrics) for s in f.samples if s.name.startswith("vllm:")
    }
    assert samples["vllm:num_requests_running"].labels == {"model_name": model}
    assert samples["vllm:num_requests_waiting"].value == 0 and 0 <= samples["vllm:kv_cache_usage_perc"].value <= 1
    queried, hits = samples["vllm:prefix_cache_queries_total"].value, samples["vllm:prefix_cache_hits_total"].value
    assert queried >= 2 * reply.usage.prompt_tokens and 0 < hits <= queried  # the stream repeated the chat's prompt
    load = LoadReport.from_dict(httpx.get(url + "/load").json())  # what kvmesh's routers price it by
    assert load.prefill_tok_s > 0 and load.max_num_seqs == 8 and load.kv_total_blocks == 160
    assert httpx.post(url + "/reset_prefix_cache").json() == {"status": "ok"}
    prompts = httpx.get(url + "/status").json()["replicas"]
    assert next(iter(prompts.values()))["num_cached_blocks"] == 0
    assert not loads_ray(procs[1].pid)  # a single-engine server needs no Ray installed, and pays no Ray import


def test_kvmesh_router_process_routes_by_the_workers_events(workers, tmp_path):
    """``kvmesh router``: one process, no Ray or Redis, following both workers' events: new prompts spread, each
    repeated prompt goes back to the worker that holds it and hits its cache. The workers start empty (what the
    module's earlier tests cached would send every new prompt to the emptier one), and near-ties are widened
    through ``--policy-kwargs`` (``WIDE_TIES``)."""
    _, model, _, procs = workers
    specs = []
    for proc in procs:
        port = proc.args[proc.args.index("--port") + 1]
        events = proc.args[proc.args.index("--kv-events-config") + 1]
        pub, replay = (events.split(f'"{key}": "')[1].split('"')[0] for key in ("endpoint", "replay_endpoint"))
        specs += ["--worker", f"http://127.0.0.1:{port},kv_events={pub},replay={replay}"]
        assert httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache").json() == {"status": "ok"}
    port, log = free_port(), tmp_path / "router.log"
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "router", "--model", model, "--port", str(port), *specs]
    cmd += ["--policy-kwargs", json.dumps(WIDE_TIES)]
    router = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, router)
        homes = {}
        for p in range(6):
            tokens = [20_000 + 89 * p + i for i in range(200)]
            for attempt in range(2):
                r = httpx.post(
                    url + "/v1/completions", json={"model": model, "prompt": tokens, "max_tokens": 4}, timeout=60
                )
                assert r.status_code == 200, r.text
                if attempt == 0:
                    homes[p] = r.headers["x-kvmesh-replica"]
                    until(indexed_at_least(url, 12 * (p + 1)))  # the worker's events reach the router
                else:
                    assert r.headers["x-kvmesh-replica"] == homes[p]
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192
        assert len(set(homes.values())) == 2, homes
        status = httpx.get(url + "/status").json()
        assert set(status["replicas"]) == set(homes.values()) and status["index"]["entries"] >= 6 * 12
        assert sum(d["count"] for d in status["decisions"]) == 12
        assert not loads_ray(router.pid)
    finally:
        router.send_signal(signal.SIGINT)
        assert router.wait(timeout=30) == 0, log.read_text()[-2000:]


def test_workers_mixed_with_kvmesh_replicas_are_routed_as_one_fleet(workers, ray_serve):
    """``replicas: 1`` beside a worker: one deployment of the worker's proxy and a kvmesh engine of its own, the
    engine claiming a resource the cluster has once (as a GPU engine claims its GPU): only the engine's actor
    holds it, not the proxy. A burst of new prompts spreads over both; each, asked again, goes back to whichever
    holds it and hits its cache there; the index holds both kinds' blocks (the worker's from its KV events, the
    engine's from its publisher). Deleting the deployment frees the resource and takes the engine's blocks out
    of the index."""
    import ray

    _, model, url, procs = workers
    proc = next(p for p in procs if p.poll() is None)
    spec = spec_of(proc)
    routing = RoutingSettings(redis_url=url, deployment="mix", stats_period_s=0.5)
    engine = EngineConfig(model=model, num_kv_blocks=160, max_num_seqs=8, torch_threads=1)
    slot = {"num_cpus": 0, "resources": {ENGINE_SLOT: 1}}
    app = mixed_deployment([WorkerSpec(**spec)], model, routing, OwnedEngines(engine=engine, actor_options=slot), 1)
    handle = ray_serve.run(app, name="mixed", route_prefix=None).options(method_name="generate", stream=True)
    assert ray.available_resources().get(ENGINE_SLOT, 0) == 0  # the engine's actor holds the one slot
    prompts = [[2000 + 89 * p + i for i in range(200)] for p in range(6)]
    engine_blocks = []

    async def main():
        index = PrefixIndex(url, "mix", model, timeout_s=1.0)
        try:
            answers = await asyncio.gather(*(call(handle, model, tokens) for tokens in prompts))
            homes = {p: answer[2] for p, answer in enumerate(answers)}
            assert len(set(homes.values())) == 2, homes  # a burst of new prompts spreads over worker and engine
            replicas = sorted(set(homes.values()))
            for p, tokens in enumerate(prompts):
                chain = hash_blocks(tokens, 16, model_seed(model))
                deadline = time.monotonic() + 10
                while (hits := await index.lookup(chain, replicas)).get(homes[p]) != 12 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                assert hits[homes[p]] == 12, hits
                _, cached, replica, usage = await call(handle, model, tokens)
                assert replica == homes[p] and cached >= 192 and usage.completion_tokens == 4
                engine_blocks.append((chain, homes[p]))
            await caller_leaving_aborts_the_engines_request(handle, model, index, homes, prompts)
            await a_lost_engine_actor_is_replaced(handle, model, index, homes, prompts)
        finally:
            await index.close()

    async def engine_entries():
        index = PrefixIndex(url, "mix", model, timeout_s=1.0)
        try:
            return sum([(await index.lookup(chain, [home])).get(home, 0) for chain, home in engine_blocks])
        finally:
            await index.close()

    try:
        time.sleep(1.5)  # first load reports reach the router
        asyncio.run(main())
    finally:
        ray_serve.delete("mixed")
    until(lambda: ray.available_resources().get(ENGINE_SLOT, 0) == 1)
    assert ray.available_resources().get(ENGINE_SLOT, 0) == 1  # the engine's actor ended with its replica
    assert asyncio.run(engine_entries()) == 0  # and both replicas left the index as they went


async def caller_leaving_aborts_the_engines_request(handle, model, index, homes, prompts) -> None:
    """A caller leaving a stream of the mixed deployment's engine mid-way aborts the request in the engine's
    actor: its first status report from a second after shows nothing running, no KV pinned, and fewer new
    cached blocks than the 50 that the 800 tokens asked for would fill (~2 s of decoding here)."""
    reports = await index.replica_reports()
    engine_id = next(rid for rid, report in reports.items() if report.pid is not None)  # a proxy names no process
    tokens = prompts[next(p for p, home in homes.items() if home == engine_id)]
    before = (await fresh_report(index, engine_id, time.time())).num_cached_blocks  # all earlier requests cached
    stream = handle.remote(greedy_call(model, tokens, 800))
    async for chunk in stream:
        assert chunk.replica == engine_id
        break
    stream.cancel()
    report = await fresh_report(index, engine_id, time.time() + 1)
    assert report.num_running == 0 and report.kv_usage == 0, report
    assert report.num_cached_blocks - before < 50, (before, report)


async def fresh_report(index, replica: str, taken_after: float):
    """``replica``'s first status report taken after ``taken_after`` (Unix time; reports refresh every 0.6 s)."""
    deadline = time.monotonic() + 10 + max(taken_after - time.time(), 0)
    while (report := (await index.replica_reports())[replica]).reported_at < taken_after:
        assert time.monotonic() < deadline, f"no status report of {replica} after {taken_after}"
        await asyncio.sleep(0.05)
    return report


async def a_lost_engine_actor_is_replaced(handle, model, index, homes, prompts) -> None:
    """The engine's actor process dies (an OOM kill, a GPU fault): a stream on it ends with an error; Ray's
    health check finds it through the replica that owns it and replaces that replica, which starts a new engine
    under a new id; the dead one's status leaves the index with its heartbeat, and a burst of new prompts spreads
    over worker and engine again."""
    import ray

    reports = await index.replica_reports()
    ((old_id, old),) = [(rid, report) for rid, report in reports.items() if report.pid is not None]
    stream = handle.remote(greedy_call(model, prompts[next(p for p, h in homes.items() if h == old_id)], 800))
    assert (await stream.__anext__()).replica == old_id
    os.kill(old.pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(ray.exceptions.RayActorError):  # what the ingress reports as replica_failed
        async for _ in stream:
            pass
    while not [rid for rid, r in (await index.replica_reports()).items() if r.pid is not None and rid != old_id]:
        assert time.monotonic() < killed + 120, "no new engine"
        await asyncio.sleep(0.2)
    print(f"a new engine reports {time.monotonic() - killed:.1f} s after the kill")
    assert old_id not in await index.replica_reports()
    for burst in range(5):  # once its load reports reach the router (every 0.5 s)
        await asyncio.sleep(1.0)
        prompts = [[3000 + 600 * burst + 97 * p + i for i in range(100)] for p in range(6)]
        homes = {replica for _, _, replica, _ in await asyncio.gather(*(call(handle, model, t) for t in prompts))}
        if len(homes) == 2:
            break
    assert len(homes) == 2 and old_id not in homes, homes


def spec_of(proc: subprocess.Popen) -> dict:
    """The worker entry of a ``kvmesh engine`` process started by ``start_engine``."""
    events = json.loads(proc.args[proc.args.index("--kv-events-config") + 1])
    port = proc.args[proc.args.index("--port") + 1]
    return {"url": f"http://127.0.0.1:{port}", "kv_events": events["endpoint"], "replay": events["replay_endpoint"]}


def test_external_workers_are_routed_by_their_events_and_purged_when_lost(workers):
    handle, model, url, procs = workers
    prompts = [[1000 + 97 * p + i for i in range(200)] for p in range(7)]  # odd: the two workers' shares differ

    before = [prompt_tokens_seen(p) for p in procs]

    async def main():
        index = PrefixIndex(url, "ext", model, timeout_s=1.0)
        try:
            homes = {}
            for p, tokens in enumerate(prompts):
                text, cached, replica, usage = await call(handle, model, tokens)
                assert usage.prompt_tokens == 200 and usage.completion_tokens == 4 and text
                homes[p] = replica
            assert len(set(homes.values())) == 2, homes  # new prompts spread over both workers
            replicas = sorted(set(homes.values()))
            for p, tokens in enumerate(prompts):
                chain = hash_blocks(tokens, 16, model_seed(model))
                deadline = time.monotonic() + 10
                while (hits := await index.lookup(chain, replicas)).get(homes[p]) != 12 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)  # the workers' events reach the index
                assert hits[homes[p]] == 12, hits  # every full block, from the holder's own events
                _, cached, replica, _ = await call(handle, model, tokens)
                assert replica == homes[p] and cached >= 192
            shares = Counter(homes.values())
            lost = max(shares, key=shares.get)  # the busier worker: its process is the one that served more
            served = 2 * 200 * shares[lost]  # two rounds of 200-token prompts
            seen = [prompt_tokens_seen(p) - b for p, b in zip(procs, before, strict=True)]
            victim = procs[seen.index(served)]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            t0 = time.monotonic()
            while time.monotonic() - t0 < 10:
                hits = await index.lookup(hash_blocks(prompts[0], 16, model_seed(model)), replicas)
                if lost not in hits:
                    break
                await asyncio.sleep(0.25)
            assert lost not in hits, "a lost worker's entries stay in the index"
            for tokens in prompts[:3]:
                _, _, replica, usage = await call(handle, model, tokens)
                assert replica != lost and usage.completion_tokens == 4
        finally:
            await index.close()

    asyncio.run(main())


def prompt_tokens_seen(proc: subprocess.Popen) -> int:
    """Prompt tokens the ``kvmesh engine`` process has served (its own ``/status``)."""
    port = proc.args[proc.args.index("--port") + 1]
    replicas = httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()["replicas"]
    return sum(r["prompt_tokens"] for r in replicas.values())


def test_worker_settings_are_checked():
    assert WorkerSpec.parse("http://h:8000,kv_events=tcp://h:5557,replay=tcp://h:5558").replay == "tcp://h:5558"
    with pytest.raises(ValueError, match="http://"):
        WorkerSpec.parse("h:8000")
    with pytest.raises(ValueError, match="key=value"):
        WorkerSpec.parse("http://h:8000,tcp://h:5557")
    assert WorkerSpec.parse("http://h:8000,kv_events=tcp://[::1]:5557,replay=ipc:///tmp/r").replay == "ipc:///tmp/r"
    for bad in ("h:5557", "tcp://h", "tcp://*:5557", "tcp://h:99999", "tcp://h:port", "tcp://:5557", "ipc://"):
        with pytest.raises(ValueError, match="ZMQ address"):  # refused here, not by a thread of the router later
            WorkerSpec.parse(f"http://h:8000,kv_events={bad}")
    with pytest.raises(ValueError, match="unexpected keyword"):
        WorkerSpec.parse("http://h:8000,kv_event=tcp://h:5557")
    one = [{"url": "http://h:1"}]
    assert ClusterConfig(replicas=0, workers=one).engine_replicas == 1
    assert (ClusterConfig(workers=one).replicas, ClusterConfig().replicas) == (0, 2)  # the defaults
    assert ClusterConfig(replicas=2, workers=one).engine_replicas == 3  # mixed: the worker, then two engines
    gpu = {"num_gpus": 1}  # the engines' actors claim it, not the workers' proxies (tested below on a custom resource)
    assert ClusterConfig(replicas=1, workers=one, engine_actor_options=gpu).engine_replicas == 2
    assert ClusterConfig(replicas=0, workers=one, engine_actor_options={"num_gpus": 1}).replicas == 0
    with pytest.raises(ValueError, match="autoscaling"):
        ClusterConfig(replicas=1, workers=one, max_replicas=3)
    with pytest.raises(ValueError, match="at least 1"):
        ClusterConfig(replicas=0)
    with pytest.raises(ValueError, match="named twice"):
        ClusterConfig(replicas=0, workers=[{"url": "http://h:1"}, {"url": "http://h:1/", "kv_events": "tcp://h:2"}])
