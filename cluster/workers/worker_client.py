"""One external OpenAI-compatible worker (vLLM, SGLang, ``kvmesh engine``) as kvmesh's routers use it, with no
Ray: requests forwarded to its ``/v1/completions`` as token ids (the ingress tokenized with the served model's
tokenizer, so the router's block hashes are the worker's prompt), streaming, with the tenant's ``cache_salt``;
chunks, usage and its cached-token count back, errors as it said them. Its cache in kvmesh's hashes from its
KV events (``router/kv_event_subscriber.py``, ``router/worker_blocks.py``); its load from what
was sent to it and what it reports: a ``kvmesh engine``'s ``LoadReport`` (with each response, and ``GET /load``
when none came for a period: gauges and measured rates), other workers' ``/metrics`` gauges, read every period;
after ``DOWN_AFTER_S`` of unanswered reads it is down (its cache forgotten) until it answers again (its cache
then rebuilt from its event stream). The HTTP client is aiohttp's: its C
parser relays a streamed token for less router CPU than a pure-Python one (``benchmarks/router_overhead.py``).

Ray Serve's ``WorkerProxy`` (``cluster/workers/worker_proxy.py``) and the Ray-free ``kvmesh router``
(``cluster/workers/router_server.py``) both drive workers through ``Worker``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.cluster.workers.worker_adapters import ReadyAdapters, ready_adapters, served_adapters
from kvmesh.cluster.workers.worker_spec import WorkerSpec
from kvmesh.core.errors import InvalidRequest, RequestFailed
from kvmesh.core.hashing import model_seed
from kvmesh.core.kv_event_wire import EventBatch
from kvmesh.core.messages import LOAD_HEADER, GenerateCall, GenerateChunk, LoadReport, ReplicaStatus, Usage
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.router.kv_event_subscriber import KVEventSubscriber
from kvmesh.router.worker_blocks import IndexEvent, WorkerBlocks

log = logging.getLogger(__name__)

METRICS_PERIOD_S = 1.0
"""How often a worker's load is read, by default."""
MODELS_PERIOD_S = 5.0
"""How often the worker's ``/v1/models`` (the adapters it serves) is read again."""
DOWN_AFTER_S = 2.0
"""Seconds of unanswered load reads (at least two) after which a worker counts as down."""
START_TIMEOUT_S = 10.0
"""How long a start waits for the worker's ``/health``."""
POLL_TIMEOUT_S = 2.0
KEEPALIVE_S = 4.0
"""How long an idle connection to a worker is kept: under the 5 s after which uvicorn closes it."""
READ_BUFSIZE = 1 << 20
"""aiohttp reads a line of up to twice this: one server-sent event (its default, 64 KiB, refuses events over
128 KiB, e.g. a long text chunk)."""
STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=5.0)
"""A generation may stream for as long as it runs; only connecting is bounded."""
MEASURED_FIELDS = (
    "prefill_tok_s",
    "decode_s_per_seq",
    "step_s",
    "mean_output_tokens",
    "max_num_seqs",
    "kv_free_blocks",
    "kv_total_blocks",
    "host_load_tok_s",
    "disk_load_tok_s",
    "loras",
    "lora_slots",
    "lora_load_s",
)
"""What a router takes from a worker's own ``LoadReport``: its speed and room. Request counts it takes from what
it sent itself (fresher than a poll) and from the gauges. Cache fill and prefill busy stay at the defaults (full,
busy: every miss evicts at full price): priced by a worker's own, the router copied documents to idle workers
and lost hits (``benchmarks/results/README.md``)."""


class WorkerUnreachable(RuntimeError):
    """The worker did not answer ``/health`` (the message names its URL)."""


def wait_for_worker(url: str, headers: dict[str, str], timeout_s: float = START_TIMEOUT_S) -> None:
    """Return once ``url/health`` answers below 500; raise ``WorkerUnreachable`` after ``timeout_s``."""
    deadline, error = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=2.0):
                return
        except urllib.error.HTTPError as exc:  # a status: below 500 the worker is up (e.g. 401 without a key)
            if exc.code < 500:
                return
            error = f"HTTP {exc.code}"
        except OSError as exc:
            error = repr(exc)
        time.sleep(0.5)
    raise WorkerUnreachable(f"worker {url} does not answer /health ({error}) after {timeout_s:.0f} s")


def completion_body(call: GenerateCall, model: str) -> dict:
    """The worker's ``/v1/completions`` request for ``call``: its token ids, its adapter as the model (where it
    names one, as vLLM serves adapters) and every sampling setting the OpenAI API (and vLLM's extensions) can say."""
    p: SamplingParams = call.params
    body = {
        "model": call.lora_name or model,
        "prompt": call.prompt_token_ids,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "n": p.n,
        "return_token_ids": True,
    }
    extras = {
        "top_k": p.top_k or None,
        "min_p": p.min_p or None,
        "seed": p.seed,
        "stop": p.stop or None,
        "stop_token_ids": p.stop_token_ids or None,
        "ignore_eos": p.ignore_eos or None,
        "logit_bias": {str(k): v for k, v in p.logit_bias.items()} or None,
        "presence_penalty": p.presence_penalty or None,
        "frequency_penalty": p.frequency_penalty or None,
        "min_tokens": p.min_tokens or None,
        "cache_salt": call.cache_salt,
    }
    if p.logprobs is not None or p.prompt_logprobs is not None or p.json_schema is not None:
        raise InvalidRequest("logprobs and response_format are not forwarded to external workers yet", "logprobs")
    return body | {k: v for k, v in extras.items() if v is not None}


GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "kvmesh_replica_requests_running": "running",
    "kvmesh_replica_requests_waiting": "waiting",
    "kvmesh_replica_kv_usage_ratio": "kv_usage",
}
"""The load gauges read from a worker's ``/metrics`` page, by metric name."""
_GAUGE_PREFIXES = tuple(GAUGES)


def prometheus_gauges(text: str) -> dict[str, float]:
    """A worker's load gauges from its ``/metrics`` page (vLLM's, SGLang's or ``kvmesh engine``'s names), summed
    over label sets: running and waiting requests, KV usage (0-1)."""
    # Parse only the wanted families' lines: an engine's page is mostly histograms, which cost the router more
    # to parse than everything else it does per worker.
    lines = [line for line in text.splitlines() if _metric_name(line).startswith(_GAUGE_PREFIXES)]
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            key = GAUGES.get(family.name)
            if key is not None:
                out[key] = sum(sample.value for sample in family.samples)
    except ValueError:  # not a Prometheus page: no gauges
        return {}
    return out


def _metric_name(line: str) -> str:
    """The metric a line of a Prometheus page is about (its sample's, or its ``# HELP``/``# TYPE`` comment's)."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 else ""
    return line


def _worker_error(status: int, text: str) -> Exception:
    """The worker's refusal as the ingress reports engine errors: 4xx as the client's (400), else a failure."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:500]
    if 400 <= status < 500:
        return InvalidRequest(f"worker refused the request: {message}", "prompt")
    return RequestFailed(f"worker answered {status}: {message}")


class Worker:
    """One worker's connection, cache view and load. ``on_changes`` hears every change to its cache view (the
    index publisher of a Ray proxy); call ``start`` on a running event loop, ``close`` at the end."""

    def __init__(
        self,
        spec: WorkerSpec,
        model: str,
        served_name: str,
        block_size: int,
        on_changes: Callable[[list[IndexEvent]], None] | None = None,
        load_period_s: float = METRICS_PERIOD_S,
    ) -> None:
        if load_period_s <= 0:
            raise ValueError(f"load_period_s must be > 0, got {load_period_s}")
        self.load_period_s = load_period_s
        self.spec = spec
        self.model = spec.model or served_name
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        self.headers = headers
        self.session: aiohttp.ClientSession | None = None
        """Opened by ``start``, on the event loop that uses it."""
        self.blocks = WorkerBlocks(model_seed(model), block_size)
        self.on_changes = on_changes
        self.in_flight = 0
        self.down = False
        self.gauges: dict[str, float] = {}
        self.report: LoadReport | None = None
        """The worker's newest ``LoadReport``: from its last ``GET /load`` or the last response that carried one
        (``kvmesh engine`` sends both; None: not offered, or not yet read)."""
        self.report_received = -math.inf
        """When (``time.monotonic``) a report last came: the periodic read waits ``load_period_s`` from it."""
        self._offers_load = True
        self.served: frozenset[str] | None = None
        """The LoRA adapters the worker lists in ``/v1/models`` (None: not read yet)."""
        self.ready: ReadyAdapters | None = None
        """The adapters in a vLLM worker's batch slots, from its ``/metrics`` (None: it publishes none)."""
        self.prompt_tokens = self.cached_tokens = 0
        self.subscriber: KVEventSubscriber | None = None
        self._poller: asyncio.Task | None = None

    def start(self) -> Worker:
        """Open the HTTP session, follow the worker's events and read its load; on a running event loop."""
        self.open_session()
        if self.spec.kv_events:
            self.subscriber = KVEventSubscriber(
                self.spec.kv_events, self.spec.replay, self._on_batch, self.forget, self.spec.topic, self.spec.url
            ).start()
        self._poller = asyncio.get_running_loop().create_task(self._poll_metrics())
        return self

    def open_session(self) -> None:
        """The HTTP session to the worker (``start`` opens it), on the running event loop."""
        # No connection limit: the router's admission bounds what is in flight, and a pool limit would queue
        # requests inside the client, unseen by the policy. Idle connections are dropped before uvicorn's 5 s
        # keep-alive (vLLM, SGLang and kvmesh engines all serve with it) closes them under a request.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        self.session = aiohttp.ClientSession(
            headers=self.headers, connector=connector, timeout=STREAM_TIMEOUT, read_bufsize=READ_BUFSIZE
        )

    def close(self) -> None:
        """Stop following events and polling; the session closes on the running loop if there is one (else its
        sockets go with the process)."""
        if self.subscriber is not None:
            self.subscriber.close()
        if self._poller is not None:
            self._poller.cancel()
        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().create_task(session.close())

    async def aclose(self) -> None:
        """``close``, the session closed before it returns."""
        session = self.session
        self.close()
        if session is not None:
            await session.close()

    async def get(self, path: str, timeout_s: float = POLL_TIMEOUT_S) -> tuple[int, str]:
        """The worker's answer to ``GET path`` (status, body) within ``timeout_s``; ``OSError`` if none came."""
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.session.get(self.spec.url + path, timeout=timeout) as response:
                return response.status, await response.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise OSError(f"worker {self.spec.url}{path}: {exc!r}") from exc

    def _on_batch(self, batch: EventBatch) -> None:
        changes = self.blocks.apply(batch)
        if self.on_changes is not None and changes:
            self.on_changes(changes)

    def forget(self) -> None:
        """Drop the cache view (the worker restarted or stopped answering)."""
        changes = self.blocks.clear()
        if self.on_changes is not None:
            self.on_changes(changes)

    async def generate(self, call: GenerateCall, replica: str) -> AsyncIterator[GenerateChunk]:
        """Stream the worker's answer to ``call`` as kvmesh chunks naming ``replica``; the last carries ``Usage``."""
        body = completion_body(call, self.model)
        if self.down:
            raise RequestFailed(f"worker {self.spec.url} does not answer")
        self.in_flight += 1
        try:
            async with self.session.post(self.spec.url + "/v1/completions", json=body) as response:
                if response.status != 200:
                    raise _worker_error(response.status, await response.text(errors="replace"))
                if (header := response.headers.get(LOAD_HEADER)) is not None:
                    self._take_report(header)
                async for chunk in self._chunks(response.content, call, replica):
                    yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RequestFailed(f"worker {self.spec.url} failed: {exc!r}") from exc
        finally:
            self.in_flight -= 1

    async def _chunks(
        self, lines: aiohttp.StreamReader, call: GenerateCall, replica: str
    ) -> AsyncIterator[GenerateChunk]:
        """The worker's server-sent events (one ``data:`` line each) as kvmesh chunks; the last carries usage."""
        usage = None
        async for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            try:
                event = json.loads(data)
            except ValueError:  # e.g. the worker died in the middle of writing it
                raise RequestFailed(f"worker {self.spec.url} sent a malformed event: {data[:200]!r}") from None
            if "error" in event:
                raise RequestFailed(f"worker {self.spec.url}: {event['error'].get('message', event['error'])}")
            for choice in event.get("choices") or []:
                # Workers that do not return ids (only vLLM does, on request) count one token per text chunk.
                ids = choice.get("token_ids") or ([0] if choice.get("text") else [])
                yield GenerateChunk(
                    index=choice.get("index", 0),
                    text=choice.get("text") or "",
                    token_ids=list(ids),
                    finish_reason=choice.get("finish_reason"),
                    num_cached_tokens=0,
                    replica=replica,
                )
            if event.get("usage"):
                usage = event["usage"]
        if usage is None:
            raise RequestFailed(f"worker {self.spec.url} ended the stream without usage")
        cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
        self.prompt_tokens += usage.get("prompt_tokens", call.num_tokens)
        self.cached_tokens += cached
        yield GenerateChunk(
            index=0,
            text="",
            token_ids=[],
            finish_reason=None,
            num_cached_tokens=cached,
            replica=replica,
            usage=Usage(
                prompt_tokens=usage.get("prompt_tokens", call.num_tokens),
                completion_tokens=usage.get("completion_tokens", 0),
                cached_tokens=cached,
            ),
        )

    async def _poll_metrics(self) -> None:
        """Read the worker's load once no report came for ``load_period_s`` (a ``kvmesh engine`` sends one with
        each response); after ``DOWN_AFTER_S`` of unanswered reads (two at least) it is down: its cache view goes
        at once and routers rank it last, until it answers again (its cache is then rebuilt from its events)."""
        down_after = max(2, math.ceil(DOWN_AFTER_S / self.load_period_s))
        models_every = max(1, round(MODELS_PERIOD_S / self.load_period_s))
        failures, polls = 0, 0
        while True:
            age = time.monotonic() - self.report_received
            answered = age < self.load_period_s or await self._read_load()  # a response just brought a report
            if answered and polls % models_every == 0:
                await self._read_models()
            polls += 1
            failures = 0 if answered else failures + 1
            if failures == down_after:
                log.warning("worker %s stopped answering: its index entries are removed", self.spec.url)
                self.down = True
                self.forget()
            elif answered and self.down:
                log.warning("worker %s answers again: rebuilding its cache from its events", self.spec.url)
                self.down = False
                if self.subscriber is not None:
                    self.subscriber.request_rebuild()
            await asyncio.sleep(self.load_period_s - age if age < self.load_period_s else self.load_period_s)

    async def _read_load(self) -> bool:
        """Whether the worker answered a read of its load: its ``LoadReport`` (``GET /load``, a ``kvmesh engine``'s,
        gauges included), else its ``/metrics`` gauges. A worker without a readable ``/load`` (404: vLLM,
        SGLang) is read from ``/metrics`` from then on."""
        try:
            if self._offers_load:
                status, text = await self.get("/load")
                if status == 200 and self._take_report(text):
                    return True
                if status not in (200, 404):
                    return status < 500
                self._offers_load = False
            status, text = await self.get("/metrics")
        except OSError:
            return False  # the last figures stand until the worker counts as down
        if status == 200:
            self.gauges = prometheus_gauges(text)
            self.ready = ready_adapters(text)
        return status < 500

    async def _read_models(self) -> None:
        """The adapters the worker serves, from its ``/v1/models`` (kept as they were if it does not answer)."""
        with contextlib.suppress(OSError):
            status, text = await self.get("/v1/models")
            if status == 200 and (served := served_adapters(text)) is not None:
                self.served = served

    def serves(self, adapter: str) -> bool:
        """Whether the worker lists ``adapter`` (True until its list is read)."""
        return self.served is None or adapter in self.served

    def _take_report(self, text: str) -> bool:
        """Whether ``text`` held a ``LoadReport`` (a ``/load`` answer's, or a response's ``LOAD_HEADER``); the
        newest report the worker took is kept, with its receipt time."""
        report = self._report_in(text)
        if report is None:
            return False
        self.report_received = time.monotonic()
        if self.report is None or report.reported_at >= self.report.reported_at:
            self.report = report
            self.gauges = dict(running=report.num_running, waiting=report.num_waiting, kv_usage=report.kv_usage)
        return True

    def _report_in(self, text: str) -> LoadReport | None:
        """The ``LoadReport`` a ``/load`` answer holds; None (with a log line) if it holds none."""
        try:
            report = LoadReport.from_dict(json.loads(text), sender=f"worker {self.spec.url}")
        except ValueError:  # not JSON
            report = None
        if report is None:
            log.warning("worker %s: unreadable /load; reading its /metrics instead", self.spec.url)
        return report

    def measured(self) -> dict:
        """The worker's measured speed and capacity (``MEASURED_FIELDS`` of its last report; without one, the
        adapters a vLLM worker has ready, if it says)."""
        report = self.report
        if report is not None:
            return {name: getattr(report, name) for name in MEASURED_FIELDS}
        ready = self.ready
        return {} if ready is None else {"loras": ready.names, "lora_slots": ready.slots}

    def status(self, node: str = "") -> ReplicaStatus:
        """What ``kvmesh status`` shows of the worker: its gauges, the prefix hits of what this proxy sent and
        how its KV-event stream is followed."""
        events = {}
        if (sub := self.subscriber) is not None:
            stats = sub.stats
            events = dict(
                kv_event_batches=stats["batches"],
                kv_event_gaps=stats["gaps"],
                kv_event_batches_lost=stats["lost"],
                kv_event_restarts=stats["restarts"],
                kv_event_lag_s=sub.lag_s,
            )
        return ReplicaStatus(
            node=node,
            num_running=max(self.in_flight, int(self.gauges.get("running", 0))),
            num_waiting=int(self.gauges.get("waiting", 0)),
            kv_usage=self.gauges.get("kv_usage", 0.0),
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_tokens,
            index_entries=len(self.blocks.snapshot()),
            **events,
        )
