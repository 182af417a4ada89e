"""What the front door refuses before doing any work: callers without a valid API key, oversized bodies and
requests beyond what the cluster can hold.

Refusing early and clearly is what keeps an overloaded cluster answering: a request over the ingress's
in-flight limit gets 429 with ``Retry-After`` at once, one the engine deployment cannot queue (Ray Serve's
``max_queued_requests``) gets 503 with ``Retry-After``, and neither is tokenized, hashed or routed first.
API keys are compared as SHA-256 digests in constant time; the keys themselves are not kept.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterable

from kvmesh.cluster.protocol.api_errors import APIError

API_KEYS_ENV = "KVMESH_API_KEYS"
"""Comma-separated API keys, added to the configured ones (on Kubernetes: from a Secret)."""

RETRY_AFTER_S = 1
"""What a refused client is told to wait: a replica frees a batch slot within about a second."""


def api_keys(configured: Iterable[str] = ()) -> list[str]:
    """The configured keys plus those in ``$KVMESH_API_KEYS``; blanks dropped. Empty: no authentication."""
    keys = [*configured, *os.environ.get(API_KEYS_ENV, "").split(",")]
    return [k.strip() for k in keys if k and k.strip()]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """Bearer-token check shared by HTTP (``Authorization`` header) and gRPC (``authorization`` metadata).

    ``tenant`` says who is calling: the matched key's digest (hex), which keys tenants' prefix caches
    apart; "" when no keys are configured (everyone is one tenant); None for a refused caller."""

    def __init__(self, digests: Iterable[bytes]) -> None:
        self._digests = list(digests)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def tenant(self, authorization: str | None) -> str | None:
        if not self._digests:
            return ""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = _digest(token.strip())
        matches = [hmac.compare_digest(digest, d) for d in self._digests]  # every key compared: no early exit
        return digest.hex() if any(matches) else None


class InflightLimit:
    """At most ``limit`` requests inside this ingress replica at once (0: unlimited). Single event loop: no
    lock needed, and ``acquire`` never waits: a full ingress refuses instead of queueing."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"the in-flight limit must be >= 0, got {limit}")
        self.limit = limit
        self.inflight = 0
        self.refused = 0

    def acquire(self) -> bool:
        if self.limit and self.inflight >= self.limit:
            self.refused += 1
            return False
        self.inflight += 1
        return True

    def release(self) -> None:
        self.inflight -= 1


class Admission:
    """The front door's limits, as one object the ingress builds and the middleware consults."""

    def __init__(
        self,
        key_digests: Iterable[str] = (),
        max_inflight: int = 0,
        max_body_bytes: int = 0,
        on_refused: Callable[[str], None] | None = None,
        enable_docs: bool = False,
    ) -> None:
        # The configured keys arrive as digests; keys from this process's environment (a Secret) are added.
        self.keys = ApiKeys([bytes.fromhex(d) for d in key_digests] + [_digest(k) for k in api_keys()])
        self.inflight = InflightLimit(max_inflight)
        self.max_body_bytes = max_body_bytes
        self.on_refused = on_refused
        """Called with the reason (``unauthenticated``, ``too_large``, ``over_capacity``) of each refusal."""
        self.enable_docs = enable_docs
        """Serve ``/docs``, ``/redoc`` and ``/openapi.json`` (off by default: they map the API for anyone)."""


def key_digests(keys: Iterable[str]) -> list[str]:
    """What the ingress is given instead of the keys: their SHA-256 digests (hex)."""
    return [_digest(k).hex() for k in keys]


PROTECTED_PREFIXES = ("/v1/", "/status", "/tokenize", "/detokenize", "/reset_prefix_cache")
"""Paths that need a key when keys are configured; ``/health`` and ``/metrics`` stay open for probes and
Prometheus (they reveal no prompt or reply)."""
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")

REASONS = {401: "unauthenticated", 404: "not_found", 413: "too_large", 429: "over_capacity"}
TENANT_STATE = "kvmesh_tenant"
"""Where the middleware leaves the caller's tenant (``ApiKeys.tenant``) in the ASGI scope's ``state``."""


def route_path(scope) -> str:
    """The path the app routes on: ``path`` without the ``root_path`` a proxy mounted the app under (Ray
    Serve sets it for any route prefix but ``/``). Checking the raw path would let ``/prefix/v1/...``
    through the key check."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path


def _error(status: int, message: str, code: str, kind: str, headers: dict[str, str] | None = None):
    """The ASGI messages of a refusal, in the same OpenAI error format as every other API error."""
    body = json.dumps(APIError(message, status, code=code, kind=kind).body()).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return [
        {"type": "http.response.start", "status": status, "headers": head},
        {"type": "http.response.body", "body": body},
    ]


class AdmissionMiddleware:
    """Pure ASGI middleware (streaming and client disconnects pass through untouched, unlike Starlette's
    ``BaseHTTPMiddleware``): 401 without a valid key, 413 for a body over the limit, 429 beyond the in-flight
    limit, 404 for the API docs unless enabled. A generation counts as in flight until its last byte is
    sent. The caller's tenant goes to the app in ``scope["state"][TENANT_STATE]``. ``admission`` is read per
    request (a callable), because the ingress builds it after the app exists."""

    def __init__(self, app, admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send) -> None:
        guard: Admission | None = self.admission() if scope["type"] == "http" else None
        if guard is None:
            return await self.app(scope, receive, send)
        path = route_path(scope)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = None
        tenant = guard.keys.tenant(headers.get("authorization"))
        scope.setdefault("state", {})[TENANT_STATE] = tenant or ""
        if path in DOCS_PATHS and not guard.enable_docs:
            refusal = _error(404, "Not Found", "not_found", "invalid_request_error")
        elif path.startswith(PROTECTED_PREFIXES) and tenant is None:
            refusal = _error(
                401,
                "Invalid or missing API key (send Authorization: Bearer <key>)",
                "invalid_api_key",
                "authentication_error",
                {"WWW-Authenticate": "Bearer"},
            )
        elif scope.get("method") == "POST" and guard.max_body_bytes:
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > guard.max_body_bytes):
                refusal = _error(
                    413,
                    f"Request body over the limit of {guard.max_body_bytes} bytes",
                    "request_too_large",
                    "invalid_request_error",
                )
            elif length is None:  # chunked: read it here, bounded, then replay it to the app
                receive, refusal = await _bounded_body(receive, guard.max_body_bytes)
        if refusal is None and path in GENERATION_PATHS:
            if not guard.inflight.acquire():
                refusal = _error(
                    429,
                    "The server is at capacity; retry shortly",
                    "rate_limit_exceeded",
                    "rate_limit_error",
                    {"Retry-After": str(RETRY_AFTER_S)},
                )
            else:
                try:
                    return await self.app(scope, receive, send)
                finally:
                    guard.inflight.release()
        if refusal is not None:
            if guard.on_refused is not None:
                guard.on_refused(REASONS[refusal[0]["status"]])
            for message in refusal:
                await send(message)
            return None
        return await self.app(scope, receive, send)


async def _bounded_body(receive, limit: int):
    """Read a body of unknown length up to ``limit`` bytes: (a receive that replays it, None) or (_, 413)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: let the app see it
            parts = None
            first = message
            break
        size += len(message.get("body", b""))
        if size > limit:
            return receive, _error(
                413, f"Request body over the limit of {limit} bytes", "request_too_large", "invalid_request_error"
            )
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            first = {"type": "http.request", "body": b"".join(parts), "more_body": False}
            break
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return first
        return await receive()

    return replay, None
