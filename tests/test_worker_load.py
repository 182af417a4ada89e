"""Unit: what kvmesh's routers learn of an external worker's speed. A ``kvmesh engine`` serves its ``LoadReport`` at
``GET /load``; ``Worker`` reads it beside ``/metrics`` (a worker without one, vLLM or SGLang, is not asked again)
and ``kvmesh router`` prices the worker by its measured rates instead of the defaults. The HTTP side is an
``httpx.MockTransport`` standing for the worker's pages; ``tests/test_external_workers.py`` reads a real one."""

from __future__ import annotations

import asyncio

import httpx

from kvmesh.cluster.router_server import LocalRouter
from kvmesh.cluster.worker_client import Worker
from kvmesh.cluster.worker_spec import WorkerSpec
from kvmesh.router.policy import RouteRequest
from kvmesh.shared.hashing import hash_blocks, model_seed
from kvmesh.shared.kv_event_wire import EventBatch, StoredBlocks
from kvmesh.shared.messages import GenerateCall, LoadReport
from kvmesh.shared.sampling_params import SamplingParams

MODEL = "m"


def worker(url: str, pages: dict[str, httpx.Response]) -> tuple[Worker, list[str]]:
    """A ``Worker`` whose HTTP client answers from ``pages`` (404 elsewhere); the paths it asked for."""
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return pages.get(request.url.path, httpx.Response(404))

    w = Worker(WorkerSpec(url=url), MODEL, MODEL, 16)
    w.client = httpx.AsyncClient(base_url=url, transport=httpx.MockTransport(answer))
    return w, asked


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


def test_a_kvmesh_engines_load_report_replaces_its_metrics_and_other_workers_are_read_from_metrics():
    report = LoadReport(index_id="engine-1", prefill_tok_s=812.5, num_running=3, kv_usage=0.5, max_num_seqs=8)
    kvmesh, kvmesh_asked = worker("http://a:1", {"/load": httpx.Response(200, json=report.as_dict())})
    vllm, vllm_asked = worker("http://b:1", {"/metrics": httpx.Response(200, text=VLLM_METRICS)})

    async def main():
        return [(await kvmesh._read_load(), await vllm._read_load()) for _ in range(3)]

    assert asyncio.run(main()) == [(True, True)] * 3
    assert kvmesh.report == report and kvmesh_asked == ["/load"] * 3  # one read a poll, no /metrics to parse
    assert kvmesh.gauges == {"running": 3, "waiting": 0, "kv_usage": 0.5}
    assert kvmesh.measured()["prefill_tok_s"] == 812.5 and kvmesh.measured()["max_num_seqs"] == 8
    assert vllm_asked == ["/load", "/metrics", "/metrics", "/metrics"]  # 404 once: never asked again
    assert vllm.report is None and vllm.measured() == {}
    assert vllm.gauges == {"running": 3.0, "waiting": 4.0, "kv_usage": 0.25}  # summed over engines
    garbled, asked = worker("http://c:1", {"/load": httpx.Response(200, text="not json")})
    assert asyncio.run(garbled._read_load()) and asked == ["/load", "/metrics"] and garbled.report is None
    down, _ = worker("http://d:1", {"/load": httpx.Response(503)})
    assert not asyncio.run(down._read_load())  # counts towards the worker being down


def test_kvmesh_router_prices_workers_by_their_measured_rates():
    """Two idle workers, a new prompt: at the default rates they tie; once one reports prefilling three times as
    fast as the other (more than the prompt's own prefill apart), the new prompt goes to it, and alone."""
    fast, _ = worker("http://fast:1", {})
    slow, _ = worker("http://slow:1", {})
    router = LocalRouter([fast, slow])
    tokens = list(range(640))
    req = RouteRequest(hash_blocks(tokens, 16, model_seed(MODEL)), len(tokens), 16)
    assert router.policy.rank(req, [router._load(u) for u in router.workers], {}).tied == 2
    fast.report = LoadReport(index_id="f", prefill_tok_s=2400.0, cache_fill=0.0)
    slow.report = LoadReport(index_id="s", prefill_tok_s=800.0, cache_fill=0.0)
    loads = {u: router._load(u) for u in router.workers}
    assert loads["http://fast:1"].prefill_tok_s == 2400.0 and loads["http://fast:1"].index_id == "http://fast:1"
    call = GenerateCall(
        request_id="r1",
        prompt_token_ids=tokens,
        block_hashes=req.block_hashes,
        block_size=16,
        params=SamplingParams(max_tokens=4),
    )
    assert router.choose(call) == ("http://fast:1", 0)
    assert router.policy.rank(req, list(loads.values()), {}).tied == 1


def test_a_new_prompt_among_near_tied_workers_goes_to_the_smallest_cache():
    """Idle workers tie on a new prompt; the one whose cache holds least takes it, so the first requests of
    different hot documents land on different workers (SGLang's router places a miss by its trees' sizes
    alike). Here no events follow the requests, so the emptier worker keeps taking them."""
    a, _ = worker("http://a:1", {})
    b, _ = worker("http://b:1", {})
    doc = list(range(10_000, 10_320))  # 20 blocks a holds already
    a.blocks.apply(
        EventBatch(
            ts=0.0,
            events=[
                StoredBlocks(block_hashes=list(range(1, 21)), parent_block_hash=None, token_ids=doc, block_size=16)
            ],
        )
    )
    assert len(a.blocks) == 20 and len(b.blocks) == 0
    router = LocalRouter([a, b])
    for p in range(4):
        tokens = list(range(1000 * p, 1000 * p + 320))
        call = GenerateCall(
            request_id=f"r{p}",
            prompt_token_ids=tokens,
            block_hashes=hash_blocks(tokens, 16, model_seed(MODEL)),
            block_size=16,
            params=SamplingParams(max_tokens=4),
        )
        url, hits = router.choose(call)
        assert url == "http://b:1" and hits == 0, p
