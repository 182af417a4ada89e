"""The OpenAI API's response bodies: whole responses and stream chunks of chat and text completions.

Choices carry their ``index``, in whole responses and stream chunks alike; ``usage`` counts the prompt once
and the completion tokens of all choices.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvmesh.core.messages import TokenLogprob, Usage


def usage_dict(u: Usage) -> dict:
    """A request's ``Usage`` as OpenAI reports it."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class ResponseShape:
    """Builds the response objects of one request (``id``: its request id), chat or text completion, whole
    or as stream chunks, for its ``n`` choices (``index`` 0..n-1). ``token_text`` renders a token id as text,
    for log-probabilities (OpenAI's chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    completions': parallel ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` lists)."""

    def __init__(self, id: str, *, chat: bool, model: str, n: int = 1, token_text: Callable[[int], str] = str) -> None:
        self.id, self.chat, self.model, self.n = id, chat, model, n
        self.token_text = token_text
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

    def logprobs(self, items: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        """``items`` in the API's shape; ``offset``: characters of the choice's text before them."""
        if items is None:
            return None
        text = self.token_text
        if self.chat:

            def entry(token_id: int, logprob: float) -> dict:
                token = text(token_id)
                return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

            return {
                "content": [
                    {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in items
                ]
            }
        tokens = [text(lp.token_id) for lp in items]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [None if lp.logprob is None else {text(i): v for i, v in lp.top} for lp in items],
            "text_offset": offsets,
        }

    def whole(
        self,
        texts: list[str],
        finish_reasons: list[str | None],
        usage_: dict,
        logprobs: list[list[TokenLogprob] | None] | None = None,
        tool_calls: list[list[dict]] | None = None,
    ) -> dict:
        """The whole response; ``tool_calls``: each choice's calls (``ToolCall.as_dict``), for chat with tools."""
        choices = []
        for index, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True)):
            calls = tool_calls[index] if tool_calls else None
            message = {"role": "assistant", "content": text or (None if calls else text)}
            if calls:
                message["tool_calls"] = calls
            body = {"message": message} if self.chat else {"text": text}
            lps = self.logprobs(logprobs[index]) if logprobs else None
            choices.append({"index": index, **body, "finish_reason": reason, "logprobs": lps})
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, usage_)

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        first: bool = False,
        index: int = 0,
        logprobs: list[TokenLogprob] | None = None,
        offset: int = 0,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice |= {"finish_reason": finish_reason, "logprobs": self.logprobs(logprobs, offset)}
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice], None)

    def usage_chunk(self, usage_: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage_)
