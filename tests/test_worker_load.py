"""Unit: what kvmesh's routers learn of an external worker's speed. A ``kvmesh engine`` serves its ``LoadReport`` at
``GET /load``; ``Worker`` reads it beside ``/metrics`` (a worker without one, vLLM or SGLang, is not asked again)
and ``kvmesh router`` prices the worker by its measured rates instead of the defaults. The worker's pages are
served by a small aiohttp server on loopback; ``tests/test_external_workers.py`` reads a real engine's."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from kvmesh.cluster.workers.router_server import LocalRouter
from kvmesh.cluster.workers.worker_client import Worker
from kvmesh.cluster.workers.worker_spec import WorkerSpec
from kvmesh.core.errors import InvalidRequest, RequestFailed
from kvmesh.core.hashing import hash_blocks, model_seed
from kvmesh.core.kv_event_wire import EventBatch, StoredBlocks
from kvmesh.core.messages import GenerateCall, LoadReport
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.router.policy import RouteRequest

MODEL = "m"


def worker(url: str) -> Worker:
    return Worker(WorkerSpec(url=url), MODEL, MODEL, 16)


class Pages:
    """An HTTP server on loopback answering ``pages`` (path: status and body; 404 elsewhere), and a ``Worker``
    reading it; ``asked``: the paths it was asked for."""

    def __init__(self, pages: dict[str, tuple[int, str]]) -> None:
        self.pages, self.asked = pages, []

    async def _answer(self, request: web.Request) -> web.Response:
        self.asked.append(request.path)
        status, body = self.pages.get(request.path, (404, ""))
        return web.Response(status=status, text=body)

    async def __aenter__(self) -> Worker:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        self.worker = worker(f"http://{host}:{port}")
        self.worker.open_session()  # what ``start`` opens, without its poller
        return self.worker

    async def __aexit__(self, *_) -> None:
        await self.worker.aclose()
        await self.runner.cleanup()


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
    kv_pages = Pages({"/load": (200, json.dumps(report.as_dict()))})
    vllm_pages = Pages({"/metrics": (200, VLLM_METRICS)})

    async def main():
        async with kv_pages as kvmesh, vllm_pages as vllm:
            reads = [(await kvmesh._read_load(), await vllm._read_load()) for _ in range(3)]
        return reads, kvmesh, vllm

    reads, kvmesh, vllm = asyncio.run(main())
    assert reads == [(True, True)] * 3
    assert kvmesh.report == report and kv_pages.asked == ["/load"] * 3  # one read a poll, no /metrics to parse
    assert kvmesh.gauges == {"running": 3, "waiting": 0, "kv_usage": 0.5}
    assert kvmesh.measured()["prefill_tok_s"] == 812.5 and kvmesh.measured()["max_num_seqs"] == 8
    assert vllm_pages.asked == ["/load", "/metrics", "/metrics", "/metrics"]  # 404 once: never asked again
    assert vllm.report is None and vllm.measured() == {}
    assert vllm.gauges == {"running": 3.0, "waiting": 4.0, "kv_usage": 0.25}  # summed over engines


def test_a_garbled_or_failing_load_page_and_a_silent_worker():
    """Garbled ``/load``: the worker is read from ``/metrics``; 503: it did not answer (counts towards down), as
    does a port where nothing listens."""
    garbled, failing = Pages({"/load": (200, "not json")}), Pages({"/load": (503, "")})

    async def main():
        async with garbled as g, failing as f:
            reads = [await g._read_load(), await f._read_load()]
        silent = worker(g.spec.url)  # the server has stopped: nothing listens there now
        silent.open_session()
        reads.append(await silent._read_load())
        await silent.aclose()
        return reads, g

    reads, g = asyncio.run(main())
    assert reads == [True, False, False]
    assert garbled.asked == ["/load", "/metrics"] and g.report is None


def sse(*events: dict | str) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def test_a_report_a_response_brought_stands_in_for_the_periodic_load_read():
    """A ``kvmesh engine`` sends its ``LoadReport`` with each response: while one is fresher than the load period
    the worker's ``/load`` is not read (32 workers read 4 times a second cost a router more CPU than its
    requests); once none came for a period, it is read again. An older report never replaces a newer one."""
    now = time.time()
    pages = Pages({"/load": (200, json.dumps(LoadReport(index_id="w", reported_at=now).as_dict()))})

    async def main():
        async with pages as w:
            w.load_period_s = 1.0
            assert w._take_report(json.dumps(LoadReport(index_id="w", reported_at=now + 5, num_running=2).as_dict()))
            assert w._take_report(json.dumps(LoadReport(index_id="w", reported_at=now + 1).as_dict()))
            poller = asyncio.create_task(w._poll_metrics())
            await asyncio.sleep(0.3)
            early = pages.asked.count("/load")
            deadline = time.monotonic() + 10
            while not pages.asked.count("/load") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            poller.cancel()
            return early, pages.asked.count("/load"), w.report

    early, later, report = asyncio.run(main())
    assert early == 0 and later >= 1
    assert report.reported_at == now + 5 and report.num_running == 2  # the /load answer is older


def test_a_workers_stream_its_refusals_and_a_cut_stream():
    """What a router relays: each streamed choice chunk (its token ids, however long its text), then the usage
    with the worker's cached tokens; a 4xx refusal as the client's error with the worker's message; a stream
    ending without usage, or in the middle of an event, as a failure, never as a short answer."""
    tokens = list(range(40))
    hashes = hash_blocks(tokens, 16, model_seed(MODEL))
    call = GenerateCall(
        request_id="r1",
        prompt_token_ids=tokens,
        block_hashes=hashes,
        block_size=16,
        params=SamplingParams(max_tokens=2),
    )
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
    good = sse(
        {"choices": [{"index": 0, "text": "Hi", "token_ids": [5]}]},
        {"choices": [{"index": 0, "text": "!", "token_ids": [6], "finish_reason": "length"}]},
        {"choices": [], "usage": usage},
        "[DONE]",
    )
    long_text = "word " * 300_000  # one 1.5 MB event: over aiohttp's default line limit (128 KiB)
    long = sse({"choices": [{"index": 0, "text": long_text, "token_ids": [7]}]}, {"choices": [], "usage": usage})
    refusal = json.dumps({"error": {"message": "prompt too long", "type": "BadRequestError"}})
    pages = {
        "/good/v1/completions": (200, good),
        "/long/v1/completions": (200, long),
        "/refuses/v1/completions": (400, refusal),
        "/no-usage/v1/completions": (200, good[: good.index('data: {"choices": []')]),
        "/cut/v1/completions": (200, good[: good.index('"usage"')]),  # ends inside an event
    }

    async def outcome(server: Worker, prefix: str):
        w = worker(server.spec.url + prefix)
        w.open_session()
        try:
            return [c async for c in w.generate(call, "w")]
        except (InvalidRequest, RequestFailed) as exc:
            return exc
        finally:
            await w.aclose()

    async def main():
        async with Pages(pages) as p:
            return [await outcome(p, prefix) for prefix in ("/good", "/long", "/refuses", "/no-usage", "/cut")]

    chunks, long_chunks, refused, no_usage, cut = asyncio.run(main())
    assert [(c.text, c.token_ids, c.finish_reason) for c in chunks[:2]] == [("Hi", [5], None), ("!", [6], "length")]
    assert chunks[-1].usage.cached_tokens == 32 and chunks[-1].usage.completion_tokens == 2
    assert long_chunks[0].text == long_text and long_chunks[-1].usage is not None
    assert isinstance(refused, InvalidRequest) and "prompt too long" in str(refused)
    assert isinstance(no_usage, RequestFailed) and "without usage" in str(no_usage)
    assert isinstance(cut, RequestFailed) and "malformed event" in str(cut)


def test_kvmesh_router_prices_workers_by_their_measured_rates():
    """Two idle workers, a new prompt: at the default rates they tie; once one reports prefilling three times as
    fast as the other (more than the prompt's own prefill apart), the new prompt goes to it, and alone."""
    fast, slow = worker("http://fast:1"), worker("http://slow:1")
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
    a, b = worker("http://a:1"), worker("http://b:1")
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


def test_kvmesh_router_counts_other_routers_requests_from_a_workers_report_and_its_own_sent_since():
    """Several ``kvmesh router`` processes in front of one fleet: each sees the others' requests in a worker's
    ``/load`` report (its own queue), and adds what it sent itself since. A burst another router sent to ``a``
    moves a new prompt to ``b``; once this router has sent ``b`` more than ``a`` holds, the next goes to ``a``."""
    a, b = worker("http://a:1"), worker("http://b:1")
    now = time.time()
    a.report = LoadReport(
        index_id="a", reported_at=now, num_waiting=3, pending_prefill_tokens=3000, prefill_tok_s=1000.0, cache_fill=0.0
    )
    b.report = LoadReport(index_id="b", reported_at=now, prefill_tok_s=1000.0, cache_fill=0.0)
    router = LocalRouter([a, b])

    def call(p: int) -> GenerateCall:
        tokens = list(range(1000 * p, 1000 * p + 320))
        hashes = hash_blocks(tokens, 16, model_seed(MODEL))
        params = SamplingParams(max_tokens=4)
        return GenerateCall(
            request_id=f"r{p}", prompt_token_ids=tokens, block_hashes=hashes, block_size=16, params=params
        )

    assert router._load("http://a:1").num_requests == 3 and router.choose(call(0))[0] == "http://b:1"
    for p in range(3):  # sent by this router after b's report
        router.routes.add(f"s{p}", "http://b:1", 2000)
    load = router._load("http://b:1")
    assert load.num_requests == 3 and load.routed_prefill_tokens > 5000
    assert router.choose(call(1))[0] == "http://a:1"
    for p in range(3):
        router.routes.done(f"s{p}")
    assert router._load("http://b:1").num_requests == 0


VLLM_LORA_INFO = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="tone",waiting_lora_adapters="style,tone"} 1.8e9
"""


def models_page(*adapters: str) -> str:
    """A vLLM ``/v1/models`` answer: the base model and each adapter with its ``parent``."""
    data = [{"id": MODEL, "object": "model", "root": MODEL, "parent": None}]
    data += [{"id": a, "object": "model", "root": f"/loras/{a}", "parent": MODEL} for a in adapters]
    return json.dumps({"object": "list", "data": data})


def test_adapter_requests_go_to_the_vllm_workers_that_serve_them_and_their_ready_adapters_are_priced():
    """A vLLM worker's ``/v1/models`` says which adapters it serves and its ``lora_requests_info`` gauge (the
    current sample: the latest time) which it holds ready; a request on an adapter goes only to a worker that
    serves it, however busy; one on an adapter nobody lists, or on the base model, may go anywhere."""
    with_adapters = Pages(
        {"/metrics": (200, VLLM_METRICS + VLLM_LORA_INFO), "/v1/models": (200, models_page("tone", "style"))}
    )
    base_only = Pages({"/metrics": (200, VLLM_METRICS), "/v1/models": (200, models_page())})

    async def main():
        async with with_adapters as a, base_only as b:
            for w in (a, b):
                assert await w._read_load()
                await w._read_models()
            return a, b

    a, b = asyncio.run(main())
    assert a.served == {"tone", "style"} and b.served == frozenset()
    assert a.measured() == {"loras": ["tone", "style"], "lora_slots": 2}
    assert b.measured() == {} and not b.serves("tone") and b.serves(MODEL) is False
    router = LocalRouter([a, b])
    a.in_flight = 50  # far busier: a base-model request would go to b

    def call(lora: str | None) -> GenerateCall:
        tokens = list(range(len(lora or ""), 320))  # a prompt of its own each: nothing sent before is a hit
        return GenerateCall(
            request_id=f"r-{lora}",
            prompt_token_ids=tokens,
            block_hashes=hash_blocks(tokens, 16, model_seed(MODEL)),
            block_size=16,
            params=SamplingParams(max_tokens=4),
            lora_name=lora,
        )

    assert router.choose(call("tone"))[0] == a.spec.url
    assert router.choose(call("style"))[0] == a.spec.url
    assert router.choose(call(None))[0] == b.spec.url
    assert router.choose(call("nobody-lists-it"))[0] == b.spec.url  # no worker lists it: load decides; it 404s
