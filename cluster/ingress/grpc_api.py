"""kvmesh's gRPC API (``cluster/ingress/proto/kvmesh.proto``, service ``kvmesh.KVMesh``) on the ingress.

The same generations as HTTP, with HTTP's API keys (``authorization`` metadata), in-flight limit and body
limit. Under ``kvmesh serve`` the ingress serves it itself on ``--host`` (``serve_grpc``); under a Ray
Serve config file Ray's gRPC proxy calls the same methods. Errors become gRPC status codes whose details
start with the offending field.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import NoReturn

import grpc

from kvmesh.cluster.ingress.admission import Admission
from kvmesh.cluster.ingress.generation import Generation, Prepared, gather
from kvmesh.cluster.ingress.proto import kvmesh_pb2, kvmesh_pb2_grpc
from kvmesh.cluster.monitoring import metrics
from kvmesh.cluster.protocol.api_errors import APIError
from kvmesh.cluster.protocol.api_params import sampling_params
from kvmesh.cluster.protocol.chat_messages import HistoryToolCall, template_message
from kvmesh.cluster.protocol.tool_calls import ToolReplies, ToolRequest, check_tools
from kvmesh.core.limits import MAX_MESSAGES
from kvmesh.core.messages import TokenLogprob, Usage

GRPC_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def serve_grpc(servicer: GrpcApi, host: str, port: int, max_message_bytes: int) -> grpc.aio.Server:
    """A gRPC server for ``servicer`` on ``host:port`` (not started), refusing messages over the limit
    before anything reads them."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes)])
    kvmesh_pb2_grpc.add_KVMeshServicer_to_server(servicer, server)
    address = f"{host}:{port}"
    if not server.add_insecure_port(address):
        raise RuntimeError(f"gRPC cannot listen on {address}")
    return server


def _usage(u: Usage) -> kvmesh_pb2.Usage:
    return kvmesh_pb2.Usage(
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens
    )


def _message(m: kvmesh_pb2.ChatMessage) -> dict:
    """A chat message as the template takes it, translated as HTTP's (``cluster/protocol/chat_messages.py``)."""
    calls = [HistoryToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls]
    return template_message(role=m.role, content=m.content, tool_calls=calls, tool_call_id=m.tool_call_id or None)


def _tools(request: kvmesh_pb2.GenerateRequest, chat: bool) -> ToolRequest | None:
    """The request's tools (``tools_json``, ``tool_choice``: a mode or a function's name), checked as HTTP's."""
    if not request.tools_json:
        return check_tools(None, request.tool_choice or None)
    if not chat:
        raise APIError("tools need a chat (messages), not a prompt", param="tools")
    try:
        tools = json.loads(request.tools_json)
    except ValueError:
        raise APIError("tools_json must be a JSON array of tools", param="tools") from None
    if not isinstance(tools, list):
        raise APIError("tools_json must be a JSON array of tools", param="tools")
    choice: str | dict | None = request.tool_choice or None
    if choice not in (None, "auto", "none", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
    return check_tools(tools, choice, parallel)


def _logprobs(items: list[TokenLogprob] | None) -> list[kvmesh_pb2.TokenLogprob]:
    return [
        kvmesh_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_ids=[i for i, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
        for lp in items or []
    ]


def _calls(calls: list[dict] | None) -> list[kvmesh_pb2.ToolCall]:
    return [
        kvmesh_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in calls or []
    ]


async def _fail(grpc_context, exc: APIError) -> NoReturn:
    """End the call with the status matching ``exc`` and details naming its parameter: ``abort`` on the
    ingress's own server; Ray's proxy context has no abort and reads the code and details set on it when
    the handler raises."""
    code = GRPC_STATUS.get(exc.status, grpc.StatusCode.INTERNAL)
    details = exc.message if not exc.param or exc.message.startswith(exc.param) else f"{exc.param}: {exc.message}"
    if hasattr(grpc_context, "abort"):
        await grpc_context.abort(code, details)
    grpc_context.set_code(code)
    grpc_context.set_details(details)
    raise exc


class GrpcApi:
    """The ingress's gRPC methods (mixed into ``kvmesh.cluster.ingress.deployment.Ingress``; named as the proto
    names them)."""

    generation: Generation
    admission: Admission

    async def _prepare_grpc(
        self, request: kvmesh_pb2.GenerateRequest, tenant: str
    ) -> tuple[Prepared, ToolReplies | None]:
        """The request prepared for the engine, and the parser of its replies when it offers tools."""
        optional = (
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "n",
            "min_tokens",
            "presence_penalty",
            "frequency_penalty",
            "logprobs",
        )
        params = sampling_params(
            **{f: getattr(request, f) for f in optional if request.HasField(f)},
            stop=list(request.stop),
            stop_token_ids=list(request.stop_token_ids),
            logit_bias=dict(request.logit_bias),
            json_schema=request.json_schema or None,
        )
        if len(request.messages) > MAX_MESSAGES:
            raise APIError(f"messages: at most {MAX_MESSAGES} messages, got {len(request.messages)}", param="messages")
        messages = [_message(m) for m in request.messages] or None
        tools, offered = _tools(request, messages is not None), None
        if tools is not None:
            if tools.forced_schema() is not None:
                if params.json_schema is not None:
                    raise APIError("json_schema cannot be combined with a forced tool_choice", param="json_schema")
                params = replace(params, json_schema=tools.forced_schema())
            messages, offered = self.generation.with_tools(messages, tools)
        prep = await self.generation.prepare(
            request.model,
            request.prompt,
            messages,
            params,
            "grpc",
            tenant,
            request.cache_salt or None,
            request.session_id or None,
            tools=offered,
        )
        return prep, ToolReplies(tools, self.generation.tool_syntax, params.n) if tools is not None else None

    def _admit(self, grpc_context) -> str:
        """The caller's tenant, once its key and the in-flight limit let it in (``release`` when done)."""
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

    async def Generate(self, request: kvmesh_pb2.GenerateRequest, grpc_context) -> AsyncIterator:
        try:
            tenant = self._admit(grpc_context)
        except APIError as exc:
            await _fail(grpc_context, exc)
        try:
            prep, tools = await self._prepare_grpc(request, tenant)
            async for chunk in self.generation.stream(prep):
                text, reason, calls = chunk.text, chunk.finish_reason, None
                if tools is not None:
                    text, calls, reason = tools.feed(chunk.index, text, reason)
                yield kvmesh_pb2.GenerateChunk(
                    text=text,
                    finish_reason=reason or "",
                    usage=_usage(chunk.usage) if chunk.usage is not None else None,
                    index=chunk.index,
                    tool_calls=_calls(calls),
                    logprobs=_logprobs(chunk.logprobs),
                )
        except APIError as exc:
            await _fail(grpc_context, exc)
        finally:
            self.admission.inflight.release()

    async def Complete(self, request: kvmesh_pb2.GenerateRequest, grpc_context) -> kvmesh_pb2.Completion:
        try:
            tenant = self._admit(grpc_context)
        except APIError as exc:
            await _fail(grpc_context, exc)
        try:
            prep, tools = await self._prepare_grpc(request, tenant)
            texts, reasons, last, logprobs = await gather(prep.params.n, self.generation.stream(prep))
        except APIError as exc:
            await _fail(grpc_context, exc)
        finally:
            self.admission.inflight.release()
        calls: list[list[dict]] = [[] for _ in texts]
        if tools is not None:
            texts, calls, reasons = tools.whole(texts, reasons)
        choices = [
            kvmesh_pb2.Choice(index=i, text=t, finish_reason=r, tool_calls=_calls(c), logprobs=_logprobs(lp))
            for i, (t, r, c, lp) in enumerate(zip(texts, reasons, calls, logprobs, strict=True))
        ]
        return kvmesh_pb2.Completion(
            id=prep.call.request_id, text=texts[0], finish_reason=reasons[0], usage=_usage(last.usage), choices=choices
        )
