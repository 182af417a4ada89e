"""The error a request ends with at the front door, for HTTP and gRPC alike: its status, the field it names
and a code. HTTP answers it in OpenAI's error format (``body``); gRPC maps the status to a status code
(``cluster/ingress/grpc_api.py``)."""

from __future__ import annotations


class APIError(Exception):
    """An error the client caused or must handle: a status (400, 404, 429, 503, ...), the field it names
    (``param``), a machine-readable ``code``, OpenAI's error type (``kind``) and headers (``Retry-After``)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.kind = kind or {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        self.headers = headers or {}

    def body(self) -> dict:
        """OpenAI's error object: what HTTP answers with (a response body, an SSE event)."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
