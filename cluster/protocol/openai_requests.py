"""The OpenAI API's request bodies as kvmesh takes them, and their translation to ``SamplingParams``.

Request models check types (FastAPI publishes them as the OpenAPI schema); value ranges are checked once,
by ``SamplingParams``, whose message becomes the 400's message. Unknown fields are ignored, as OpenAI and
vLLM do, so clients that send defaults (``presence_penalty: 0``, ``logprobs: false``) keep working. A known
OpenAI field kvmesh does not implement is refused with a 400 naming it whenever it asks for something
(``best_of: 2``, ``functions``): never a silent ignore. ``logprobs``, ``logit_bias``, the presence and
frequency penalties, ``response_format`` (JSON object or schema, by constrained decoding), ``tools`` and
``tool_choice`` (``cluster/protocol/tool_calls.py``) and vLLM's ``min_tokens`` and ``stop_token_ids`` are honoured.

``n`` (1 to ``MAX_N``) asks for that many choices from one prompt: the replica prefills the prompt once and
its sequences share its KV blocks.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmesh.cluster.protocol.api_errors import APIError
from kvmesh.cluster.protocol.api_params import sampling_params
from kvmesh.cluster.protocol.chat_messages import ChatRole, HistoryToolCall, template_message
from kvmesh.core.limits import MAX_ID_CHARS
from kvmesh.core.sampling_params import JSON_OBJECT_SCHEMA, MAX_LOGPROBS, MAX_N, SamplingParams

MAX_COMPLETION_LOGPROBS = 5
"""Completions' ``logprobs`` bound (OpenAI's)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = Field(
        default=None, description="Drop tokens less likely than min_p x the most likely one, 0 to 1 (0: off)."
    )
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
    top_logprobs: int | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = Field(
        default=None, description="Token id (as a string) -> bias in [-100, 100], added to its logit."
    )
    min_tokens: int | None = Field(default=None, description="Tokens generated before EOS or a stop token may be.")
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    best_of: int | None = None

    def unimplemented(self) -> dict[str, str]:
        """Known OpenAI fields this request sets to something kvmesh does not do: field -> why."""
        asked = {"best_of": self.best_of not in (None, 1)}
        return {name: "is not supported yet" for name, on in asked.items() if on}

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token to report (0: only the sampled token's logprob); None: no logprobs."""
        raise NotImplementedError

    def json_schema(self) -> str | None:
        """The JSON schema ``response_format`` constrains the output to (JSON text), None for free text."""
        kind = (self.response_format or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return JSON_OBJECT_SCHEMA
        if kind == "json_schema":
            schema = (self.response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(
                    "response_format.json_schema.schema must be a JSON schema object", param="response_format"
                )
            return json.dumps(schema)
        raise APIError(
            f"response_format type {kind!r} is not supported: text, json_object or json_schema", param="response_format"
        )

    def sampling_params(self, max_tokens: int | None, forced_schema: str | None = None) -> SamplingParams:
        """The engine's parameters; ``forced_schema``: the JSON schema a forced tool call constrains the reply
        to (``response_format`` cannot constrain it at the same time)."""
        for name, why in self.unimplemented().items():
            raise APIError(f"{name} {why}", param=name)
        if forced_schema is not None and self.json_schema() is not None:
            raise APIError("response_format cannot be combined with a forced tool_choice", param="response_format")
        return sampling_params(
            logprobs=self.logprobs_wanted(),
            json_schema=forced_schema or self.json_schema(),
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            n=self.n,
            logit_bias=_token_keys(self.logit_bias),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` as JSON carries it (token ids as strings) with integer keys; a key that is not an
    integer is a 400 naming the field."""
    if bias is None:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise APIError("logit_bias keys must be token ids (integers)", param="logit_bias") from None


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str = Field(max_length=MAX_ID_CHARS)
    arguments: str = ""


class AssistantToolCall(BaseModel):
    """A tool call an earlier assistant turn made, sent back in the history."""

    id: str = Field(default="", max_length=MAX_ID_CHARS)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # OpenAI allows null only for assistant turns
            raise ValueError(f"content is required for a {self.role} message")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def render(self) -> dict:
        """The message as chat templates take it (``cluster/protocol/chat_messages.py``); text parts joined."""
        content = self.content if isinstance(self.content, str) else ""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        calls = [
            HistoryToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
            for c in self.tool_calls or []
        ]
        return template_message(role=self.role, content=content, tool_calls=calls, tool_call_id=self.tool_call_id)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None

    def unimplemented(self) -> dict[str, str]:
        asked = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none", "auto"),
            "audio": self.audio is not None,
            "modalities": any(m != "text" for m in self.modalities or []),
            "prediction": self.prediction is not None,
        }
        return super().unimplemented() | {name: "is not supported yet" for name, on in asked.items() if on}

    def logprobs_wanted(self) -> int | None:
        """Chat: ``logprobs: true`` with ``top_logprobs`` 0-20 alternatives."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise APIError("logprobs must be a boolean for chat (top_logprobs sets how many)", param="logprobs")
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if not self.logprobs:
            return None
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise APIError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}", param="top_logprobs")
        return top

    def check(self, forced_schema: str | None = None) -> SamplingParams:
        return self.sampling_params(self.max_completion_tokens or self.max_tokens, forced_schema)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    def unimplemented(self) -> dict[str, str]:
        asked = {"suffix": bool(self.suffix)}
        return super().unimplemented() | {name: "is not supported yet" for name, on in asked.items() if on}

    def logprobs_wanted(self) -> int | None:
        """Completions: ``logprobs`` 0-5, the alternatives per token (OpenAI's legacy field)."""
        if self.top_logprobs is not None:
            raise APIError("top_logprobs is a chat field; completions take logprobs: 0-5", param="top_logprobs")
        if self.logprobs is None or self.logprobs is False:
            return None
        if isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(
                f"logprobs must be an integer between 0 and {MAX_COMPLETION_LOGPROBS}, got {self.logprobs}",
                param="logprobs",
            )
        return self.logprobs

    def check(self) -> SamplingParams:
        # OpenAI's default for completions is 16 tokens.
        params = self.sampling_params(16 if self.max_tokens is None else self.max_tokens)
        if self.echo and params.logprobs is not None:  # echo reports the prompt's log-probabilities too
            params.prompt_logprobs = params.logprobs
        return params

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


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a text ``prompt`` or chat ``messages``; ``add_special_tokens`` defaults as a
    generation would (text: true, chat: false, since the template has them)."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Any] | None = None
    """Tools the chat's template renders into the prompt, as a chat request with them would see it."""
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    tokens: list[int]


class LoadLoRARequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=256)


_Request.model_rebuild()
