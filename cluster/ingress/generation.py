"""One generation, as the ingress runs it for HTTP and gRPC alike: prepare the call, stream its chunks.

``prepare`` validates the request (cheap checks first: nothing is rendered or tokenized for a request
whose size alone says it cannot fit), renders the chat template, tokenizes once (long texts in a worker
thread) and hashes the prompt's blocks once, into a ``GenerateCall``. ``stream`` sends it to the engine
deployment, whose router picks the replica, and yields its ``GenerateChunk``s with the request's metrics
recorded. A replica that fails before the first token costs nothing: the call is cancelled and sent
again under a fresh id (up to three times, after a short back-off). After the first token a failure ends the
stream with an ``APIError`` naming the cause. While no engine replica is alive (a node lost, all replicas
restarting) a request waits for one at most ``no_replica_timeout_s``, then gets a 503 with ``Retry-After``.
Torch-free: the tokenizer alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from jinja2 import TemplateError

from kvmesh.cluster.ingress.admission import RETRY_AFTER_S
from kvmesh.cluster.ingress.piece_tokens import PieceTokens
from kvmesh.cluster.monitoring import metrics
from kvmesh.cluster.protocol.api_errors import APIError
from kvmesh.cluster.protocol.tool_calls import ToolRequest, template_messages, template_syntax
from kvmesh.core.errors import InvalidRequest, RequestFailed
from kvmesh.core.hashing import first_block_extra, hash_blocks, model_seed
from kvmesh.core.limits import MAX_MESSAGES, check_for_model, check_prompt_ids, check_request_fields
from kvmesh.core.messages import GenerateCall, GenerateChunk, TokenLogprob
from kvmesh.core.model_files import render_chat
from kvmesh.core.sampling_params import SamplingParams
from kvmesh.router import metrics as router_metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandleErrors:
    """What an engine handle raises when the replica serving a call died or became unreachable (retried before
    the first token) and when every replica is busy and its queue is full (a 503). Ray Serve's handle has its
    own (``cluster/ingress/deployment.py``); a ``LocalHandle`` raises neither, and keeps this module Ray-free."""

    replica_failed: tuple[type[BaseException], ...] = ()
    overloaded: tuple[type[BaseException], ...] = ()


LOCAL_HANDLE_ERRORS = HandleErrors()
RETRY_ATTEMPTS, RETRY_BACKOFF_S = 4, 0.25
"""A request whose replica dies before its first token is sent up to three more times, after 0.25, 0.5 and
1 s: until Serve's long poll tells the routers of the death (about a second), a retry may be offered the
dead replica again (its index entries live until its heartbeat expires), so the waits span ~2 s."""
NO_REPLICA_POLL_S = 0.25
"""How often a request waiting for its first chunk checks that some engine replica is alive."""
TOKENIZE_INLINE_CHARS = 8192
"""Texts shorter than this are tokenized on the event loop (a thread hop costs more than the work)."""


class NoLiveReplica(Exception):
    """No engine replica was alive for the whole bound while the request waited."""


async def first_then_rest(
    chunks: AsyncIterator[GenerateChunk], bound_s: float, live: Callable[[], int | None]
) -> AsyncIterator[GenerateChunk]:
    """``chunks``, except that waiting for the first one ends in ``NoLiveReplica`` once ``live()`` has said
    0 for ``bound_s`` (None, not known yet, does not count). A request queued behind busy replicas waits."""
    chunks = aiter(chunks)
    first = asyncio.ensure_future(anext(chunks))
    # Cancelled by a 503 below, it may still end in Ray's RequestCancelledError: retrieved, never logged.
    first.add_done_callback(lambda f: f.cancelled() or f.exception())
    zero_since = None
    try:
        while not first.done():
            await asyncio.wait({first}, timeout=NO_REPLICA_POLL_S)
            if first.done():
                break
            if live() != 0:
                zero_since = None
            elif zero_since is None:
                zero_since = time.monotonic()
            elif time.monotonic() - zero_since >= bound_s:
                raise NoLiveReplica
    finally:
        if not first.done():
            first.cancel()
    try:
        chunk = first.result()
    except StopAsyncIteration:
        return
    yield chunk
    async for chunk in chunks:
        yield chunk


class LocalStream:
    """One call's chunks from a generator in this process (``kvmesh engine``'s engine, ``kvmesh router``'s
    workers), consumed as a deployment handle's response stream is."""

    def __init__(self, chunks: AsyncIterator[GenerateChunk]) -> None:
        self._chunks = chunks

    def __aiter__(self) -> LocalStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        return await anext(self._chunks)

    def cancel(self) -> None:
        """Stop the engine request (the generator's cleanup aborts it) without waiting for it."""
        asyncio.get_running_loop().create_task(self._chunks.aclose())


class LocalHandle:
    """What ``Generation`` uses of a deployment handle (``options``, ``remote``) over a generate function in
    this process: an engine's (``kvmesh engine``) or a router's over its workers (``kvmesh router``)."""

    def __init__(self, generate: Callable[[GenerateCall], AsyncIterator[GenerateChunk]]) -> None:
        self._generate = generate

    def options(self, **_: object) -> LocalHandle:
        return self

    def remote(self, call: GenerateCall) -> LocalStream:
        return LocalStream(self._generate(call))


def new_request_id(chat: bool) -> str:
    """A new request's id: the engine's request id and the response's id, over HTTP and gRPC alike (with
    OpenAI's prefixes, which its clients show)."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


@dataclass
class Prepared:
    """A validated request, tokenized and hashed, ready for the engine."""

    call: GenerateCall
    params: SamplingParams
    chat: bool
    """A chat (``messages``) rather than a text prompt."""
    api: str
    """``chat``, ``completions`` or ``grpc``: the label of its metrics."""


def _utf8_bytes(text: str, param: str) -> int:
    """UTF-8 bytes of ``text``; a 400 naming ``param`` for a lone surrogate (JSON can escape one; no tokenizer
    takes it)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise APIError("the text is not valid Unicode (it holds a lone surrogate)", param=param) from None


@dataclass
class ModelLimits:
    """What a request is checked against: the served model's names, vocabulary, context and tokens."""

    names: set[str]
    served_name: str
    vocab_size: int
    max_model_len: int
    max_prompt_bytes: int
    """UTF-8 bytes of text beyond which a prompt cannot fit the context (``prompt_byte_limit``): counted in
    bytes, since a token stands for at most so many bytes, not characters."""
    max_n: int


class Generation:
    """Prepares and streams generations against the engine deployment's handle, for one served model."""

    def __init__(
        self,
        engine_handle,
        tokenizer,
        model: str,
        block_size: int,
        limits: ModelLimits,
        share_prefix_cache: bool = False,
        no_replica_timeout_s: float = 5.0,
        errors: HandleErrors = LOCAL_HANDLE_ERRORS,
    ) -> None:
        """``engine_handle``: a Serve deployment handle or a ``LocalHandle``; ``errors``: what it raises."""
        self.handle = engine_handle.options(method_name="generate", stream=True)
        self.errors = errors
        self.no_replica_timeout_s = no_replica_timeout_s
        self.tokenizer = tokenizer
        self.pieces = PieceTokens.of(tokenizer)
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)
        self.block_size = block_size
        self.seed = model_seed(model)
        self.limits = limits
        self.share_prefix_cache = share_prefix_cache
        self.adapters: dict[str, str] = {}
        """LoRA adapters a request's ``model`` may name, with their directories (kept by the server that loads
        them)."""
        self.tool_syntax = template_syntax(getattr(tokenizer, "chat_template", None))
        """The tool-call syntax the model's chat template teaches; None: it renders no tools (kvmesh does)."""

    # ------------------------------------------------------------------ preparing
    def cache_salt(self, tenant: str, client_salt: str | None) -> str | None:
        """The salt a request's blocks are hashed with: the client's own, keyed by its API key unless the
        operator shares one cache across keys. Tenants then neither share nor can probe each other's cached
        prefixes (``cached_tokens`` would otherwise tell one whether another's prompt is cached)."""
        if not tenant or self.share_prefix_cache:
            return client_salt
        return f"key:{tenant}" + (f"|{client_salt}" if client_salt is not None else "")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (a rendered chat carries its own special tokens: encode it without, piece by
        piece, its history's pieces remembered: ``piece_tokens.py``); long texts in a worker thread (the
        tokenizer releases the GIL), so other streams on this loop keep flowing."""
        if add_special_tokens or self.pieces is None:
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=add_special_tokens)
        else:
            encode = self.pieces.encode
        if len(text) < TOKENIZE_INLINE_CHARS:
            return encode(text)
        return await asyncio.to_thread(encode, text)

    def with_tools(self, messages: list[dict], tools: ToolRequest | None) -> tuple[list[dict], list[dict] | None]:
        """A chat's messages and the tool entries to hand its template: the template's own rendering of tools
        where it has one, else the tools written into a system message (``cluster/protocol/tool_calls.py``)."""
        offered = None
        if tools is not None and self.tool_syntax is not None:
            offered = [{"type": "function", "function": f} for f in tools.functions]
        return template_messages(messages, tools, self.tool_syntax), offered

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 if it names neither."""
        if model in self.adapters:
            return model
        self.check_model(model)
        return None

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` (empty: the served one) is a name this server serves."""
        if model and model not in self.limits.names and model not in self.adapters:
            raise APIError(
                f"The model `{model}` does not exist; this server serves `{self.limits.served_name}`",
                status=404,
                param="model",
                code="model_not_found",
                kind="invalid_request_error",
            )

    async def token_ids(
        self,
        prompt: str | list[int] | None,
        messages: list[dict] | None,
        add_special_tokens: bool | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The prompt's token ids as a generation would see them: a chat rendered by the model's template
        (with ``tools``, OpenAI's entries, where the template renders them), text encoded, ids checked.
        ``add_special_tokens`` None: the generation's choice (text: yes, chat: no, its template has them).
        400 for what cannot fit the context or is not in the vocabulary."""
        lim = self.limits
        param = "messages" if messages is not None else "prompt"
        texts = (
            [m["content"] for m in messages] if messages is not None else [prompt] if isinstance(prompt, str) else []
        )
        text_bytes = sum(_utf8_bytes(text, param) for text in texts)
        if messages is not None:
            if len(messages) > MAX_MESSAGES:
                raise APIError(f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}", param=param)
            if text_bytes > lim.max_prompt_bytes:
                raise self._too_long(param)
            try:
                text = render_chat(self.tokenizer, messages, tools)
            except TemplateError as exc:  # e.g. roles that do not alternate, for templates that insist
                raise APIError(f"messages: {exc}", param=param) from exc
            if _utf8_bytes(text, param) > lim.max_prompt_bytes:  # tools and tool calls are rendered into it too
                raise self._too_long(param)
            return await self.encode(text, bool(add_special_tokens))
        if isinstance(prompt, str):
            if text_bytes > lim.max_prompt_bytes:
                raise self._too_long(param)
            return await self.encode(prompt, add_special_tokens is not False)
        ids = list(prompt or [])
        if len(ids) > lim.max_model_len:
            raise self._too_long(param)
        try:
            check_prompt_ids(ids, lim.vocab_size)
        except InvalidRequest as exc:
            raise APIError(str(exc), param=param) from exc
        return ids

    def _token_text(self, token_id: int) -> str:
        """One token as text, for log-probabilities (``token_text`` caches it: the same tokens recur)."""
        return self.tokenizer.decode([token_id])

    def detokenize(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens included, as vLLM's ``/detokenize`` returns it)."""
        if not ids:
            return ""
        if len(ids) > self.limits.max_model_len:
            raise self._too_long("tokens")
        try:
            check_prompt_ids(ids, self.limits.vocab_size, "tokens")
        except InvalidRequest as exc:
            raise APIError(str(exc), param=exc.param) from exc
        return self.tokenizer.decode(ids)

    def _too_long(self, param: str) -> APIError:
        return APIError(
            f"This model's maximum context length is {self.limits.max_model_len} tokens; the request's text is "
            "longer than that many tokens could be",
            param=param,
            code="context_length_exceeded",
        )

    async def prepare(
        self,
        model: str,
        prompt: str | list[int] | None,
        messages: list[dict] | None,
        params: SamplingParams,
        api: str,
        tenant: str,
        cache_salt: str | None = None,
        session_id: str | None = None,
        tools: list[dict] | None = None,
    ) -> Prepared:
        """Validate, tokenize and hash one request into its ``GenerateCall``; ``APIError`` if it is refused.
        ``tools``: OpenAI's tool entries, for a chat template that renders them."""
        lim = self.limits
        lora = self.adapter_of(model)
        try:
            check_request_fields(cache_salt=cache_salt, session_id=session_id)
            check_for_model(params, lim.vocab_size)
        except InvalidRequest as exc:
            raise APIError(str(exc), param=exc.param) from exc
        if params.n > lim.max_n:
            raise APIError(
                f"n must be at most {lim.max_n} on this server (a replica's choices run at once), got {params.n}",
                param="n",
            )
        param = "messages" if messages is not None else "prompt"
        ids = await self.token_ids(prompt, messages, tools=tools)
        if not ids:
            raise APIError("prompt is empty", param=param)
        wanted = len(ids) + (params.max_tokens or 1)
        if wanted > lim.max_model_len:
            raise APIError(
                f"This model's maximum context length is {lim.max_model_len} tokens; the request needs "
                f"{wanted} ({len(ids)} prompt + {params.max_tokens or 1} completion)",
                param=param,
                code="context_length_exceeded",
            )
        salt = self.cache_salt(tenant, cache_salt)
        hashes = hash_blocks(ids, self.block_size, self.seed, first_block_extra(salt, lora))
        call = GenerateCall(
            request_id=new_request_id(chat=messages is not None),
            prompt_token_ids=ids,
            block_hashes=hashes,
            block_size=self.block_size,
            params=params,
            session_id=session_id,
            cache_salt=salt,
            lora_name=lora,
            lora_path=self.adapters[lora] if lora is not None else None,
        )
        return Prepared(call, params, messages is not None, api)

    # ------------------------------------------------------------------ streaming
    async def stream(self, prep: Prepared) -> AsyncIterator[GenerateChunk]:
        """The request's chunks (of its ``n`` choices, interleaved), its metrics recorded; the last carries
        ``usage``. Engine-side refusals surface as ``APIError`` before anything is yielded."""
        model = self.limits.served_name
        t0 = time.perf_counter()
        last, n_out, outcome, usage = t0, 0, "error", None
        last_of_choice: dict[int, float] = {}  # inter-token latency is measured within each choice
        inter_token = metrics.INTER_TOKEN.labels(model)  # looked up once: observed per chunk
        sent: list = []  # the engine streams of this request's attempts, the current one last
        try:
            async with contextlib.aclosing(self._attempts(prep, sent)) as chunks:
                async for chunk in chunks:
                    now, previous = time.perf_counter(), last_of_choice.get(chunk.index)
                    if n_out == 0:
                        metrics.TTFT.labels(model).observe(now - t0)
                    elif chunk.token_ids and previous is not None:
                        inter_token.observe((now - previous) / len(chunk.token_ids))
                    last = last_of_choice[chunk.index] = now
                    n_out += len(chunk.token_ids)
                    if chunk.usage is not None:
                        outcome, usage = "ok", chunk.usage
                    yield chunk
        except Exception as exc:
            outcome, error, cancel = self._failure(exc, prep.call.request_id, n_out)
            if cancel and sent:
                sent[-1].cancel()
            raise error from exc
        except BaseException:
            outcome = "aborted" if outcome == "error" and n_out else outcome
            if sent:
                sent[-1].cancel()  # the client left or the caller failed: free the engine's blocks now
            raise
        finally:
            metrics.REQUESTS.labels(model, prep.api, outcome).inc()
            if usage is not None:
                metrics.E2E.labels(model).observe(last - t0)
                metrics.PROMPT_TOKENS.labels(model).inc(usage.prompt_tokens)
                metrics.CACHED_TOKENS.labels(model).inc(usage.cached_tokens)
                metrics.GENERATED_TOKENS.labels(model).inc(usage.completion_tokens)

    async def _attempts(self, prep: Prepared, sent: list) -> AsyncIterator[GenerateChunk]:
        """The engine's chunks for ``prep``. A replica that fails before the first chunk is cancelled and the
        call sent again after a back-off, under a new id (a replica still running the first must not see the
        same id again). ``sent`` gets each attempt's stream, for the caller to cancel."""
        for attempt in range(1, RETRY_ATTEMPTS + 1):
            call = prep.call if attempt == 1 else replace(prep.call, request_id=f"{prep.call.request_id}-{attempt}")
            stream = self.handle.remote(call)
            sent.append(stream)
            started = False
            try:
                async for chunk in first_then_rest(stream, self.no_replica_timeout_s, router_metrics.live_replicas):
                    started = True
                    yield chunk
                return
            except self.errors.replica_failed as exc:
                if started or attempt == RETRY_ATTEMPTS:
                    raise
                stream.cancel()
                metrics.RETRIES.labels(self.limits.served_name).inc()
                log.warning(
                    "request %s: its replica failed before the first token (%r); retrying", call.request_id, exc
                )
                # Routers learn of a death through Serve's long poll; until then a retry may be offered the
                # same dead replica, so back off a little before each new attempt.
                await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))

    def _failure(self, exc: Exception, request_id: str, n_out: int) -> tuple[str, APIError, bool]:
        """How a request that raised ``exc`` after ``n_out`` tokens ends: its outcome label, the client's
        error, and whether the engine's stream is still to be cancelled (not where the engine or Serve ended
        it)."""
        if isinstance(exc, self.errors.overloaded):
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            message = "Every replica is busy and the queue is full; retry shortly"
            return "rejected", APIError(message, 503, code="overloaded", headers=headers), False
        if isinstance(exc, NoLiveReplica):
            message = f"No engine replica is alive (none for {self.no_replica_timeout_s:g} s); retry shortly"
            headers = {"Retry-After": str(max(1, round(self.no_replica_timeout_s)))}
            return "unavailable", APIError(message, 503, code="no_replica", headers=headers), True
        cause = getattr(exc, "cause", None) or exc  # Ray wraps the replica's exception
        if isinstance(exc, ValueError):  # the engine refused the request (e.g. longer than its KV pool)
            return "client_error", APIError(str(cause), param=getattr(cause, "param", None) or "prompt"), False
        if isinstance(exc, self.errors.replica_failed):
            log.warning("request %s: its replica failed after %d tokens: %r", request_id, n_out, exc)
            failed = type(exc).__name__
            message = f"The replica serving this request failed ({failed}) after {n_out} tokens; retry the request"
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            return "error", APIError(message, 503, code="replica_failed", headers=headers), False
        # The engine failed: the client gets a clean 500, not a traceback. A request the engine failed alone says
        # why (its own data broke a step); anything else only names the exception's type.
        log.warning("request %s failed in the engine: %r", request_id, cause)
        detail = str(cause) if isinstance(cause, RequestFailed) else type(cause).__name__
        return "error", APIError(f"generation failed: {detail}", 500, code="generation_failed"), True


async def gather(
    n: int, chunks: AsyncIterator[GenerateChunk]
) -> tuple[list[str], list[str | None], GenerateChunk, list[list[TokenLogprob] | None]]:
    """A whole response from a request's chunks: each choice's text, finish reason and log-probabilities
    (None unless asked for), and the last chunk (it carries ``usage``)."""
    texts: list[str] = [""] * n
    reasons: list[str | None] = [None] * n
    logprobs: list[list[TokenLogprob] | None] = [None] * n
    last = None
    async for chunk in chunks:
        texts[chunk.index] += chunk.text
        reasons[chunk.index] = chunk.finish_reason or reasons[chunk.index]
        if chunk.logprobs is not None:
            logprobs[chunk.index] = (logprobs[chunk.index] or []) + chunk.logprobs
        last = chunk
    if last is None or last.usage is None:
        raise APIError("the engine ended the request without output", status=500)
    return texts, reasons, last, logprobs
