"""The simulated engine (``kvmesh engine --simulate``): the real scheduler, KV cache and events over a timing
model. In process: tokens that depend only on the prompt, the prefix cache and eviction with vLLM-schema events,
steps that take what the timing says. As servers: the OpenAI API from several engines in one process, and
two ``kvmesh router`` processes sharing a Redis over 16 of them, sending repeated prefixes to their holders."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis
import zmq

from kvmesh.cluster.workers.worker_client import Worker
from kvmesh.cluster.workers.worker_spec import WorkerSpec
from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.messages import LOAD_HEADER, GenerateCall, LoadReport
from kvmesh.core.step_timing import StepTiming
from kvmesh.replica import EngineConfig, LLMEngine, SamplingParams
from kvmesh.replica.kv_event_publisher import ZmqKVEventPublisher
from tests.test_external_workers import free_port, wait_healthy
from tests.test_kv_events_wire import events_config, strict_read

TIMING = StepTiming(prefill_tok_s=4000.0, decode_s_per_seq=0.002, min_step_s=0.02)


def simulated(model, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), simulate=TIMING, **settings))


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, in the order given."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
    return [tokens[i] for i in ids]


def test_tokens_depend_only_on_the_prompt_and_round_trip_through_text(smollm_dir):
    a, b = simulated(smollm_dir), simulated(smollm_dir, max_num_seqs=2)
    prompts = [a.tokenize(f"Question {i}: what is the capital of country number {i}?") for i in range(4)]
    first = run(a, prompts, 12)
    assert run(b, prompts[::-1], 12) == first[::-1]  # another engine, order and batch size
    assert len({tuple(t) for t in first}) == 4
    for tokens in first:
        assert a.tokenize(a.tokenizer.decode(tokens)) == tokens  # a next turn's prompt holds the same tokens


def test_prefix_cache_and_eviction_publish_vllm_schema_events(smollm_dir, tmp_path):
    engine = simulated(smollm_dir, block_size=16, num_kv_blocks=24)
    config = events_config(tmp_path)
    pub = ZmqKVEventPublisher(config, 16)
    engine.kv_event_sinks.append(pub.publish)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(config.endpoint)
    time.sleep(0.2)
    shared = list(range(1000, 1160))
    run(engine, [shared])
    before = engine.stats().cached_prompt_tokens
    run(engine, [[*shared, 7, 8, 9]])
    assert engine.stats().cached_prompt_tokens - before == 160
    run(engine, [list(range(3000 + 200 * i, 3000 + 200 * i + 150)) for i in range(3)])  # more than the pool
    kinds = set()
    while sub.poll(1000):
        _, events = strict_read(sub.recv_multipart(), b"kv@test")
        kinds |= {(e["type"], e.get("medium")) for e in events}
    pub.close()
    sub.close()
    assert {("BlockStored", "GPU"), ("BlockRemoved", "GPU")} <= kinds
    before = engine.stats().cached_prompt_tokens
    run(engine, [shared])
    assert engine.stats().cached_prompt_tokens == before  # evicted: recomputed


def test_steps_take_what_the_timing_model_says(smollm_dir):
    """A long prefill, then decode steps of eight sequences: the time taken follows the timing (a busy machine
    only adds host time, so the upper bound is loose) and the engine measures the modelled rates."""
    engine = simulated(smollm_dir, max_num_batched_tokens=2048)
    started = time.perf_counter()
    run(engine, [list(range(5000, 7000))], max_tokens=1)
    prefill_s = time.perf_counter() - started
    assert TIMING.step_s(2000, 0) <= prefill_s <= 1.5 * TIMING.step_s(2000, 0) + 0.2
    started = time.perf_counter()
    run(engine, [[9000 + i] * 16 for i in range(8)], max_tokens=25)
    decode_s = time.perf_counter() - started
    modelled = TIMING.step_s(8 * 16, 0) + 24 * TIMING.step_s(0, 8)
    assert modelled <= decode_s * 1.05 and decode_s <= 1.6 * modelled, (decode_s, modelled)
    stats = engine.stats()
    assert 0.6 * TIMING.prefill_tok_s <= stats.prefill_tok_s <= 1.05 * TIMING.prefill_tok_s


@pytest.fixture(scope="module")
def engines(smollm_dir, tmp_path_factory):
    """16 simulated engines in one ``kvmesh engine`` process, their KV events on ipc sockets."""
    tmp, port = tmp_path_factory.mktemp("sim"), free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp}/e.pub", "replay_endpoint": f"ipc://{tmp}/e.rp"}
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "engine", "--model", str(smollm_dir), "--simulate"]
    cmd += ["--engines", "16", "--port", str(port), "--kv-events-config", json.dumps(events)]
    cmd += ["--num-kv-blocks", "400"]
    log = tmp / "engines.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        for rank in range(16):
            wait_healthy(f"http://127.0.0.1:{port + rank}", proc, timeout=180)
        yield proc, port, events
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]


def test_several_simulated_engines_serve_the_openai_api(engines, smollm_dir):
    _, port, _ = engines
    body = {"model": str(smollm_dir), "messages": [{"role": "user", "content": "Name three rivers."}]}
    answers = []
    for rank in (0, 5):
        url = f"http://127.0.0.1:{port + rank}"
        first = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 8}, timeout=30).json()
        again = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 8}, timeout=30).json()
        assert first["usage"]["completion_tokens"] == 8 and first["choices"][0]["message"]["content"]
        assert again["choices"] == first["choices"] and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        streamed = ""
        stream = {**body, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/chat/completions", json=stream, timeout=30) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert streamed == first["choices"][0]["message"]["content"] and chunks[-1]["usage"]["completion_tokens"] == 8
        answers.append(first["choices"][0]["message"]["content"])
        metrics = httpx.get(url + "/metrics").text
        assert 'vllm:prefix_cache_hits_total{model_name="' in metrics
    assert answers[0] == answers[1]  # the same prompt on two engines
    ids = {httpx.get(f"http://127.0.0.1:{port + rank}/load").json()["index_id"] for rank in range(16)}
    assert len(ids) == 16


def test_each_response_carries_the_engines_load_which_a_router_takes(engines, smollm_dir):
    """A simulated engine's responses carry its ``LoadReport`` (``LOAD_HEADER``), taken once the request runs;
    a router's ``Worker`` sending there takes it as the worker's newest report, with no ``/load`` read."""
    _, port, _ = engines
    url = f"http://127.0.0.1:{port + 3}"
    body = {"model": str(smollm_dir), "prompt": "Name three rivers.", "max_tokens": 4}
    header = httpx.post(url + "/v1/completions", json=body, timeout=30).headers[LOAD_HEADER]
    report = LoadReport.from_dict(json.loads(header))
    assert report.index_id == httpx.get(url + "/load").json()["index_id"] and report.num_running == 1
    tokens = list(range(200, 280))
    params = SamplingParams(max_tokens=4)
    call = GenerateCall(
        request_id="h1",
        prompt_token_ids=tokens,
        block_hashes=hash_blocks(tokens, 16, model_seed(str(smollm_dir))),
        block_size=16,
        params=params,
    )

    async def main():
        worker = Worker(WorkerSpec(url=url), str(smollm_dir), str(smollm_dir), 16, load_period_s=60.0).start()
        try:
            while worker.report is None:  # its first read, at start; the next would come in a minute
                await asyncio.sleep(0.05)
            polled = worker.report
            chunks = [chunk async for chunk in worker.generate(call, url)]
            return polled, worker.report, chunks
        finally:
            await worker.aclose()

    polled, taken, chunks = asyncio.run(main())
    assert chunks[-1].usage.completion_tokens == 4
    assert taken.reported_at > polled.reported_at and taken.num_running == 1 and polled.num_running == 0


def test_two_kvmesh_routers_sharing_redis_send_repeated_prefixes_to_their_holders_among_16(
    engines, smollm_dir, own_redis, tmp_path
):
    """Two ``kvmesh router`` processes over 16 simulated engines, sharing one Redis (``--redis-url``): each prompt
    is sent through one router, then again through the other, which sends it to the engine that cached it. Each
    router recorded every request it sent in the Redis and read the others' before each decision."""
    _, port, events = engines
    specs = []
    for rank in range(16):
        pub, replay = (events[key] + (f"_{rank}" if rank else "") for key in ("endpoint", "replay_endpoint"))
        specs += ["--worker", f"http://127.0.0.1:{port + rank},kv_events={pub},replay={replay}"]
        assert httpx.post(f"http://127.0.0.1:{port + rank}/reset_prefix_cache").json() == {"status": "ok"}
    cmd = [sys.executable, "-m", "kvmesh.cluster.launch.cli", "router", "--model", str(smollm_dir)]
    routers, urls = [], []
    for i in range(2):
        router_port, log = free_port(), tmp_path / f"router{i}.log"
        args = [*cmd, "--port", str(router_port), "--redis-url", own_redis.url, *specs]
        routers.append((subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT), log))
        urls.append(f"http://127.0.0.1:{router_port}")
    try:
        for url, (router, _) in zip(urls, routers, strict=True):
            wait_healthy(url, router)
        homes = {}
        for p in range(12):
            url = urls[p % 2]
            tokens = [20_000 + 97 * p + i for i in range(256)]
            request = {"model": str(smollm_dir), "prompt": tokens, "max_tokens": 4}
            r = httpx.post(url + "/v1/completions", json=request, timeout=60)
            assert r.status_code == 200, r.text
            homes[p] = r.headers["x-kvmesh-replica"]
            deadline = time.monotonic() + 10
            while (
                min(httpx.get(u + "/status").json()["index"]["entries"] for u in urls) < 16 * (p + 1)
                and time.monotonic() < deadline
            ):
                time.sleep(0.05)
        for p in range(12):
            request = {"model": str(smollm_dir), "prompt": [20_000 + 97 * p + i for i in range(256)], "max_tokens": 4}
            r = httpx.post(urls[(p + 1) % 2] + "/v1/completions", json=request, timeout=60)
            assert r.headers["x-kvmesh-replica"] == homes[p]
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 240
        assert len(set(homes.values())) >= 6, homes  # new prompts spread over the fleet
        calls = {k: v["calls"] for k, v in redis.Redis.from_url(own_redis.url).info("commandstats").items()}
        assert calls["cmdstat_zadd"] == calls["cmdstat_zrem"] == 24  # each request recorded, then taken back
        assert calls.get("cmdstat_evalsha", 0) + calls.get("cmdstat_eval", 0) >= 24  # each decision read them
    finally:
        for router, log in routers:
            router.send_signal(signal.SIGINT)
            assert router.wait(timeout=30) == 0, log.read_text()[-2000:]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_serve_replicas_simulated_are_routed_by_their_cache(ray_serve, redis_server, smollm_dir):
    """``kvmesh serve --simulate``'s setting on a Serve deployment: replicas index their blocks in Redis and the
    KV-aware router sends each repeated prompt back to the replica that holds it."""
    from kvmesh.cluster.engines.engine_deployment import engine_deployment
    from kvmesh.cluster.engines.router_config import RoutingSettings
    from tests.test_serve_routing import call

    engine = EngineConfig(model=str(smollm_dir), simulate=TIMING, num_kv_blocks=300, max_num_seqs=8)
    routing = RoutingSettings(redis_url=redis_server.url, deployment="sim", stats_period_s=0.5)
    handle = ray_serve.run(engine_deployment(engine, routing, num_replicas=3), name="sim-it", route_prefix=None)
    handle = handle.options(method_name="generate", stream=True)
    time.sleep(1.5)  # first load reports reach the router
    try:
        homes = {}
        for p in range(6):
            reply, cached, homes[p] = asyncio.run(
                call(handle, str(smollm_dir), [30_000 + 131 * p + i for i in range(160)])
            )
            assert len(reply) == 8 and cached == 0
        time.sleep(1.0)  # the replicas' index writes land
        for p in range(6):
            reply, cached, replica = asyncio.run(
                call(handle, str(smollm_dir), [30_000 + 131 * p + i for i in range(160)])
            )
            assert replica == homes[p] and cached >= 144
        assert len(set(homes.values())) >= 2
    finally:
        ray_serve.delete("sim-it")
