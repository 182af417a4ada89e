"""What the engine returns per step and sequence: ``RequestOutput``, with its tokens' log-probabilities."""

from __future__ import annotations

from kvmesh.core.messages import TokenLogprob
from kvmesh.replica.request import Request

LogprobRow = tuple[float, list[int], list[float]]
"""A row's scored log-probability and its top alternatives' ids and log-probabilities, on the host."""


def token_logprob(token: int, row: LogprobRow, k: int) -> TokenLogprob:
    """A scored token's log-probability and its row's ``k`` most likely alternatives (the step computed as
    many as its most demanding row asked for)."""
    chosen, ids, values = row
    return TokenLogprob(token_id=token, logprob=chosen, top=list(zip(ids[:k], values[:k], strict=True)))


class RequestOutput:
    """One sequence's state after a step. ``text``/``token_ids`` are cumulative; ``delta_*`` are this step's.

    A request with ``n > 1`` reports each of its sequences separately, under the same ``request_id`` with
    its ``index`` (0..n-1), so streaming stays one flat list of outputs per step; the request is done when
    all ``n`` have ``finished``, or at once when one output has ``finish_reason`` "error".

    ``token_ids`` is read from the sequence's own token list when asked for (a step does not copy every
    sequence's whole output): it holds the tokens up to this output's step."""

    __slots__ = (
        "_end",
        "_start",
        "_tokens",
        "delta_text",
        "delta_token_ids",
        "error",
        "finish_reason",
        "index",
        "logprobs",
        "num_cached_tokens",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "text",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        token_ids: list[int],
        text: str,
        delta_text: str,
        delta_token_ids: list[int],
        num_cached_tokens: int,
        finish_reason: str | None = None,
        index: int = 0,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._tokens, self._start, self._end = token_ids, 0, len(token_ids)
        self.text = text
        self.delta_text = delta_text
        self.delta_token_ids = delta_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.finish_reason = finish_reason
        self.index = index
        self.error = error
        """Why the request failed (``finish_reason`` "error"): its data made an engine step fail."""
        self.logprobs = logprobs
        """One per token of ``delta_token_ids`` when the request asked for ``logprobs``."""
        self.prompt_logprobs: list[TokenLogprob] | None = None
        """On a sequence's first output, when asked for: prompt tokens 1.. scored given those before them."""

    @classmethod
    def of(cls, req: Request, delta_token_ids: list[int]) -> RequestOutput:
        """The output of ``req`` now, without copying its tokens (``token_ids`` slices them when read)."""
        out = cls.__new__(cls)
        out.request_id, out.prompt_token_ids, out.index = req.request_id, req.prompt_token_ids, req.index
        out._tokens, out._start, out._end = req.all_token_ids, len(req.prompt_token_ids), len(req.all_token_ids)
        out.finish_reason, out.error, out.logprobs, out.prompt_logprobs = req.finish_reason, None, None, None
        detok = req.detokenizer
        out.text, out.delta_text = detok.text, detok.take_delta(req.finish_reason is not None)
        out.delta_token_ids, out.num_cached_tokens = delta_token_ids, req.num_cached_tokens  # admitted: >= 0
        return out

    @property
    def token_ids(self) -> list[int]:
        return self._tokens[self._start : self._end]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"RequestOutput({self.request_id!r}, index={self.index}, tokens={len(self.token_ids)}, "
            f"finish_reason={self.finish_reason!r})"
        )
