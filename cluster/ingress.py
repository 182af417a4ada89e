"""The front door: OpenAI-compatible HTTP and kvmesh's gRPC API on one Ray Serve ingress deployment.

The ingress validates a request, renders the chat template, tokenizes ONCE and hashes the prompt's blocks
ONCE, then calls the engine deployment's handle with a dict carrying all of it: the KV-aware router on that
handle (in this process) reads the hashes to pick a replica, and the replica reuses them for its prefix
cache. Errors found before the first token are answered with a proper status (400, 404); once a stream has
started, a failure ends it with an error event. A client that hangs up cancels the engine request, which
frees its blocks. A replica that dies before a request's first token costs nothing: the request is sent
again to another replica. Admission (``cluster/admission.py``) refuses unauthenticated, oversized and
over-capacity requests before any of this work; a full engine queue is a 503 with ``Retry-After``. A request
for ``n`` choices is one engine call whose chunks carry their choice's ``index``; it is done, and its last
chunk carries ``usage``, when all ``n`` have finished.

This module must not import torch (the ingress process stays small): it uses the tokenizer alone. It has
no ``from __future__ import annotations``: FastAPI must see the request models' real classes on the methods
that Ray Serve rebinds, or it takes the bodies for query parameters.
"""

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import metrics
from cluster.admission import RETRY_AFTER_S, TENANT_STATE, Admission, AdmissionMiddleware
from cluster.openai_protocol import (
    CHAT_ROLES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ResponseShape,
    sampling_params,
    usage,
)
from cluster.proto import kvmesh_pb2, kvmesh_pb2_grpc
from replica.errors import InvalidRequest, RequestFailed
from replica.limits import (
    MAX_MESSAGES,
    check_for_model,
    check_prompt_ids,
    check_request_fields,
    prompt_char_limit,
    request_body_limit,
)
from replica.model_files import (
    load_tokenizer,
    max_context,
    max_token_bytes,
    render_chat,
    resolve_model_dir,
    vocab_size,
)
from replica.sampling_params import MAX_N, SamplingParams
from router.hashing import first_block_extra, hash_blocks, model_seed
from router.index_schema import index_redis_url
from router.metrics import decision_counts
from router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

app = FastAPI(title="kvmesh", description="OpenAI-compatible API of a kvmesh cluster", version="1")
"""``/docs``, ``/redoc`` and ``/openapi.json`` exist but answer 404 unless ``enable_docs`` (the middleware)."""

_admission: Admission | None = None
"""This process's ingress limits, set by ``Ingress.__init__`` (one ingress per replica process)."""
app.add_middleware(AdmissionMiddleware, admission=lambda: _admission)

REPLICA_FAILURES = (RayActorError, ActorUnavailableError)
"""What a handle raises when the replica serving a call died or became unreachable."""
SWEEP_PERIOD_S = 1.0
RETRY_ATTEMPTS, RETRY_BACKOFF_S = 3, 0.25
"""A request whose replica dies before its first token is sent up to twice more, after 0.25 s then 0.5 s."""


GRPC_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
TOKENIZE_INLINE_CHARS = 8192
"""Texts shorter than this are tokenized on the event loop (a thread hop costs more than the work)."""


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


async def _prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for chunk in rest:
        yield chunk


async def _gather(n: int, chunks: AsyncIterator[dict]) -> tuple[list[str], list[str | None], dict]:
    """A whole response from a request's chunks: each choice's text and finish reason, and the last chunk
    (it carries ``usage``)."""
    texts: list[str] = [""] * n
    reasons: list[str | None] = [None] * n
    last: dict = {}
    async for chunk in chunks:
        texts[chunk["index"]] += chunk["text"]
        reasons[chunk["index"]] = chunk["finish_reason"] or reasons[chunk["index"]]
        last = chunk
    return texts, reasons, last


@dataclass
class IngressSettings:
    """What the ingress must agree on with the engines (hash seed, block size) and what it serves as."""

    model: str
    """The model id the engines were configured with: it seeds the block hashes."""
    served_model_name: str
    block_size: int
    max_model_len: int | None = None
    max_n: int = MAX_N
    """The most choices a request may ask for: fewer than ``MAX_N`` when a replica runs fewer sequences at once
    (its ``max_num_seqs``), since a request's choices run together on one replica."""
    redis_url: str | None = None
    """The index's Redis; None reads ``$KVMESH_REDIS_URL`` (how ``kvmesh serve`` and Kubernetes pass it, so
    the password never travels in deployment arguments)."""
    deployment: str = "kvmesh"
    policy: str = "kv_aware"
    api_key_digests: list[str] = field(default_factory=list)
    max_inflight_requests: int = 0
    max_request_bytes: int | None = None
    """Largest request body (HTTP and gRPC); None derives it from the context length."""
    grpc_host: str | None = None
    grpc_port: int | None = None
    """Where this ingress serves gRPC itself (``kvmesh serve``); None: not at all (Ray's gRPC proxy may)."""
    share_prefix_cache: bool = False
    """With API keys, each key's requests hash into a prefix cache of their own unless this is set."""
    enable_docs: bool = False


@dataclass
class Prepared:
    """A validated request, tokenized and hashed, ready for the engine."""

    ids: list[int]
    params: SamplingParams
    body: dict
    shape: ResponseShape
    api: str


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: DeploymentHandle, settings: dict) -> None:
        global _admission
        self.settings = IngressSettings(**settings)
        self.engine = engine.options(method_name="generate", stream=True)
        model_dir = resolve_model_dir(self.settings.model, weights=False)  # tokenizer and config only
        self.tokenizer = load_tokenizer(model_dir)
        self.vocab_size = vocab_size(model_dir)
        self.max_model_len = self.settings.max_model_len or max_context(model_dir)
        token_bytes = max_token_bytes(self.tokenizer)
        self.max_prompt_bytes = prompt_char_limit(self.max_model_len, token_bytes)
        body_limit = self.settings.max_request_bytes or request_body_limit(self.max_model_len, token_bytes)
        self.admission = _admission = Admission(
            self.settings.api_key_digests,
            self.settings.max_inflight_requests,
            body_limit,
            on_refused=lambda reason: metrics.REFUSED.labels(reason).inc(),
            enable_docs=self.settings.enable_docs,
        )
        self.seed = model_seed(self.settings.model)
        self.names = {self.settings.served_model_name, self.settings.model}
        redis_url = index_redis_url(self.settings.redis_url)
        self.index = (
            PrefixIndex(redis_url, self.settings.deployment, self.settings.model, timeout_s=1.0) if redis_url else None
        )
        loop = asyncio.get_running_loop()
        self._sweeper = loop.create_task(self._sweep()) if self.index else None
        self._grpc_server = None
        if self.settings.grpc_port:
            self._grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", body_limit)])
            kvmesh_pb2_grpc.add_KVMeshServicer_to_server(self, self._grpc_server)
            address = f"{self.settings.grpc_host or '127.0.0.1'}:{self.settings.grpc_port}"
            if not self._grpc_server.add_insecure_port(address):
                raise RuntimeError(f"gRPC cannot listen on {address}")
            self._grpc_started = loop.create_task(self._grpc_server.start())

    async def _sweep(self) -> None:
        """Purge crashed replicas' index entries once their heartbeat expired, with or without traffic."""
        while True:
            await asyncio.sleep(SWEEP_PERIOD_S)
            try:
                for rid in await self.index.sweep():
                    log.warning("replica %s stopped beating: its index entries were removed", rid)
            except (RedisError, OSError) as exc:  # Redis down: routing already degrades; try next tick
                log.debug("index sweep failed: %r", exc)

    def __del__(self) -> None:
        """Ray Serve calls this when the replica stops: close this ingress's gRPC server (if it runs one)."""
        server = getattr(self, "_grpc_server", None)
        if server is not None:
            with contextlib.suppress(RuntimeError):  # no loop left: the process is exiting, the socket with it
                asyncio.get_running_loop().create_task(server.stop(grace=1.0))

    # ------------------------------------------------------------------ shared by HTTP and gRPC
    def _cache_salt(self, tenant: str, client_salt: str | None) -> str | None:
        """The salt a request's blocks are hashed with: the client's own, keyed by its API key unless the
        operator shares one cache across keys. Tenants then neither share nor can probe each other's cached
        prefixes (``cached_tokens`` would otherwise tell one whether another's prompt is cached)."""
        if not tenant or self.settings.share_prefix_cache:
            return client_salt
        return f"key:{tenant}" + (f"|{client_salt}" if client_salt is not None else "")

    async def _encode(self, text: str, chat: bool) -> list[int]:
        """Token ids of ``text`` (a rendered chat carries its own special tokens); long texts in a worker
        thread (the tokenizer releases the GIL), so other streams on this event loop keep flowing."""
        if len(text) < TOKENIZE_INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=not chat)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=not chat)

    def _too_long(self, param: str) -> APIError:
        return APIError(
            f"This model's maximum context length is {self.max_model_len} tokens; the request's text is longer "
            "than that many tokens could be",
            param=param,
            code="context_length_exceeded",
        )

    async def _prepare(
        self,
        model: str,
        prompt: str | list[int] | None,
        messages: list[dict] | None,
        params: SamplingParams,
        api: str,
        tenant: str,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Prepared:
        """Validate, tokenize and hash one request. Cheap checks come first: nothing is rendered or tokenized
        for a request whose size alone says it cannot fit."""
        if model and model not in self.names:
            raise APIError(
                f"The model `{model}` does not exist; this server serves `{self.settings.served_model_name}`",
                status=404,
                param="model",
                code="model_not_found",
                kind="invalid_request_error",
            )
        try:
            check_request_fields(cache_salt=cache_salt, session_id=session_id)
            check_for_model(params, self.vocab_size)
        except InvalidRequest as exc:
            raise APIError(str(exc), param=exc.param) from exc
        if params.n > self.settings.max_n:
            raise APIError(
                f"n must be at most {self.settings.max_n} on this server (a replica's choices run at "
                f"once), got {params.n}",
                param="n",
            )
        param = "messages" if messages is not None else "prompt"
        if messages is not None:
            if len(messages) > MAX_MESSAGES:
                raise APIError(f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}", param=param)
            if sum(len(m["content"]) for m in messages) > self.max_prompt_bytes:
                raise self._too_long(param)
            try:
                text = render_chat(self.tokenizer, messages)
            except TemplateError as exc:  # e.g. roles that do not alternate, for templates that insist
                raise APIError(f"messages: {exc}", param=param) from exc
            ids = await self._encode(text, chat=True)
        elif isinstance(prompt, str):
            if len(prompt) > self.max_prompt_bytes:
                raise self._too_long(param)
            ids = await self._encode(prompt, chat=False)
        else:
            ids = list(prompt or [])
            if len(ids) > self.max_model_len:
                raise self._too_long(param)
            try:
                check_prompt_ids(ids, self.vocab_size)
            except InvalidRequest as exc:
                raise APIError(str(exc), param=param) from exc
        if not ids:
            raise APIError("prompt is empty", param=param)
        wanted = len(ids) + (params.max_tokens or 1)
        if wanted > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens; the request needs "
                f"{wanted} ({len(ids)} prompt + {params.max_tokens or 1} completion)",
                param=param,
                code="context_length_exceeded",
            )
        size = self.settings.block_size
        salt = self._cache_salt(tenant, cache_salt)
        hashes = hash_blocks(ids, size, self.seed, first_block_extra(salt))
        shape = ResponseShape(chat=messages is not None, model=self.settings.served_model_name, n=params.n)
        body = {
            "request_id": shape.id,
            "prompt_token_ids": ids,
            "block_hashes": hashes,
            "num_tokens": len(ids),
            "block_size": size,
            "session_id": session_id,
            "cache_salt": salt,
            "params": params.__dict__,
        }
        return Prepared(ids, params, body, shape, api)

    async def _run(self, prep: Prepared) -> AsyncIterator[dict]:
        """Engine chunks of one request (of its ``n`` choices, interleaved), with its metrics recorded; the
        last one, when every choice has finished, carries ``usage`` (completion tokens summed over choices).

        Engine-side validation errors surface as ``APIError`` before anything is yielded. A replica that
        fails before the first token is sent again (up to twice, with a short back-off for routers to drop it);
        after the first token the stream ends with an error naming the cause."""
        model = self.settings.served_model_name
        t0 = time.perf_counter()
        last, n_out, outcome, cached, unfinished = t0, 0, "error", 0, prep.params.n
        last_of_choice: dict[int, float] = {}  # inter-token latency is measured within each choice
        stream = None
        try:
            for attempt in range(1, RETRY_ATTEMPTS + 1):
                # Each attempt is a new engine request: a replica still running the first must not see the
                # same id again, and the first is cancelled before the retry goes out.
                body = prep.body if attempt == 1 else {**prep.body, "request_id": f"{prep.shape.id}-{attempt}"}
                stream = self.engine.remote(body)
                try:
                    async for chunk in stream:
                        now, previous = time.perf_counter(), last_of_choice.get(chunk["index"])
                        if n_out == 0:
                            metrics.TTFT.labels(model).observe(now - t0)
                        elif chunk["token_ids"] and previous is not None:
                            metrics.INTER_TOKEN.labels(model).observe((now - previous) / len(chunk["token_ids"]))
                        last = last_of_choice[chunk["index"]] = now
                        n_out += len(chunk["token_ids"])
                        cached = chunk["num_cached_tokens"]
                        unfinished -= chunk["finish_reason"] is not None
                        if not unfinished:
                            outcome = "ok"
                            chunk["usage"] = usage(len(prep.ids), n_out, cached)
                        yield chunk
                    break
                except REPLICA_FAILURES as exc:
                    if n_out or attempt == RETRY_ATTEMPTS:
                        raise
                    stream.cancel()
                    metrics.RETRIES.labels(model).inc()
                    log.warning(
                        "request %s: its replica failed before the first token (%r); retrying", prep.shape.id, exc
                    )
                    # Routers learn of a death through Serve's long poll; until then a retry may be offered
                    # the same dead replica, so back off a little before each new attempt.
                    await asyncio.sleep(RETRY_BACKOFF_S * attempt)
        except BackPressureError as exc:
            outcome = "rejected"
            raise APIError(
                "Every replica is busy and the queue is full; retry shortly",
                503,
                code="overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from exc
        except ValueError as exc:  # the engine refused the request (e.g. longer than its KV pool)
            outcome = "client_error"
            cause = getattr(exc, "cause", None) or exc  # Ray wraps the replica's exception
            raise APIError(str(cause), param=getattr(cause, "param", None) or "prompt") from exc
        except REPLICA_FAILURES as exc:
            log.warning("request %s: its replica failed after %d tokens: %r", prep.shape.id, n_out, exc)
            raise APIError(
                f"The replica serving this request failed ({type(exc).__name__}) after {n_out} tokens;"
                " retry the request",
                503,
                code="replica_failed",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from exc
        except Exception as exc:  # the engine failed: the client gets a clean 500, not a traceback
            stream.cancel()
            cause = getattr(exc, "cause", None) or exc
            log.warning("request %s failed in the engine: %r", prep.shape.id, cause)
            # A request the engine failed alone says why (its own data broke a step); anything else only
            # names the exception's type.
            detail = str(cause) if isinstance(cause, RequestFailed) else type(cause).__name__
            raise APIError(f"generation failed: {detail}", 500, code="generation_failed") from exc
        except BaseException:
            outcome = "aborted" if outcome == "error" and n_out else outcome
            if stream is not None:
                stream.cancel()  # the client left or the caller failed: free the engine's blocks now
            raise
        finally:
            metrics.REQUESTS.labels(model, prep.api, outcome).inc()
            if outcome == "ok":
                metrics.E2E.labels(model).observe(last - t0)
                metrics.PROMPT_TOKENS.labels(model).inc(len(prep.ids))
                metrics.CACHED_TOKENS.labels(model).inc(cached)
                metrics.GENERATED_TOKENS.labels(model).inc(n_out)

    async def _respond(self, prep: Prepared, stream: bool, include_usage: bool) -> Response:
        chunks = self._run(prep)
        try:
            first = await anext(chunks)  # errors before the first token get a real status code
        except StopAsyncIteration:
            raise APIError("the engine ended the request without output", status=500) from None
        headers = {"x-kvmesh-replica": first["replica"]}  # which replica served it: for debugging and tests
        if not stream:
            texts, reasons, last = await _gather(prep.shape.n, _prepend(first, chunks))
            return JSONResponse(prep.shape.whole(texts, reasons, last["usage"]), headers=headers)
        return StreamingResponse(
            self._sse(prep.shape, first, chunks, include_usage), media_type="text/event-stream", headers=headers
        )

    @staticmethod
    async def _sse(shape: ResponseShape, first: dict, chunks: AsyncIterator[dict], include_usage: bool):
        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        try:
            if shape.chat:  # each choice opens with the assistant role, as OpenAI streams it
                for index in range(shape.n):
                    yield event(shape.chunk("", first=True, index=index))
            chunk = first
            while True:
                if chunk["text"] or chunk["finish_reason"]:
                    yield event(shape.chunk(chunk["text"], chunk["finish_reason"], index=chunk["index"]))
                if "usage" in chunk:  # the request's last chunk: every choice has finished
                    if include_usage:
                        yield event(shape.usage_chunk(chunk["usage"]))
                    break
                chunk = await anext(chunks)
        except APIError as exc:  # headers are sent: report the failure in the stream, as OpenAI does
            yield event(exc.body())
        finally:
            await chunks.aclose()  # a client that left cancels the engine request now, not at GC time
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ OpenAI HTTP
    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        params = body.check()
        messages = [m.render() for m in body.messages]
        prep = await self._prepare(
            body.model, None, messages, params, "chat", _tenant(raw), body.cache_salt, body.session_id or body.user
        )
        return await self._respond(prep, body.stream, body.include_usage)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        params = body.check()
        prep = await self._prepare(
            body.model,
            body.single_prompt(),
            None,
            params,
            "completions",
            _tenant(raw),
            body.cache_salt,
            body.session_id or body.user,
        )
        return await self._respond(prep, body.stream, body.include_usage)

    @app.get("/v1/models")
    async def models(self) -> dict:
        card = {
            "id": self.settings.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "kvmesh",
            "root": self.settings.model,
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    async def _replica_reports(self) -> dict[str, dict]:
        if self.index is None:
            return {}
        try:
            return await self.index.replica_reports()
        except (RedisError, OSError) as exc:
            log.warning("replica reports unavailable: %r", exc)
            return {}

    @app.get("/metrics")
    async def prometheus(self) -> Response:
        return Response(metrics.render(await self._replica_reports()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status(self) -> dict:
        """Everything ``kvmesh status`` shows: replicas, routing decisions, index size, Redis health."""
        reports = await self._replica_reports()
        redis_health = await self.index.health() if self.index else {"ok": False, "error": "no Redis configured"}
        return {
            "model": self.settings.served_model_name,
            "policy": self.settings.policy,
            "replicas": reports,
            "decisions": [{"policy": p, "reason": r, "count": n} for (p, r), n in sorted(decision_counts().items())],
            "index": {"entries": sum(int(r.get("index_entries") or 0) for r in reports.values())},
            "redis": redis_health,
        }

    # ------------------------------------------------------------------ gRPC (see cluster/proto/kvmesh.proto)
    async def _grpc_prepare(self, request: kvmesh_pb2.GenerateRequest, tenant: str) -> Prepared:
        optional = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n")
        params = sampling_params(
            **{f: getattr(request, f) for f in optional if request.HasField(f)}, stop=list(request.stop)
        )
        if len(request.messages) > MAX_MESSAGES:
            raise APIError(f"messages: at most {MAX_MESSAGES} messages, got {len(request.messages)}", param="messages")
        messages = [{"role": m.role, "content": m.content} for m in request.messages] or None
        if messages and any(m["role"] not in CHAT_ROLES for m in messages):
            raise APIError(f"messages: role must be one of {', '.join(CHAT_ROLES)}", param="messages")
        return await self._prepare(
            request.model,
            request.prompt,
            messages,
            params,
            "grpc",
            tenant,
            request.cache_salt or None,
            request.session_id or None,
        )

    def _grpc_admit(self, grpc_context) -> str:
        """gRPC's admission: the same API keys (``authorization`` metadata) and in-flight limit as HTTP;
        returns the caller's tenant."""
        metadata = {k.lower(): v for k, v in (grpc_context.invocation_metadata() or ())}
        tenant = self.admission.keys.tenant(metadata.get("authorization"))
        if tenant is None:
            metrics.REFUSED.labels("unauthenticated").inc()
            raise APIError(
                "Invalid or missing API key (metadata authorization: Bearer <key>)", 401, code="invalid_api_key"
            )
        if not self.admission.inflight.acquire():
            metrics.REFUSED.labels("over_capacity").inc()
            raise APIError("The server is at capacity; retry shortly", 429, code="rate_limit_exceeded")
        return tenant

    @staticmethod
    async def _grpc_fail(grpc_context, exc: APIError) -> NoReturn:
        """End the call with the status matching ``exc`` and details naming its parameter: ``abort`` on this
        ingress's own gRPC server; Ray's proxy context has no abort and reads the code and details set on it
        when the handler raises."""
        code = GRPC_STATUS.get(exc.status, grpc.StatusCode.INTERNAL)
        details = exc.message if not exc.param or exc.message.startswith(exc.param) else f"{exc.param}: {exc.message}"
        if hasattr(grpc_context, "abort"):
            await grpc_context.abort(code, details)
        grpc_context.set_code(code)
        grpc_context.set_details(details)
        raise exc

    @staticmethod
    def _grpc_usage(chunk: dict) -> kvmesh_pb2.Usage:
        u = chunk["usage"]
        return kvmesh_pb2.Usage(
            prompt_tokens=u["prompt_tokens"],
            completion_tokens=u["completion_tokens"],
            cached_tokens=u["prompt_tokens_details"]["cached_tokens"],
        )

    async def Generate(self, request: kvmesh_pb2.GenerateRequest, grpc_context) -> AsyncIterator:
        try:
            tenant = self._grpc_admit(grpc_context)
        except APIError as exc:
            await self._grpc_fail(grpc_context, exc)
        try:
            async for chunk in self._run(await self._grpc_prepare(request, tenant)):
                yield kvmesh_pb2.GenerateChunk(
                    text=chunk["text"],
                    finish_reason=chunk["finish_reason"] or "",
                    usage=self._grpc_usage(chunk) if "usage" in chunk else None,
                    index=chunk["index"],
                )
        except APIError as exc:
            await self._grpc_fail(grpc_context, exc)
        finally:
            self.admission.inflight.release()

    async def Complete(self, request: kvmesh_pb2.GenerateRequest, grpc_context) -> kvmesh_pb2.Completion:
        try:
            tenant = self._grpc_admit(grpc_context)
        except APIError as exc:
            await self._grpc_fail(grpc_context, exc)
        try:
            prep = await self._grpc_prepare(request, tenant)
            texts, reasons, last = await _gather(prep.shape.n, self._run(prep))
        except APIError as exc:
            await self._grpc_fail(grpc_context, exc)
        finally:
            self.admission.inflight.release()
        choices = [
            kvmesh_pb2.Choice(index=i, text=t, finish_reason=r)
            for i, (t, r) in enumerate(zip(texts, reasons, strict=True))
        ]
        return kvmesh_pb2.Completion(
            id=prep.shape.id, text=texts[0], finish_reason=reasons[0], usage=self._grpc_usage(last), choices=choices
        )
