"""The OpenAI-compatible HTTP API: the FastAPI app, its error format, and the routes of the ingress.

Errors found before the first token are answered with a status (400, 404, 429, 503) in OpenAI's error
object, Starlette's own (unknown path, wrong method) and FastAPI's validation errors included; once a
stream has started, a failure ends it with an error event. Admission (``cluster/ingress/admission.py``) refuses
unauthenticated, oversized and over-capacity requests before any of this work. A client that hangs up
cancels the engine request, which frees its blocks.

This module has no ``from __future__ import annotations``: FastAPI must see the request models' real
classes on the methods that Ray Serve rebinds, or it takes the bodies for query parameters.
"""

import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.cluster.ingress.admission import TENANT_STATE, Admission, AdmissionMiddleware
from kvmesh.cluster.ingress.generation import Generation, Prepared, gather
from kvmesh.cluster.monitoring import metrics
from kvmesh.cluster.protocol.api_errors import APIError
from kvmesh.cluster.protocol.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
)
from kvmesh.cluster.protocol.openai_responses import ResponseShape, usage_dict
from kvmesh.cluster.protocol.tool_calls import ToolReplies, check_tools
from kvmesh.core.messages import (
    ClusterStatus,
    GenerateChunk,
    IndexCutOff,
    IndexSize,
    ReplicaStatus,
    RoutingCount,
    TokenLogprob,
)
from kvmesh.router import metrics as router_metrics
from kvmesh.router.metrics import decision_counts
from kvmesh.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

app = FastAPI(title="kvmesh", description="OpenAI-compatible API of a kvmesh cluster", version="1")
"""``/docs``, ``/redoc`` and ``/openapi.json`` exist but answer 404 unless ``enable_docs`` (the middleware)."""

_admission: Admission | None = None
"""This process's ingress limits, set by the ingress when it starts (one ingress per replica process)."""


def current_admission() -> Admission | None:
    """The limits the middleware applies. A named module function, not a lambda: Ray ships ``app`` to the
    replica by value, and a lambda would carry a copy of this module's globals, blind to ``set_admission``."""
    return _admission


def set_admission(admission: Admission) -> None:
    global _admission
    _admission = admission


app.add_middleware(AdmissionMiddleware, admission=current_admission)


def _tenant(raw: Request) -> str:
    """The caller's tenant, as the admission middleware identified it from its API key."""
    return getattr(raw.state, TENANT_STATE, "")


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) in OpenAI's error format too."""
    error = APIError(str(exc.detail), exc.status_code, code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
    return JSONResponse(APIError(message, param=".".join(loc) or None).body(), status_code=400)


async def _prepend(first: GenerateChunk, rest: AsyncIterator[GenerateChunk]) -> AsyncIterator[GenerateChunk]:
    yield first
    async for chunk in rest:
        yield chunk


async def _echoed(chunks: AsyncIterator[GenerateChunk], text: str, ids: list[int]) -> AsyncIterator[GenerateChunk]:
    """Completions' ``echo``: each choice's first chunk starts with the prompt's text and, when the request
    asked for log-probabilities, the prompt's (its first token has none: nothing before it scores it)."""
    started: set[int] = set()
    try:
        async for chunk in chunks:
            if chunk.index not in started:
                started.add(chunk.index)
                chunk.text = text + chunk.text
                if chunk.logprobs is not None:
                    prompt = [TokenLogprob(token_id=ids[0], logprob=None), *(chunk.prompt_logprobs or [])]
                    chunk.logprobs = prompt + chunk.logprobs
            yield chunk
    finally:
        await chunks.aclose()  # a client that left cancels the engine request now


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _sse(
    shape: ResponseShape,
    first: GenerateChunk,
    chunks: AsyncIterator[GenerateChunk],
    include_usage: bool,
    tools: ToolReplies | None = None,
):
    """Server-sent events of a streamed response, OpenAI's shape; the request's last chunk ends it. With
    ``tools``, each choice's text is parsed as it streams: content deltas, then ``tool_calls`` deltas."""
    try:
        if shape.chat:  # each choice opens with the assistant role, as OpenAI streams it
            for index in range(shape.n):
                yield _event(shape.chunk("", first=True, index=index))
        chunk = first
        offsets = [0] * shape.n  # characters streamed per choice: completions' text_offset
        while True:
            if chunk.text or chunk.finish_reason or chunk.logprobs:
                i = chunk.index
                text, reason, calls = chunk.text, chunk.finish_reason, None
                if tools is not None:
                    text, calls, reason = tools.feed(i, text, reason)
                yield _event(
                    shape.chunk(text, reason, index=i, logprobs=chunk.logprobs, offset=offsets[i], tool_calls=calls)
                )
                offsets[i] += len(chunk.text)
            if chunk.usage is not None:  # the request's last chunk: every choice has finished
                if include_usage:
                    yield _event(shape.usage_chunk(usage_dict(chunk.usage)))
                break
            chunk = await anext(chunks)
    except APIError as exc:  # headers are sent: report the failure in the stream, as OpenAI does
        yield _event(exc.body())
    finally:
        await chunks.aclose()  # a client that left cancels the engine request now, not at GC time
    yield "data: [DONE]\n\n"


class HttpApi:
    """The ingress's HTTP routes (mixed into ``kvmesh.cluster.ingress.deployment.Ingress``, which Ray Serve serves
    ``app`` with)."""

    generation: Generation
    index: PrefixIndex | None
    settings: object

    async def _respond(
        self,
        prep: Prepared,
        stream: bool,
        include_usage: bool,
        tools: ToolReplies | None = None,
        echo: str | None = None,
    ) -> Response:
        """The response to a prepared request; ``echo``: the prompt's text, to start each choice with."""
        shape = ResponseShape(
            prep.call.request_id,
            chat=prep.chat,
            model=prep.call.lora_name or self.generation.limits.served_name,
            n=prep.params.n,
            token_text=self.generation.token_text,
        )
        chunks = self.generation.stream(prep)
        if echo is not None:
            chunks = _echoed(chunks, echo, prep.call.prompt_token_ids)
        try:
            first = await anext(chunks)  # errors before the first token get a real status code
        except StopAsyncIteration:
            raise APIError("the engine ended the request without output", status=500) from None
        headers = {"x-kvmesh-replica": first.replica, **self._load_headers()}  # x-kvmesh-replica: for debugging
        if not stream:
            texts, reasons, last, logprobs = await gather(shape.n, _prepend(first, chunks))
            calls = None
            if tools is not None:
                texts, calls, reasons = tools.whole(texts, reasons)
            body = shape.whole(texts, reasons, usage_dict(last.usage), logprobs, calls)
            return JSONResponse(body, headers=headers)
        return StreamingResponse(
            _sse(shape, first, chunks, include_usage, tools), media_type="text/event-stream", headers=headers
        )

    def _load_headers(self) -> dict[str, str]:
        """Headers a generation's response carries about this server's load (none here)."""
        return {}

    async def _prepare_chat(self, body: ChatCompletionRequest, tenant: str) -> tuple[Prepared, ToolReplies | None]:
        """The chat prepared for the engine, and the parser of its replies when it offers tools."""
        tools = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
        params = body.check(tools.forced_schema() if tools else None)
        messages, offered = self.generation.with_tools([m.render() for m in body.messages], tools)
        prep = await self.generation.prepare(
            body.model,
            None,
            messages,
            params,
            "chat",
            tenant,
            body.cache_salt,
            body.session_id or body.user,
            tools=offered,
        )
        return prep, ToolReplies(tools, self.generation.tool_syntax, params.n) if tools else None

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        prep, replies = await self._prepare_chat(body, _tenant(raw))
        return await self._respond(prep, body.stream, body.include_usage, replies)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        params = body.check()
        prompt = body.single_prompt()
        prep = await self.generation.prepare(
            body.model, prompt, None, params, "completions", _tenant(raw), body.cache_salt, body.session_id or body.user
        )
        echo = None
        if body.echo:
            echo = prompt if isinstance(prompt, str) else self.generation.tokenizer.decode(prompt)
        return await self._respond(prep, body.stream, body.include_usage, echo=echo)

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's shape: the ids a generation of this prompt would start from, their count, the context."""
        self.generation.check_model(body.model)
        messages, offered = None, None
        if body.messages is not None:
            tools = check_tools(body.tools, None)
            messages, offered = self.generation.with_tools([m.render() for m in body.messages], tools)
        ids = await self.generation.token_ids(body.prompt, messages, body.add_special_tokens, offered)
        strs = self.generation.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.generation.limits.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.generation.check_model(body.model)
        return {"prompt": self.generation.detokenize(body.tokens)}

    @app.get("/v1/models")
    async def models(self) -> dict:
        limits = self.generation.limits
        card = {
            "id": limits.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvmesh",
            "root": self.settings.model,
            "max_model_len": limits.max_model_len,
        }
        adapters = [
            card | {"id": name, "root": path, "parent": limits.served_name}
            for name, path in self.generation.adapters.items()
        ]
        return {"object": "list", "data": [card, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoRARequest) -> JSONResponse:
        """vLLM's route: serve the PEFT adapter at ``lora_path`` (under a LoRA root) as model ``lora_name``; 400
        with the reason if it cannot be served (the engines serve on unchanged)."""
        name, path = body.lora_name, self._lora_path(body.lora_path)
        if name in self.generation.limits.names or name in self.generation.adapters:
            raise APIError(f"the model {name!r} is already served: unload it first", param="lora_name")
        reason = await self._load_adapter(name, path)
        if reason is not None:
            raise APIError(reason, param="lora_path")
        self.generation.adapters[name] = path
        return JSONResponse({"status": "ok", "lora_name": name})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoRARequest) -> JSONResponse:
        """vLLM's route: stop serving ``lora_name`` (requests running on it finish on it); 404 if no adapter has
        that name."""
        self._lora_path(None)
        if self.generation.adapters.pop(body.lora_name, None) is None:
            raise APIError(f"no LoRA adapter named {body.lora_name!r} is loaded", status=404, param="lora_name")
        await self._unload_adapter(body.lora_name)
        return JSONResponse({"status": "ok", "lora_name": body.lora_name})

    def _lora_path(self, given: str | None) -> str:
        """``given`` resolved, if it lies under a LoRA root; 404 where this server serves no adapters."""
        if not self.settings.enable_lora:
            raise APIError("this server serves no LoRA adapters (start it with --enable-lora)", 404, code="not_found")
        if given is None:
            return ""
        path, roots = Path(given).resolve(), [Path(root).resolve() for root in self.settings.lora_roots]
        if not any(path.is_relative_to(root) for root in roots):
            where = ", ".join(map(str, roots)) or "none: start the server with --lora-root DIR"
            raise APIError(f"lora_path must lie under a --lora-root directory ({where})", param="lora_path")
        return str(path)

    async def _load_adapter(self, name: str, path: str) -> str | None:
        """Read the adapter on an engine (the cluster's ingress: the replica its router picks; the others read it
        on their first request for it); why it cannot be served, or None."""
        return await self.engines.options(method_name="load_lora").remote(name, path)

    async def _unload_adapter(self, name: str) -> None:
        """What the engines do when an adapter stops being served: in a cluster, nothing (no call names it
        any more; its weights leave each replica's memory as other adapters are read)."""

    no_replica_reason = "no live engine replica"

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """``ok``; ``degraded`` (HTTP 503) while this server's routers see no live engine replica, so a load
        balancer's readiness probe turns away from it. Before the first request it cannot know: ``ok``."""
        live = self._live_replicas()
        if live == 0:
            return JSONResponse({"status": "degraded", "reason": self.no_replica_reason}, status_code=503)
        return JSONResponse({"status": "ok", "engine_replicas": live})

    def _live_replicas(self) -> int | None:
        """Engine replicas this process's routers see alive (None: not known yet)."""
        return router_metrics.live_replicas()

    def _decisions(self) -> list[RoutingCount]:
        """This process's routing decisions, by policy and reason."""
        return [RoutingCount(policy=p, reason=r, count=n) for (p, r), n in sorted(decision_counts().items())]

    def _cut_off(self) -> dict[str, IndexCutOff]:
        """Replicas whose load reports say they cannot write to the index."""
        reports = sorted(router_metrics.load_reports(), key=lambda r: r.index_id)
        return {r.index_id: IndexCutOff(node=r.node, error=r.index_error) for r in reports if r.index_error}

    async def _replica_reports(self) -> dict[str, ReplicaStatus]:
        if self.index is None:
            return {}
        try:
            return await self.index.replica_reports()
        except (RedisError, OSError) as exc:
            log.warning("replica reports unavailable: %r", exc)
            return {}

    vllm_metric_names = False
    """Whether ``/metrics`` also shows the engine under vLLM's metric names (a single engine's server)."""

    @app.get("/metrics")
    async def prometheus(self) -> Response:
        name = self.settings.served_model_name if self.vllm_metric_names else None
        return Response(metrics.render(await self._replica_reports(), name), media_type=CONTENT_TYPE_LATEST)

    async def cluster_status(self) -> ClusterStatus:
        """Everything ``kvmesh status`` shows: replicas, routing decisions, index size, Redis health; the same
        for every server (the ingress, ``kvmesh engine``, ``kvmesh router``), which differ only in the hooks."""
        reports = await self._replica_reports()
        return ClusterStatus(
            model=self.generation.limits.served_name,
            policy=self.settings.policy,
            replicas=reports,
            decisions=self._decisions(),
            index=IndexSize(entries=sum(report.index_entries for report in reports.values())),
            live_replicas=self._live_replicas(),
            redis=await self.index.health() if self.index is not None else None,
            index_unreachable=self._cut_off(),
        )

    @app.get("/status")
    async def status(self) -> dict:
        """``ClusterStatus`` as JSON."""
        return (await self.cluster_status()).as_dict()


def _api_routes(routes: list) -> Iterator[APIRoute]:
    """The API routes declared on ``app``, also where Ray Serve's ``serve.ingress`` moved them into a router."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _api_routes(inner.routes)


def bound_app(server: HttpApi, title: str) -> FastAPI:
    """A FastAPI app of ``app``'s routes and error handlers bound to ``server``, admitted by ``server.admission``:
    the front door of a process without Ray Serve (``kvmesh engine``, ``kvmesh router``), several of which may
    share a process (simulated engines)."""
    bound = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    for route in _api_routes(app.routes):
        handler = getattr(server, route.endpoint.__name__)
        bound.add_api_route(route.path, handler, methods=sorted(route.methods), name=route.name)
    bound.exception_handlers.update(app.exception_handlers)
    bound.add_middleware(AdmissionMiddleware, admission=lambda: server.admission)
    return bound
