"""The OpenAI API as kvmesh speaks it: request models, their translation to engine calls, errors, responses.

Request models check types (FastAPI publishes them as the OpenAPI schema); value ranges are checked once,
by ``SamplingParams``, whose message becomes the 400's message. Unknown fields are ignored, as OpenAI and
vLLM do, so clients that send defaults (``presence_penalty: 0``, ``logprobs: false``) keep working; a field
we cannot honour is refused only when it asks for something (``logprobs: true``, tools).

``n`` (1 to ``MAX_N``) asks for that many choices from one prompt: the replica prefills the prompt once and
its sequences share its KV blocks. Choices carry their ``index``, in whole responses and stream chunks alike;
``usage`` counts the prompt once and the completion tokens of all choices.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replica.errors import InvalidRequest
from replica.limits import MAX_ID_CHARS
from replica.sampling_params import MAX_N, SamplingParams
from router.messages import Usage


class APIError(Exception):
    """An error the client caused or must handle, rendered in OpenAI's error format."""

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
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def sampling_params(top_k: int | None = None, stop: str | list[str] | None = None, **fields) -> SamplingParams:
    """``SamplingParams`` from API fields (HTTP and gRPC alike): fields left out or None keep their defaults
    (except ``max_tokens=None``: no limit), ``top_k`` -1 means off (vLLM's convention), and an out-of-range
    value becomes a 400 naming the field."""
    fields = {k: v for k, v in fields.items() if v is not None or k == "max_tokens"}
    try:
        return SamplingParams(
            **fields,
            top_k=0 if top_k in (None, -1) else top_k,
            stop=[stop] if isinstance(stop, str) else list(stop or []),
        )
    except InvalidRequest as exc:
        raise APIError(str(exc), param=exc.param) from exc


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, description=f"Choices to generate from the prompt, 1 to {MAX_N}.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    cache_salt: str | None = Field(
        default=None, max_length=MAX_ID_CHARS, description="Isolates prefix caching between tenants."
    )
    session_id: str | None = Field(
        default=None, max_length=MAX_ID_CHARS, description="Keeps a conversation on one replica."
    )
    logprobs: bool | int | None = None
    ignore_eos: bool = False

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.logprobs:
            raise APIError("logprobs are not supported", param="logprobs")
        return sampling_params(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            n=self.n,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


class ChatMessage(BaseModel):
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # OpenAI allows null only for assistant turns
            raise ValueError(f"content is required for a {self.role} message")
        return self

    def render(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else ""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None

    def check(self) -> SamplingParams:
        if self.tools:
            raise APIError("tools are not supported", param="tools")
        return self.sampling_params(self.max_completion_tokens or self.max_tokens)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def check(self) -> SamplingParams:
        if self.echo or self.suffix:
            raise APIError("echo and suffix are not supported", param="echo" if self.echo else "suffix")
        # OpenAI's default for completions is 16 tokens.
        return self.sampling_params(16 if self.max_tokens is None else self.max_tokens)

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a list of one prompt is accepted; batches are not)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError("batched prompts are not supported; send one prompt per request", param="prompt")
            p = p[0]
        if not p:
            raise APIError("prompt is empty", param="prompt")
        return p


_Request.model_rebuild()


def usage_dict(u: Usage) -> dict:
    """A request's ``Usage`` as OpenAI reports it."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class ResponseShape:
    """Builds the response objects of one request, chat or text completion, whole or as stream chunks, for
    its ``n`` choices (``index`` 0..n-1)."""

    def __init__(self, chat: bool, model: str, n: int = 1) -> None:
        self.chat, self.model, self.n = chat, model, n
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], usage_: dict | None) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_,
        }

    def whole(self, texts: list[str], finish_reasons: list[str | None], usage_: dict) -> dict:
        choices = []
        for index, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True)):
            body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
            choices.append({"index": index, **body, "finish_reason": reason, "logprobs": None})
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, usage_)

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False, index: int = 0) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice |= {"finish_reason": finish_reason, "logprobs": None}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], None)

    def usage_chunk(self, usage_: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage_)
